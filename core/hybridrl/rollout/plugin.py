"""The core's embedded rollout backend: ``hf`` (plain transformers), registered directly by the host
(``plugins.discovery.CORE_PLUGINS``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridrl.plugins.hookspecs import hookimpl
from hybridrl.plugins.options import OptionDoc

if TYPE_CHECKING:
    from hybridrl.plugins.registry import Registry


#: what ``hybridrl plugins hf`` shows (``HFRollout`` reads them from ``ctx.options``).
OPTIONS = (OptionDoc("attn_implementation", "str | None", None,
                     "the attention kernels transformers loads the model with (e.g. sdpa, eager; default: "
                     "transformers' choice)"),)


@hookimpl
def hybridrl_register_backends(registry: Registry) -> None:
    # Registered by import path: listing plugins never imports transformers' model code.
    registry.add_rollout("hf", "hybridrl.rollout.hf:HFRollout", process_family="any",
                         supports={"sleep", "named_weights", "lora_adapters", "partial", "refill", "return_routing"},
                         memory_model="hybridrl.rollout.memory:HF_MEMORY", options=OPTIONS)
