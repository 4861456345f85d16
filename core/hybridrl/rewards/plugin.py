"""The core's built-in rewards (registered directly by the host, ``plugins.discovery.CORE_PLUGINS``):
``gsm8k``, ``math`` and ``format`` (``hybridrl.rewards.math``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridrl.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from hybridrl.plugins.registry import Registry


@hookimpl
def hybridrl_register_rewards(registry: Registry) -> None:
    registry.add_reward("gsm8k", "hybridrl.rewards.math:gsm8k_reward")
    registry.add_reward("math", "hybridrl.rewards.math:math_reward")
    registry.add_reward("format", "hybridrl.rewards.math:format_reward")
