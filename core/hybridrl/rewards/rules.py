"""Rule rewards as configured: weighted sums of reward functions, dispatched by each row's ``data_source``.

``RuleSpec`` is what ``roles.reward.fn`` / ``roles.reward.by_source`` ask for with every name resolved to an
import path (or a picklable function), so that a pool process can rebuild it without the plugin registry.
``Rules`` is a spec made callable: ``score(prompt, response, fields)`` -> float, or ``RewardFailure`` naming the
config key and the function that failed.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridrl.rewards.calling import RewardCall, RewardFailure, checked_score, describe_exception


@dataclass(frozen=True)
class Term:
    """One weighted reward function. ``name``: as configured; ``target``: ``module:function`` or the function."""

    name: str
    target: Any
    weight: float = 1.0
    args: dict[str, Any] = field(default_factory=dict)
    key: str = "roles.reward.fn"  # where the config sets it, for messages


@dataclass(frozen=True)
class RuleSpec:
    """The rule rewards of a run: ``default`` for rows whose source is not in ``by_source`` (None: no rule
    reward for them)."""

    default: tuple[Term, ...] | None
    by_source: dict[str, tuple[Term, ...]] = field(default_factory=dict)

    def terms_for(self, source: Any) -> tuple[Term, ...] | None:
        if source is not None and source in self.by_source:
            return self.by_source[source]
        return self.default

    def key_for(self, source: Any) -> str:
        if source is not None and source in self.by_source:
            return f"roles.reward.by_source.{source}"
        return "roles.reward.fn"

    def all_terms(self) -> list[Term]:
        return [*(self.default or ()), *(t for terms in self.by_source.values() for t in terms)]

    def describe(self, source: Any = None) -> str:
        terms = self.terms_for(source) or ()
        return " + ".join(t.name if t.weight == 1 else f"{t.weight:g}*{t.name}" for t in terms) or "none"

    def bundled(self) -> bool:
        """Whether every function is one of hybridrl's own (trusted: probed in the driver, run inline without a
        deadline thread)."""
        return all(isinstance(t.target, str) and t.target.startswith("hybridrl.") for t in self.all_terms())

    def picklable(self) -> bool:
        """Whether pool processes can receive it (functions registered as objects must pickle by reference)."""
        try:
            pickle.dumps(self)
            return True
        except Exception:  # noqa: BLE001 - lambdas, closures, local classes ...
            return False


def resolve_target(name: str, registry: Any) -> Any:
    """A registered reward's import path (or object), or ``module:function`` as given; ``RegistryError`` when
    unknown or not importable."""
    from hybridrl.plugins.registry import RegistryError, load_object

    if ":" in name:
        try:
            fn = load_object(name)
        except (ImportError, AttributeError, RegistryError) as exc:
            raise RegistryError(f"cannot import reward function '{name}': {exc}") from None
        target = name
    else:
        entry = registry.named.get(("reward", name))
        if entry is None:
            registry.get("reward", name)  # raises with the known names
        target = entry.target
        try:
            fn = entry.load()
        except (ImportError, AttributeError) as exc:
            raise RegistryError(f"reward '{name}' (plugin {entry.plugin}) cannot be imported: {exc}") from None
    if not callable(fn):
        raise RegistryError(f"reward '{name}' is not callable")
    return target


def _terms(spec: Any, key: str, registry: Any, problems: list[tuple[str, str]]) -> tuple[Term, ...]:
    from hybridrl.config.schema import RewardTerm
    from hybridrl.plugins.registry import RegistryError

    items = [spec] if isinstance(spec, str) else list(spec)
    if not items:
        problems.append((key, "an empty list of rewards"))
    terms = []
    for i, item in enumerate(items):
        term = RewardTerm(fn=item) if isinstance(item, str) else item
        item_key = key if isinstance(spec, str) else f"{key}[{i}]"
        try:
            target = resolve_target(term.fn, registry)
        except RegistryError as exc:
            problems.append((item_key, str(exc)))
            continue
        terms.append(Term(term.fn, target, float(term.weight), dict(term.args), item_key))
    return tuple(terms)


def build_spec(reward_cfg: Any, registry: Any) -> tuple[RuleSpec | None, list[tuple[str, str]]]:
    """The ``RuleSpec`` of ``roles.reward`` (None without rule rewards) and the problems found resolving it."""
    problems: list[tuple[str, str]] = []
    default = _terms(reward_cfg.fn, "roles.reward.fn", registry, problems) if reward_cfg.fn is not None else None
    by_source = {source: _terms(spec, f"roles.reward.by_source.{source}", registry, problems)
                 for source, spec in reward_cfg.by_source.items()}
    if default is None and not by_source:
        return None, problems
    return RuleSpec(default, by_source), problems


class Rules:
    """A ``RuleSpec`` with its functions loaded, ready to score."""

    def __init__(self, spec: RuleSpec) -> None:
        from hybridrl.plugins.registry import load_object

        self.spec = spec
        self._calls: dict[int, RewardCall] = {}
        self._loaded: dict[Any, RewardCall] = {}
        for term in spec.all_terms():
            key = term.target if isinstance(term.target, str) else id(term.target)
            if key not in self._loaded:
                self._loaded[key] = RewardCall(load_object(term.target))
            self._calls[id(term)] = self._loaded[key]

    def score(self, prompt: str, response: str, fields: dict[str, Any]) -> float:
        """The weighted sum of the row's source's terms; ``RewardFailure`` names the key and function that
        failed and how."""
        source = fields.get("data_source")
        terms = self.spec.terms_for(source)
        if terms is None:
            raise RewardFailure(f"no rule reward for data_source {source!r} (roles.reward.by_source has "
                                f"{sorted(self.spec.by_source)}, roles.reward.fn is unset)")
        total = 0.0
        for term in terms:
            try:
                value = self._calls[id(term)](prompt, response, fields, **term.args)
            except Exception as exc:  # noqa: BLE001 - any exception of user code is a failed reward
                raise RewardFailure(f"{term.key} '{term.name}' {describe_exception(exc)}") from None
            try:
                total += term.weight * checked_score(value)
            except RewardFailure as exc:
                raise RewardFailure(f"{term.key} '{term.name}' {exc}") from None
        return total


def needs_ground_truth(fn: Callable[..., Any]) -> bool:
    """Whether a reward declares it needs each row's reference answer (``fn.needs_ground_truth = True``)."""
    return bool(getattr(fn, "needs_ground_truth", False))
