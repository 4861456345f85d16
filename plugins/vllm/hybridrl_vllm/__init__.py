"""hybridrl-vllm: vLLM rollout engine (colocated sleep/wake, weights in buckets, split mode)."""
