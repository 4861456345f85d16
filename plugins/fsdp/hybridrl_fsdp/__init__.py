"""hybridrl-fsdp: PyTorch FSDP2 (``fully_shard``) training engine for Hugging Face causal LMs."""
