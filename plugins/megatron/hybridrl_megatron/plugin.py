"""Registration of the Megatron-core train engine. The engine itself lands with its own issue."""

from hybridrl import hookimpl


@hookimpl
def hybridrl_register_backends(registry):
    # Megatron keeps global parallel state, so it gets its own process per device.
    registry.add_train_engine("megatron", "hybridrl_megatron.engine:MegatronEngine",
                              requires=["megatron.core>=0.13"], process_family="megatron",
                              install_hint="pip install 'hybridrl-megatron[engine]'")
