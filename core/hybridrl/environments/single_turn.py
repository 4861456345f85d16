"""``single_turn``: the default environment, exactly today's path: the row's prompt tokens, one generation,
done, no reward of its own (the trainer's reward function and reward model score the response)."""

from __future__ import annotations

from hybridrl.environments.base import Context, Environment, EpisodeRow, ModelTurn, StepResult


class SingleTurnEnvironment(Environment):
    single_turn = True

    def reset(self, row: EpisodeRow) -> Context:
        return list(row.prompt_ids)

    def step(self, turn: ModelTurn) -> StepResult:
        return StepResult(done=True)
