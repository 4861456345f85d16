"""Plugin discovery: a pluggy manager holding the core's own defaults (registered directly, so a source checkout
that is not installed still has them) and every plugin of the ``hybridrl`` entry-point group, and the registry
their hooks fill. Hook implementations are validated: a misspelt hook name is an error, not silence."""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from functools import lru_cache

import pluggy

from hybridrl.plugins import hookspecs
from hybridrl.plugins.registry import Registry, RegistryError

HOOKS = (
    "hybridrl_register_backends",
    "hybridrl_register_algorithms",
    "hybridrl_register_rewards",
    "hybridrl_register_trackers",
    "hybridrl_register_datasets",
    "hybridrl_register_environments",
)
#: the core's default plugins: they register through the same hooks as any third-party plugin.
CORE_PLUGINS = (
    "hybridrl.algorithms.plugin",
    "hybridrl.rollout.plugin",
    "hybridrl.tasks.plugin",
    "hybridrl.rewards.plugin",
    "hybridrl.observe.tracking",
    "hybridrl.weights.bridges",
    "hybridrl.environments.plugin",
)
# Extra plugin modules, comma separated, for code that is importable but not pip-installed.
EXTRA_PLUGINS_ENV = "HYBRIDRL_PLUGINS"


def plugin_manager(extra_modules: tuple[str, ...] = ()) -> pluggy.PluginManager:
    """The core's defaults, the installed plugins, then ``HYBRIDRL_PLUGINS`` and ``extra_modules``; raises
    ``RegistryError`` for a hook implementation that matches no hook (a misspelt name)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in CORE_PLUGINS:
        pm.register(importlib.import_module(name), name=name)
    pm.load_setuptools_entrypoints(hookspecs.PROJECT)
    env_modules = tuple(m for m in os.environ.get(EXTRA_PLUGINS_ENV, "").split(",") if m.strip())
    for name in (*env_modules, *extra_modules):
        name = name.strip()
        if pm.get_plugin(name) is None:
            pm.register(importlib.import_module(name), name=name)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:  # a misspelt hook: name it and the hooks there are
        raise RegistryError(f"{exc} (the hybridrl hooks: {', '.join(HOOKS)})") from exc
    return pm


def build_registry(pm: pluggy.PluginManager) -> Registry:
    """Call every hook of every plugin, recording which plugin added what."""
    registry = Registry()
    for hook_name in HOOKS:
        hook = getattr(pm.hook, hook_name)
        for impl in hook.get_hookimpls():
            registry.current_plugin = impl.plugin_name
            impl.function(registry=registry)
    registry.current_plugin = "<direct>"
    return registry


@lru_cache(maxsize=None)
def get_registry(extra_modules: tuple[str, ...] = ()) -> Registry:
    """The process-wide registry (cached: entry points are read once per process)."""
    return build_registry(plugin_manager(extra_modules))


@dataclass(frozen=True)
class PluginInfo:
    name: str
    distribution: str
    version: str
    registers: list[str]


def describe_plugins(extra_modules: tuple[str, ...] = ()) -> list[PluginInfo]:
    """One row per plugin for ``hybridrl plugins``."""
    pm = plugin_manager(extra_modules)
    registry = build_registry(pm)
    dists = {pm.get_name(plugin): dist for plugin, dist in pm.list_plugin_distinfo()}
    rows = []
    for plugin in pm.get_plugins():
        name = pm.get_name(plugin)
        if name is None or name == hookspecs.__name__:
            continue
        dist = dists.get(name)
        if name in CORE_PLUGINS:  # registered directly, part of the core distribution
            from hybridrl import __version__

            dist_name, version = "hybridrl", __version__
        else:
            dist_name = dist.metadata["Name"] if dist else "(not installed)"
            version = dist.version if dist else "-"
        rows.append(PluginInfo(name, dist_name, version, registry.by_plugin(name)))
    return sorted(rows, key=lambda r: (r.distribution, r.name))
