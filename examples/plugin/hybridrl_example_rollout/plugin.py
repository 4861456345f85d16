"""Registration: imports nothing heavy, so listing plugins or checking a config stays fast."""

from hybridrl import hookimpl


@hookimpl
def hybridrl_register_backends(registry):
    # By import path: the engine module (and transformers) loads only in the worker that builds it.
    # ``requires`` names the engine packages (import names); a missing one is reported with the hint.
    registry.add_rollout("example", "hybridrl_example_rollout.engine:ExampleRollout", requires=["transformers>=4.57"],
                         install_hint="pip install hybridrl-example-rollout",
                         supports={"sleep", "named_weights"})  # what it can do beyond generate/import_weights
