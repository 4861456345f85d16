"""Reward functions and a plugin with a checkpoint-less train backend, for the pre-flight tests (imported by
name from configs: ``roles.reward.fn=_preflight_helpers:text_reward``, ``plugins=[_preflight_helpers]``)."""

from __future__ import annotations

from typing import Any

from hybridrl import hookimpl
from hybridrl.engines import TrainEngine


def text_reward(prompt: str, response: str, **meta: Any) -> str:
    return "1.0"  # a string, not a number


def raising_reward(prompt: str, response: str, **meta: Any) -> float:
    return float(meta["score"])  # the data has no 'score' field: KeyError


class NoCheckpointEngine(TrainEngine):
    """A train backend that never implemented save_checkpoint/load_checkpoint (never built in these tests)."""

    def compute_log_probs(self, batch, with_entropy=False):  # pragma: no cover
        raise NotImplementedError

    def update(self, batch, objective):  # pragma: no cover
        raise NotImplementedError

    def export_weights(self, bucket_bytes):  # pragma: no cover
        raise NotImplementedError


@hookimpl
def hybridrl_register_backends(registry):
    registry.add_train_engine("nockpt", NoCheckpointEngine)
    # Declared by a module that does not exist: pre-flight must answer from the declarations alone.
    registry.add_train_engine("ghost_one_rank", "nowhere_at_all.engine:Engine", max_ranks=1,
                              supports={"checkpoint"})
    # A rollout that returns no MoE routing (never built either).
    registry.add_rollout("noroute", "nowhere_at_all.engine:Rollout", process_family="any",
                         supports={"sleep", "named_weights"})
