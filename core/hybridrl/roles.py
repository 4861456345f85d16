"""The one table of role facts: what each role of the RL dataflow is, where it goes by default, what it
inherits from the actor, in which phases of a step it works, and which model head it carries.

Roles are an open set of strings: a plugin may add one, and ``role_spec`` answers for it with a frozen
train role on the default pool. Everything else in the core (placement, the memory plan, launching engines,
checkpoints, the train backends' heads) reads these facts here instead of keeping its own copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

BackendKind = Literal["train", "rollout"]
#: how a role works in a phase: sampling tokens, a forward pass only, a forward and backward pass.
PhaseMode = Literal["generate", "forward", "train"]


@dataclass(frozen=True)
class Phase:
    """One phase of a step in which a role works (``timing/<name>``)."""

    name: str
    mode: PhaseMode


@dataclass(frozen=True)
class RoleSpec:
    name: str
    #: the registry family its backend comes from (``registry.backend(kind, name)``).
    kind: BackendKind
    #: an optimiser trains it: its state is checkpointed and it holds gradients and optimiser state.
    trainable: bool
    #: where it goes without ``roles.<role>.pool``: the config's first pool, or the actor's pool.
    default_pool: Literal["first", "actor"]
    #: settings taken from ``roles.actor`` when the role leaves them unset.
    inherits: tuple[str, ...] = ()
    #: the compute phases it works in, in step order.
    phases: tuple[Phase, ...] = ()
    #: the model head a train backend builds for it: ``lm`` (log-probs), ``value`` (per-token values),
    #: ``reward`` (one score per sequence); ``None`` for the rollout.
    head: str | None = "lm"
    #: what it does around the weight sync, for the plan's per-device view.
    reshard: str | None = None

    @property
    def vocab_head(self) -> bool:
        """Whether its forward ends in the LM head over the vocabulary (the memory plan's logits)."""
        return self.head == "lm"


_TOKEN_BUDGET = ("micro_batch", "max_tokens_per_micro_batch")

ROLES: dict[str, RoleSpec] = {
    "actor": RoleSpec("actor", "train", trainable=True, default_pool="first",
                      phases=(Phase("old_log_prob", "forward"), Phase("update_actor", "train")), reshard="send"),
    "ref": RoleSpec("ref", "train", trainable=False, default_pool="first", inherits=_TOKEN_BUDGET,
                    phases=(Phase("ref", "forward"),)),
    "critic": RoleSpec("critic", "train", trainable=True, default_pool="actor",
                       inherits=(*_TOKEN_BUDGET, "mini_batch", "lr"),
                       phases=(Phase("values", "forward"), Phase("update_critic", "train")), head="value"),
    "rollout": RoleSpec("rollout", "rollout", trainable=False, default_pool="first",
                        phases=(Phase("gen", "generate"),), head=None, reshard="recv"),
    "reward": RoleSpec("reward", "train", trainable=False, default_pool="actor", inherits=_TOKEN_BUDGET,
                       phases=(Phase("reward", "forward"),), head="reward"),
}

#: the compute phases of one step in the order ``Trainer.train_step`` runs them.
STEP_PHASES = ("gen", "reward", "ref", "values", "old_log_prob", "update_critic", "update_actor")


def role_spec(role: str) -> RoleSpec:
    """The facts of ``role``; a role a plugin added is a frozen train role on the first pool."""
    return ROLES.get(role) or RoleSpec(role, "train", trainable=False, default_pool="first")


def trainable_roles() -> tuple[str, ...]:
    return tuple(name for name, spec in ROLES.items() if spec.trainable)


def phase_owner(phase: str) -> tuple[str, Phase] | None:
    """The role working in ``phase`` and how, or None for a phase no role of the table runs."""
    for spec in ROLES.values():
        for p in spec.phases:
            if p.name == phase:
                return spec.name, p
    return None
