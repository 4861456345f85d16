"""The project's own CPU backends pass the conformance kit, run exactly as a plugin author runs it: by
subclassing the contracts with the registered names."""

from __future__ import annotations

from hybridrl.testing import BridgeContract, RolloutEngineContract, TrainEngineContract


class TestHFRollout(RolloutEngineContract):
    backend = "hf"


class TestFSDPTrainEngine(TrainEngineContract):
    backend = "fsdp"


class TestFSDPToHFBridge(BridgeContract):
    trainer_backend = "fsdp"
    rollout_backend = "hf"
