"""Registration of the SGLang rollout engine. The engine itself lands with its own issue."""

from hybridrl import hookimpl


@hookimpl
def hybridrl_register_backends(registry):
    registry.add_rollout("sglang", "hybridrl_sglang.engine:SGLangRollout", requires=["sglang>=0.5.16"],
                         devices=("cuda",), install_hint="pip install 'hybridrl-sglang[engine]' (needs a CUDA GPU)")
