"""hybridrl-example-rollout: the smallest complete rollout backend plugin (see docs/plugins.md)."""

__version__ = "0.1.0"
