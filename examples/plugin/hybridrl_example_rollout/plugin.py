"""Registration: imports nothing heavy, so listing plugins or checking a config stays fast."""

from hybridrl import hookimpl


@hookimpl
def hybridrl_register_backends(registry):
    # By import path: the engine module (and transformers) loads only in the worker that builds it.
    # ``requires`` names the engine packages (import names); a missing one is reported with the hint.
    registry.add_rollout("example", "hybridrl_example_rollout.engine:ExampleRollout", requires=["transformers>=4.57"],
                         install_hint="pip install hybridrl-example-rollout",
                         supports={"sleep", "named_weights"})  # what it can do beyond generate/import_weights
    # A train engine in plain PyTorch beside it (train_engine.py): one rank only, so a pool of two or more
    # devices for it is refused by pre-flight.
    registry.add_train_engine("example_train", "hybridrl_example_rollout.train_engine:ExampleTrainer",
                              requires=["transformers>=4.57"], install_hint="pip install hybridrl-example-rollout",
                              supports={"checkpoint", "offload"}, max_ranks=1,
                              # what a role of it holds on its device (memory.py, no torch): ``hybridrl plan``
                              # sizes it and the auto search picks its micro-batch
                              memory_model="hybridrl_example_rollout.memory:ExampleTrainerMemory")
