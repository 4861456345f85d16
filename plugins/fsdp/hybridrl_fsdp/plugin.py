"""Registration of the FSDP2 train engine (imports nothing heavy: the engine loads on first use)."""

from hybridrl import hookimpl


@hookimpl
def hybridrl_register_backends(registry):
    registry.add_train_engine("fsdp", "hybridrl_fsdp.engine:FSDPEngine", requires=["torch>=2.6"],
                              process_family="torch-dist",
                              supports={"checkpoint", "greedy_margins", "value_head", "reward_head", "offload", "lora"},
                              check_options="hybridrl_fsdp.settings:option_problems")
