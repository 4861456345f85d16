"""Which batteries ``--hybridrl-backend NAME ...`` asks for: each name's kinds come from the registry, and
every selected trainer is paired with every selected rollout for the bridge battery (a name of one kind
alone is paired with the built-in counterpart, ``fsdp`` or ``hf``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import product

from hybridrl.errors import HybridRLError

#: the counterpart a lone trainer or rollout is bridged with.
DEFAULT_TRAINER = "fsdp"
DEFAULT_ROLLOUT = "hf"


class SelectionError(HybridRLError, ValueError):
    """A name that no plugin registers."""


@dataclass(frozen=True)
class Selection:
    train: list[str] = field(default_factory=list)
    rollout: list[str] = field(default_factory=list)
    bridges: list[tuple[str, str]] = field(default_factory=list)


def select(names: list[str], registered: set[tuple[str, str]]) -> Selection:
    """``registered``: the registry's ``(kind, name)`` keys."""
    names = list(dict.fromkeys(n.strip() for n in names if n.strip()))
    train = [n for n in names if ("train", n) in registered]
    rollout = [n for n in names if ("rollout", n) in registered]
    unknown = [n for n in names if n not in train and n not in rollout]
    if unknown:
        known = {kind: sorted(n for k, n in registered if k == kind) for kind in ("train", "rollout")}
        raise SelectionError(f"--hybridrl-backend: no plugin registers {', '.join(repr(n) for n in unknown)} "
                             f"(train: {', '.join(known['train']) or 'none'}; "
                             f"rollout: {', '.join(known['rollout']) or 'none'})")
    trainers = train or ([DEFAULT_TRAINER] if ("train", DEFAULT_TRAINER) in registered else [])
    rollouts = rollout or ([DEFAULT_ROLLOUT] if ("rollout", DEFAULT_ROLLOUT) in registered else [])
    return Selection(train, rollout, list(product(trainers, rollouts)))
