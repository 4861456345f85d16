"""Registration of the FSDP2 train engine (imports nothing heavy: the engine loads on first use)."""

import importlib.util

from hybridrl import hookimpl


def liger_installed() -> bool:
    """Whether liger-kernel, the fused layer kernels' library (``hybridrl_fsdp.layer_kernels``), is importable."""
    return importlib.util.find_spec("liger_kernel") is not None


#: the layers' fused kernels (``options.fused_kernels``) exist where liger-kernel is installed; the memory plan
#: counts what they save only where the backend declares them.
FUSED_LAYERS = ("fused_layer_kernels",) if liger_installed() else ()


@hookimpl
def hybridrl_register_backends(registry):
    registry.add_train_engine("fsdp", "hybridrl_fsdp.engine:FSDPEngine", requires=["torch>=2.6"],
                              process_family="torch-dist",
                              supports={"checkpoint", "greedy_margins", "value_head", "reward_head", "offload", "lora",
                                        "routing_replay", *FUSED_LAYERS},
                              options="hybridrl_fsdp.settings:FSDPSettings",
                              resolve_options="hybridrl_fsdp.settings:auto_options",
                              memory_model="hybridrl_fsdp.memory:FSDP_MEMORY",
                              oom_fixes="hybridrl_fsdp.memory:oom_fixes",
                              shares_prompts="hybridrl_fsdp.memory:shares_prompts")
