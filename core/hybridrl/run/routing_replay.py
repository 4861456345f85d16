"""MoE routing replay (``algorithm.routing_replay``): what a run needs for it, checked before start.

The rollout engine returns the experts it routed each response token to (``routed_experts``, rollout capability
``return_routing``) and the actor's forward routes those tokens to the same experts (train capability
``routing_replay``), so the actor's log-probs are those of the routing that sampled the tokens. Without it the
trainer's top-k can differ from the engine's (other kernels, other batch shapes, a near tie) and the importance
ratios drift. ``roles.rollout.return_routing: true`` without replay only measures it (``moe/routing_mismatch``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridrl.config import RunConfig
from hybridrl.weights.experts import expert_count

Problems = list[tuple[str, str]]


def returns_routing(cfg: RunConfig) -> bool:
    """Whether the rollout is asked for ``routed_experts`` (``roles.rollout.return_routing``; auto: with replay)."""
    return cfg.rollout_returns_routing()


def model_experts(cfg: RunConfig) -> int | None:
    """The policy's routed experts per layer (0: dense; None: its config cannot be read here)."""
    if cfg.model.tiny is not None:
        return int(cfg.model.tiny.num_experts or 0)
    try:
        return expert_count(json.loads((Path(cfg.model.path or "") / "config.json").read_text()))
    except (OSError, ValueError, AttributeError):
        return None  # a missing or unreadable config is reported under model.path elsewhere


def routing_problems(cfg: RunConfig, backends: dict[str, Any], multi_turn: bool = False) -> Problems:
    """Routing asked of a run that cannot honour it: a dense model, a backend without the capability, or groups
    in flight (their partial samples do not carry ``routed_experts`` from round to round yet)."""
    replay, wanted = cfg.algorithm.routing_replay, returns_routing(cfg)
    if not wanted and not replay:
        return []
    problems: Problems = []
    if replay and cfg.roles.rollout.return_routing is False:
        problems.append(("roles.rollout.return_routing", "algorithm.routing_replay needs the rollout's routing: set "
                                                         "return_routing to true or auto"))
    key = "algorithm.routing_replay" if replay else "roles.rollout.return_routing"
    if model_experts(cfg) == 0:
        problems.append((key, "the model is dense (no routed experts): there is no routing to return or replay"))
    rollout = backends.get("rollout")
    if rollout is not None and not rollout.can("return_routing"):
        problems.append(("roles.rollout.backend", f"{key} needs the experts the rollout routed each token to; backend "
                                                  f"'{rollout.name}' does not declare 'return_routing'"))
    actor = backends.get("actor")
    if actor is not None and not actor.can("routing_replay"):  # it also measures the mismatch
        problems.append(("roles.actor.backend", f"{key}: backend '{actor.name}' does not declare 'routing_replay' "
                                                "(routing its forward by given experts, measuring the mismatch)"))
    if cfg.roles.rollout.oversample > 1:
        problems.append(("roles.rollout.oversample", f"{key} with groups in flight (oversample > 1) is not supported "
                                                     "yet: partial samples would lose their routing between rounds"))
    if multi_turn:
        problems.append(("environment", f"{key} is single-turn only (a multi-turn episode's tokens are generated "
                                        "request by request, without routing)"))
    return problems
