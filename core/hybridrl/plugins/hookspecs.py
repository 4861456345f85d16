"""Hook specifications: every plugin, the core's own defaults included, extends hybridrl through these.

Each hook receives a registry object and calls its ``add_*`` methods (the llm / tox pattern), so a plugin
never needs to return lists or know about the other plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from hybridrl.plugins.registry import Registry

PROJECT = "hybridrl"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def hybridrl_register_backends(registry: Registry) -> None:
    """Add train engines, rollout engines and reshard bridges (``registry.add_train_engine`` ...)."""


@hookspec
def hybridrl_register_algorithms(registry: Registry) -> None:
    """Add advantage estimators, policy losses, loss aggregations and KL estimators."""


@hookspec
def hybridrl_register_rewards(registry: Registry) -> None:
    """Add reward functions by name (``registry.add_reward``)."""


@hookspec
def hybridrl_register_trackers(registry: Registry) -> None:
    """Add metric trackers by name (``registry.add_tracker``)."""


@hookspec
def hybridrl_register_datasets(registry: Registry) -> None:
    """Add named prompt datasets (``registry.add_dataset``)."""


@hookspec
def hybridrl_register_environments(registry: Registry) -> None:
    """Add episode environments, the tools they call and tool-call parsers (``registry.add_environment``,
    ``add_tool``, ``add_tool_parser``)."""
