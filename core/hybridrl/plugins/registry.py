"""The registry object handed to every hook: plugins add backends, algorithms, rewards, trackers, datasets,
environments, tools and tool-call parsers.

Backends are registered by *import path* (``"hybridrl_vllm.engine:VLLMRollout"``) together with the engine
packages they need, so that listing plugins or validating a config never imports a heavy engine, and a
backend whose engine is missing is reported with an install hint instead of crashing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hybridrl.engines.capabilities import CapabilityError, check_declared
from hybridrl.engines.spec import (  # noqa: F401  (their home before the plugin surface moved)
    BackendKind,
    BackendSpec,
    RegistryError,
    check_requirement,
    load_object,
)

ANY = "*"


@dataclass(frozen=True)
class FailedPlugin:
    """An installed plugin whose entry point raised when imported: skipped, and named where it matters."""

    entry_point: str
    distribution: str
    version: str
    error: str  # 'ImportError: ...', one line

    def warning(self) -> str:
        return (f"plugin '{self.entry_point}' of distribution '{self.distribution}' {self.version} failed "
                f"to import and is skipped ({self.error})")

    def describe(self) -> str:
        return f"plugin '{self.entry_point}' of distribution '{self.distribution}' failed to import ({self.error})"


#: the name plugins and older code use for a backend's record.
BackendEntry = BackendSpec


@dataclass(frozen=True)
class BridgeEntry:
    """A reshard bridge for a (trainer, rollout) backend pair over a transport; ``*`` matches any backend."""

    trainer: str
    rollout: str
    transport: str
    target: Any
    plugin: str
    #: how far apart the two sides may run: "process" (one process), "device" (separate processes on the same
    #: devices: CUDA IPC), "node" (one machine: shared memory) or "cluster" (anywhere); the pre-flight refuses a
    #: placement the bridge cannot span.
    scope: str = "cluster"


#: the scopes a bridge may declare, narrowest first.
BRIDGE_SCOPES = ("process", "device", "node", "cluster")


@dataclass(frozen=True)
class NamedEntry:
    """An algorithm component, reward, tracker or dataset: a name and a callable."""

    category: str
    name: str
    target: Any
    plugin: str

    def load(self) -> Any:
        return load_object(self.target)


@dataclass
class Registry:
    """Everything the plugins registered. Handed to each ``hybridrl_register_*`` hook."""

    backends: dict[tuple[str, str], BackendEntry] = field(default_factory=dict)
    bridges: list[BridgeEntry] = field(default_factory=list)
    named: dict[tuple[str, str], NamedEntry] = field(default_factory=dict)
    current_plugin: str = "<direct>"
    failed_plugins: list[FailedPlugin] = field(default_factory=list)  # installed but failed to import

    # --- backends -------------------------------------------------------------------------------
    def _add_backend(self, kind: BackendKind, name: str, target: Any, requires: str | list[str] | tuple[str, ...],
                     install_hint: str, process_family: str, devices: tuple[str, ...], supports: Iterable[str],
                     max_ranks: int | None, check_options: Any, resolve_options: Any = None,
                     options: Any = None, **hooks: Any) -> None:
        key = (kind, name)
        if key in self.backends:
            raise RegistryError(
                f"{kind} backend '{name}' registered twice: by {self.backends[key].plugin} and {self.current_plugin}")
        try:
            declared = check_declared(kind, name, supports)
        except CapabilityError as exc:
            raise RegistryError(f"{exc} (plugin {self.current_plugin})") from None
        if max_ranks is not None and max_ranks < 1:
            raise RegistryError(f"{kind} backend '{name}': max_ranks must be at least 1, got {max_ranks}")
        reqs = (requires,) if isinstance(requires, str) else tuple(requires)
        self.backends[key] = BackendSpec(kind, name, target, self.current_plugin, reqs, install_hint,
                                         process_family, tuple(devices), declared, max_ranks, check_options,
                                         options, resolve_options, **hooks)

    def add_train_engine(self, name: str, target: Any, *, requires: str | list[str] = (), install_hint: str = "",
                         process_family: str = "torch-dist", devices: tuple[str, ...] = ("cpu", "cuda"),
                         supports: Iterable[str] = (), max_ranks: int | None = None, check_options: Any = None,
                         resolve_options: Any = None, memory_model: Any = None, oom_fixes: Any = None,
                         shares_prompts: Any = None, options: Any = None) -> None:
        """Register a ``TrainEngine`` class (or ``"module:Class"``) under ``name``; ``supports`` names its
        optional capabilities (``capabilities.TRAIN_CAPABILITIES``), ``max_ranks`` the most ranks it spans,
        ``check_options`` its pre-flight check of its own settings (see ``BackendSpec.check_options``),
        ``resolve_options`` its own ``auto`` settings (``BackendSpec.resolve_options``), ``memory_model``,
        ``oom_fixes`` and ``shares_prompts`` what the planner, the out-of-memory answer and the FLOP count ask
        of it, ``options`` its option keys for people (see ``BackendSpec``)."""
        self._add_backend("train", name, target, requires, install_hint, process_family, devices, supports, max_ranks,
                          check_options, resolve_options, options, memory_model=memory_model, oom_fixes=oom_fixes,
                          shares_prompts=shares_prompts)

    def add_rollout(self, name: str, target: Any, *, requires: str | list[str] = (), install_hint: str = "",
                    process_family: str = "any", devices: tuple[str, ...] = ("cpu", "cuda"),
                    supports: Iterable[str] = (), max_ranks: int | None = None, check_options: Any = None,
                    resolve_options: Any = None, memory_model: Any = None, oom_fixes: Any = None,
                    options: Any = None, log_prob_cost: float | None = None) -> None:
        """Register a ``RolloutEngine`` class (or ``"module:Class"``) under ``name``; ``supports`` names its
        optional capabilities (``capabilities.ROLLOUT_CAPABILITIES``), ``max_ranks`` the most ranks it spans,
        ``check_options`` its pre-flight check of its own settings (see ``BackendSpec.check_options``),
        ``resolve_options`` its own ``auto`` settings (``BackendSpec.resolve_options``), ``memory_model`` and
        ``oom_fixes`` what the planner and the out-of-memory answer ask of it, ``options`` its option keys for
        people, ``log_prob_cost`` what returning the sampled tokens' log-probs costs its generation, as a factor
        (see ``BackendSpec``)."""
        if log_prob_cost is not None and not (isinstance(log_prob_cost, (int, float)) and log_prob_cost >= 1):
            raise RegistryError(f"rollout backend '{name}': log_prob_cost must be a number >= 1 (generation seconds "
                                f"with log-probs over those without), got {log_prob_cost!r} (plugin "
                                f"{self.current_plugin})")
        self._add_backend("rollout", name, target, requires, install_hint, process_family, devices, supports,
                          max_ranks, check_options, resolve_options, options, memory_model=memory_model,
                          oom_fixes=oom_fixes, log_prob_cost=log_prob_cost)

    def add_bridge(self, trainer: str, rollout: str, transport: str, target: Any, *, scope: str = "cluster") -> None:
        """Register a reshard bridge for a backend pair; later registrations of the same key win. ``scope``
        says where its two sides may run (``BRIDGE_SCOPES``: one process, one machine, anywhere)."""
        if scope not in BRIDGE_SCOPES:
            raise RegistryError(f"bridge {trainer} -> {rollout} over '{transport}': scope '{scope}' is none of "
                                f"{', '.join(BRIDGE_SCOPES)} (plugin {self.current_plugin})")
        self.bridges.append(BridgeEntry(trainer, rollout, transport, target, self.current_plugin, scope))

    def backend(self, kind: BackendKind, name: str) -> BackendEntry:
        try:
            return self.backends[(kind, name)]
        except KeyError:
            known = sorted(n for k, n in self.backends if k == kind)
            raise RegistryError(f"unknown {kind} backend '{name}' (known: {', '.join(known) or 'none'})"
                                f"{self.failed_note()}") from None

    def bridge(self, trainer: str, rollout: str, transport: str) -> BridgeEntry:
        """Most specific bridge for the pair: exact, then one side wildcarded, then the general one."""
        for t, r in ((trainer, rollout), (trainer, ANY), (ANY, rollout), (ANY, ANY)):
            for entry in reversed(self.bridges):
                if entry.trainer == t and entry.rollout == r and entry.transport == transport:
                    return entry
        raise RegistryError(f"no reshard bridge for {trainer} -> {rollout} over transport '{transport}'")

    # --- named components -------------------------------------------------------------------------
    def _add_named(self, category: str, name: str, target: Any) -> None:
        key = (category, name)
        if key in self.named:
            raise RegistryError(
                f"{category} '{name}' registered twice: by {self.named[key].plugin} and {self.current_plugin}")
        self.named[key] = NamedEntry(category, name, target, self.current_plugin)

    def add_advantage(self, name: str, fn: Callable | str) -> None:
        self._add_named("advantage", name, fn)

    def add_policy_loss(self, name: str, fn: Callable | str) -> None:
        self._add_named("policy_loss", name, fn)

    def add_loss_aggregation(self, name: str, fn: Callable | str) -> None:
        self._add_named("loss_aggregation", name, fn)

    def add_kl_estimator(self, name: str, fn: Callable | str) -> None:
        self._add_named("kl_estimator", name, fn)

    def add_algorithm(self, name: str, defaults: dict[str, Any]) -> None:
        """A named preset of algorithm settings (``grpo`` = group advantages + ppo clip + ...)."""
        self._add_named("algorithm", name, dict(defaults))

    def add_reward(self, name: str, fn: Callable | str) -> None:
        self._add_named("reward", name, fn)

    def add_tracker(self, name: str, cls: type | str) -> None:
        self._add_named("tracker", name, cls)

    def add_dataset(self, name: str, fn: Callable | str) -> None:
        self._add_named("dataset", name, fn)

    def add_environment(self, name: str, cls: type | str) -> None:
        """An episode environment (``hybridrl.environments.base.Environment`` subclass, or a factory called
        as ``cls(context, **environment.options)``), chosen by ``environment.name``."""
        self._add_named("environment", name, cls)

    def add_tool(self, name: str, cls: type | str) -> None:
        """A tool (``hybridrl.tools.base.Tool`` subclass, built as ``cls(**environment.tool_options[name])``)."""
        self._add_named("tool", name, cls)

    def add_tool_parser(self, name: str, fn: Callable | str) -> None:
        """A tool-call parser: ``fn(turn_text) -> hybridrl.tools.parsers.ParsedTurn``."""
        self._add_named("tool_parser", name, fn)

    def get(self, category: str, name: str) -> Any:
        """Load a named component, with an error listing the known names."""
        try:
            return self.named[(category, name)].load()
        except KeyError:
            raise RegistryError(
                f"unknown {category.replace('_', ' ')} '{name}' (known: {', '.join(self.names(category)) or 'none'})"
                f"{self.failed_note()}") from None

    def failed_note(self) -> str:
        """What an unknown name's error adds when installed plugins failed to import: one may provide it."""
        if not self.failed_plugins:
            return ""
        return "; it may come from a plugin that failed to import: " + "; ".join(
            f.describe() for f in self.failed_plugins)

    def names(self, category: str) -> list[str]:
        return sorted(n for c, n in self.named if c == category)

    def by_plugin(self, plugin: str) -> list[str]:
        """Human-readable list of what ``plugin`` registered (for ``hybridrl plugins``)."""
        items = [f"{e.kind}:{e.name}" for e in self.backends.values() if e.plugin == plugin]
        items += [f"bridge:{b.trainer}->{b.rollout}/{b.transport}" for b in self.bridges if b.plugin == plugin]
        items += [f"{e.category}:{e.name}" for e in self.named.values() if e.plugin == plugin]
        return items
