"""The core's embedded rollout backend: ``hf`` (plain transformers), registered through entry point ``core-rollout``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridrl.hookspecs import hookimpl

if TYPE_CHECKING:
    from hybridrl.registry import Registry


@hookimpl
def hybridrl_register_backends(registry: "Registry") -> None:
    # Registered by import path: listing plugins never imports transformers' model code.
    registry.add_rollout("hf", "hybridrl.rollout.hf:HFRollout", process_family="any")
