"""hybridrl-megatron: Megatron-core training engine (tensor, pipeline and data parallel)."""
