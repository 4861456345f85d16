"""``hybridrl plugins NAME``: one backend as its plugin registered it, for a person choosing or configuring it
(kind, distribution, capabilities with their promises, rank limit, option keys)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridrl.engines.capabilities import KNOWN
from hybridrl.engines.options import is_options_model
from hybridrl.errors import HybridRLError
from hybridrl.plugins.registry import BackendSpec, Registry


class UnknownBackend(HybridRLError, ValueError):
    """No plugin registers a backend of that name."""

    exit_status = 2  # refused before any work


def find_backends(registry: Registry, name: str) -> list[BackendSpec]:
    """Every backend registered as ``name`` (a train and a rollout backend may share one); an unknown name is an
    error listing the known ones."""
    found = [spec for (kind, n), spec in sorted(registry.backends.items()) if n == name]
    if not found:
        known = sorted({n for _, n in registry.backends})
        raise UnknownBackend(f"no plugin registers a backend named '{name}' (known: {', '.join(known) or 'none'})")
    return found


def describe_backend(spec: BackendSpec, distribution: str, version: str) -> list[str]:
    """The lines ``hybridrl plugins NAME`` prints for one backend."""
    problem = spec.engine_problem()
    lines = [f"{spec.name}: {spec.kind} backend",
             f"  plugin:        {spec.plugin} (distribution {distribution} {version})",
             f"  engine:        {spec.target if isinstance(spec.target, str) else _qualname(spec.target)} "
             f"({'available' if problem is None else problem})",
             f"  devices:       {', '.join(spec.devices)}",
             f"  max ranks:     {spec.max_ranks if spec.max_ranks is not None else 'any'}",
             "  capabilities:" + ("" if spec.supports else " none declared")]
    promises = KNOWN[spec.kind]
    lines += [f"    {cap:<20} {promises[cap]}" for cap in sorted(spec.supports)]
    lines += _option_lines(spec)
    return lines


def _option_lines(spec: BackendSpec) -> list[str]:
    checker = spec.check_options if isinstance(spec.check_options, str) or spec.check_options is None else \
        _qualname(spec.check_options)
    checked = f" (checked by {checker})" if checker else ""
    if spec.options is None:
        return [f"  options:       not declared{checked}"]
    declared: Sequence[Any] = spec.hook("options")
    if is_options_model(declared):
        checked = f" (validated by {_qualname(declared)}" + (f", checked by {checker})" if checker else ")")
        declared = declared.docs()  # type: ignore[attr-defined]
    lines = [f"  options:{checked}"]
    width = max((len(o.key) for o in declared), default=0)
    for option in declared:
        default = "unset" if option.default is None else repr(option.default)
        lines.append(f"    {option.key:<{width}}  {option.type} = {default}: {option.description}")
    return lines


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"

