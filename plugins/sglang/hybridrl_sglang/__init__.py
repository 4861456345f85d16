"""hybridrl-sglang: SGLang rollout engine (memory saver, tensor weight updates, split mode)."""
