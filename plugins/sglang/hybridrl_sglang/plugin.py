"""Registration of the SGLang rollout engine and its split-pool bridge (the engine is imported lazily, in the
worker that builds it; the core never imports SGLang)."""

from hybridrl import hookimpl


@hookimpl
def hybridrl_register_backends(registry):
    registry.add_rollout("sglang", "hybridrl_sglang.engine:SGLangRollout", requires=["sglang>=0.5.16"],
                         devices=("cuda",), install_hint="pip install 'hybridrl-sglang[engine]' (needs a CUDA GPU)",
                         supports={"sleep", "requests", "tensor_parallel", "return_routing"},
                         check_options="hybridrl_sglang.options:option_problems",
                         options="hybridrl_sglang.options:OPTIONS",
                         memory_model="hybridrl_sglang.memory:SGLANG_MEMORY",
                         oom_fixes="hybridrl_sglang.memory:oom_fixes")
    # Split pools: the core's broadcast bridge unless roles.rollout.options.weight_sync=distributed.
    from hybridrl_sglang.distributed import SGLangBroadcastBridge  # torch only, no SGLang

    registry.add_bridge("*", "sglang", "broadcast", SGLangBroadcastBridge)
