"""``RunPlan``: the user's config as given, and every decision pre-flight took about it, resolved once.

Pre-flight fills the algorithm's preset, adds or drops the critic and the reference, turns on what a mode
needs (``tis_cap`` for a pipelined run), resolves every ``auto`` against the memory plan, and sets LoRA's sync.
It records each as a note or an ``AutoChoice`` with its reason. The trainer and the workers read the plan's
``config`` and ``algorithm`` and never resolve them again; ``run_plan.json`` in the run folder keeps the whole
record, so "why did my run use 24576 tokens?" has an answer on disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridrl.config import RunConfig
from hybridrl.engines.memory_model import AutoChoice

if TYPE_CHECKING:
    from hybridrl.algorithms.objective import ResolvedAlgorithm


@dataclass(frozen=True)
class RunPlan:
    """The config as the user gave it (``given``), the one the run uses (``config``), the algorithm resolved
    from it, what pre-flight changed (``notes``) and the ``auto`` choices with their reasons."""

    given: RunConfig
    config: RunConfig
    algorithm: ResolvedAlgorithm
    notes: tuple[str, ...] = ()
    auto: tuple[AutoChoice, ...] = ()

    def record(self) -> dict[str, Any]:
        """The plan as JSON (secrets redacted, as in ``config.json``)."""
        algo = self.algorithm
        return {
            "given": self.given.model_dump(mode="json", by_alias=True, exclude_unset=True),
            "resolved": self.config.model_dump(mode="json", by_alias=True),
            "algorithm": {"advantage": algo.advantage, "policy_loss": algo.policy_loss, "loss_agg": algo.loss_agg,
                          "uses_ref": algo.uses_ref, "uses_critic": algo.uses_critic,
                          "greedy_baseline": algo.greedy_baseline},
            "notes": list(self.notes),
            "auto": [{"key": c.key, "value": c.value, "reason": c.reason} for c in self.auto],
        }
