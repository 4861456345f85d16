"""Plugin discovery: a pluggy manager holding the core's own defaults (registered directly, so a source checkout
that is not installed still has them) and every plugin of the ``hybridrl`` entry-point group, and the registry
their hooks fill. Hook implementations are validated: a misspelt hook name is an error, not silence.

An installed plugin whose entry point fails to import is one broken third-party package: it must not stop
runs that do not use it. It is skipped, with one warning naming its distribution and the error, listed by
``hybridrl plugins``, and named in the error of a config that asks for something unknown (which it may provide)."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import os
from dataclasses import dataclass, field
from functools import cache

import pluggy

from hybridrl.plugins import hookspecs
from hybridrl.plugins.registry import FailedPlugin, Registry, RegistryError

log = logging.getLogger(__name__)

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
    pm.hybridrl_failed = load_entry_points(pm, hookspecs.PROJECT)  # type: ignore[attr-defined]
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


def load_entry_points(pm: pluggy.PluginManager, group: str) -> list[FailedPlugin]:
    """Register every plugin of the entry-point ``group``, each on its own (pluggy's loader, one entry point at
    a time), so that one that fails to import is skipped; returns those, with their distribution and error."""
    failed: list[FailedPlugin] = []
    for dist in md.distributions():
        for ep in dist.entry_points:
            if ep.group != group or pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
                continue
            try:
                pm.load_setuptools_entrypoints(group, name=ep.name)
            except Exception as exc:  # noqa: BLE001 - whatever a plugin's import raises, it is that plugin's fault
                failed.append(FailedPlugin(ep.name, dist.metadata["Name"] or "?", dist.version or "-",
                                           f"{type(exc).__name__}: {exc}".splitlines()[0]))
    return failed


def build_registry(pm: pluggy.PluginManager) -> Registry:
    """Call every hook of every plugin, recording which plugin added what (and the plugins that failed to
    import, for the errors of names they may have provided)."""
    registry = Registry()
    registry.failed_plugins = list(getattr(pm, "hybridrl_failed", []))
    for hook_name in HOOKS:
        hook = getattr(pm.hook, hook_name)
        for impl in hook.get_hookimpls():
            registry.current_plugin = impl.plugin_name
            impl.function(registry=registry)
    registry.current_plugin = "<direct>"
    return registry


@cache
def get_registry(extra_modules: tuple[str, ...] = ()) -> Registry:
    """The process-wide registry (cached: entry points are read once per process); a plugin that failed to
    import is one warning line, here."""
    registry = build_registry(plugin_manager(extra_modules))
    for failed in registry.failed_plugins:
        log.warning("%s", failed.warning())
    return registry


@dataclass(frozen=True)
class PluginInfo:
    name: str
    distribution: str
    version: str
    registers: list[str]
    error: str | None = field(default=None)  # why it failed to import (None: loaded)


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
    rows += [PluginInfo(f.entry_point, f.distribution, f.version, [], f.error) for f in registry.failed_plugins]
    return sorted(rows, key=lambda r: (r.distribution, r.name))
