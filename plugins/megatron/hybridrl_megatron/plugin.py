"""Registration of the Megatron-core train engine (``hybridrl_megatron.engine.MegatronEngine``)."""

from hybridrl import hookimpl


@hookimpl
def hybridrl_register_backends(registry):
    # Megatron keeps global parallel state, so it gets its own process family: only Megatron roles (and
    # backends of family "any", such as the transformers rollout) share its processes.
    registry.add_train_engine("megatron", "hybridrl_megatron.engine:MegatronEngine",
                              requires=["megatron.core>=0.16,<0.17"], process_family="megatron",
                              install_hint="pip install 'hybridrl-megatron[engine]'",
                              supports={"checkpoint", "greedy_margins", "value_head", "offload"},
                              check_options="hybridrl_megatron.settings:option_problems",
                              options="hybridrl_megatron.settings:OPTIONS",
                              memory_model="hybridrl_megatron.memory:MEGATRON_MEMORY",
                              oom_fixes="hybridrl_megatron.memory:oom_fixes")
