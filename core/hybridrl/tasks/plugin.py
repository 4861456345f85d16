"""The core's bundled task: registers the ``reverse`` reward and dataset (registered directly by the host,
``plugins.discovery.CORE_PLUGINS``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridrl.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from hybridrl.plugins.registry import Registry


@hookimpl
def hybridrl_register_rewards(registry: "Registry") -> None:
    registry.add_reward("reverse", "hybridrl.tasks.reverse:reverse_reward")


@hookimpl
def hybridrl_register_datasets(registry: "Registry") -> None:
    registry.add_dataset("reverse", "hybridrl.tasks.reverse:make_reverse_rows")
