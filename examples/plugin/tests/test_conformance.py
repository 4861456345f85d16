"""The plugin's own test suite: the hybridrl conformance kit, pointed at this backend by name.

Equivalent to ``pytest --hybridrl-backend=example``; subclassing lets the plugin keep the battery in its
own test run and set class attributes (device, engine_options, tolerances)."""

from hybridrl.testing import BridgeContract, RolloutEngineContract, TrainEngineContract


class TestExampleRollout(RolloutEngineContract):
    backend = "example"


class TestFSDPToExample(BridgeContract):
    trainer_backend = "fsdp"
    rollout_backend = "example"


class TestExampleTrainer(TrainEngineContract):
    backend = "example_train"


class TestExampleTrainerToExample(BridgeContract):
    trainer_backend = "example_train"
    rollout_backend = "example"
