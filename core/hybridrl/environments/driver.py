"""The trainer's side of multi-turn episodes: ``Episodes.for_run`` is None for the single-turn default (the
trainer then calls ``generate`` exactly as before), else it sends the rollout's ``generate_episodes`` the
prompt rows and the spec, and says what to log of the rows that come back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridrl.engines import SamplingParams
from hybridrl.engines.batch import MESSAGES, META, PROMPT_IDS, PROMPT_MASK, PROMPT_TEXT, Batch
from hybridrl.environments.checks import multi_turn
from hybridrl.environments.metrics import episode_metrics
from hybridrl.environments.spec import EnvironmentSpec
from hybridrl.environments.trajectory import ENV_REWARD

#: the prompt rows' fields an environment may read (``EpisodeRow``).
ROW_FIELDS = (PROMPT_TEXT, META, MESSAGES)


@dataclass(frozen=True)
class Episodes:
    spec: EnvironmentSpec

    @classmethod
    def for_run(cls, cfg: Any, registry: Any) -> Episodes | None:
        """None for single-turn runs; else the spec with its mode decided for the rollout backend."""
        if not multi_turn(cfg, registry):
            return None
        rollout = registry.backend("rollout", cfg.roles.rollout.backend)
        return cls(EnvironmentSpec.from_config(cfg).resolved(rollout.can("requests")))

    def submit(self, rollout: Any, batch: Batch, params: SamplingParams) -> Any:
        """Dispatch one episode per row to the rollout workers (``WorkerGroup.submit``)."""
        fields = [key for key in ROW_FIELDS if key in batch]
        return rollout.submit("rollout", "generate_episodes", batch.select(PROMPT_IDS, PROMPT_MASK, *fields), params,
                              self.spec)

    @staticmethod
    def reward(batch: Batch) -> Any:
        """The episodes' own rewards (B,), added to the score (0 for rows that did not come from episodes)."""
        return batch[ENV_REWARD] if ENV_REWARD in batch else 0.0

    @staticmethod
    def metrics(batch: Batch, rollout_ranks: int) -> dict[str, float]:
        return episode_metrics(batch, rollout_ranks)
