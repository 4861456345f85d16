"""One episode's tokens as it is played, and the batch of rows the trainer receives from a set of them.

Each trajectory becomes one row (``hybridrl.engines.batch``'s multi-turn layout): ``response_ids`` holds every token
after the prompt, model turns and observations interleaved; ``response_mask`` is 1 exactly on the model's
tokens; ``response_attention_mask`` on all of them; ``rollout_log_probs`` holds the model tokens' log-probs
(0 on observations). Per-row figures of the episode ride along as tensors (``EPISODE_KEYS``) and the reward
parts and summed metrics as per-row dicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hybridrl.engines.batch import (
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_ATTENTION_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    Batch,
    left_pad,
)

#: (B,) float32: the sum of the episode's reward parts (the trainer adds it to the score).
ENV_REWARD = "env_reward"
#: (B,) long: model turns of the episode.
NUM_TURNS = "num_turns"
#: (B,) long: 1 when the episode was cut by a limit (turns or tokens) before the environment said done.
TRUNCATED = "truncated"
#: (B,) float32: seconds the environment spent on this episode (reset and steps, tools included).
ENV_SECONDS = "env_seconds"
#: per-row dicts (non-tensor fields): the reward parts summed over steps, and the environment's metrics.
REWARD_PARTS = "reward_parts"
ENV_METRICS = "env_metrics"
EPISODE_KEYS = (ENV_REWARD, NUM_TURNS, TRUNCATED, ENV_SECONDS)


@dataclass
class Trajectory:
    """The growing token sequence of one episode and what it has earned."""

    prompt_ids: list[int]
    tokens: list[int] = field(default_factory=list)  # everything after the prompt
    trained: list[int] = field(default_factory=list)  # 1: the model's token, 0: an observation's
    log_probs: list[float] = field(default_factory=list)
    turns: int = 0
    done: bool = False
    truncated: bool = False
    reward: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    env_seconds: float = 0.0

    @property
    def length(self) -> int:
        return len(self.tokens)

    def context(self) -> list[int]:
        """What the model conditions on for its next turn."""
        return self.prompt_ids + self.tokens

    def add_model_turn(self, token_ids: Sequence[int], log_probs: Sequence[float] | None) -> None:
        self.tokens.extend(int(t) for t in token_ids)
        self.trained.extend([1] * len(token_ids))
        if log_probs is not None and len(log_probs) != len(token_ids):
            raise ValueError(f"a model turn of {len(token_ids)} tokens came with {len(log_probs)} log-probs")
        self.log_probs.extend([float(v) for v in log_probs] if log_probs is not None else [0.0] * len(token_ids))
        self.turns += 1

    def add_observation(self, token_ids: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in token_ids)
        self.trained.extend([0] * len(token_ids))
        self.log_probs.extend([0.0] * len(token_ids))

    def add_reward(self, parts: dict[str, float]) -> None:
        for name, value in parts.items():
            self.reward[name] = self.reward.get(name, 0.0) + float(value)

    def add_metrics(self, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.metrics[name] = self.metrics.get(name, 0.0) + float(value)

    def model_turns(self) -> list[list[int]]:
        """The model's turns as separate token lists (what the mask marks as trained, split at observations)."""
        turns: list[list[int]] = []
        previous = 0
        for token, mark in zip(self.tokens, self.trained):
            if mark and not previous:
                turns.append([])
            if mark:
                turns[-1].append(token)
            previous = mark
        return turns


def pack_trajectories(trajectories: Sequence[Trajectory], width: int, pad_id: int, with_log_probs: bool = True
                      ) -> Batch:
    """The trainer's rows (see the module docstring): prompts left-padded, responses right-padded to
    ``width`` (the episode limit ``max_total_tokens``). A trajectory longer than ``width`` raises: the runner
    keeps every episode within it."""
    n = len(trajectories)
    for i, t in enumerate(trajectories):
        if t.length > width:
            raise ValueError(f"row {i}: a trajectory of {t.length} response tokens, more than max_total_tokens={width}")
    prompt_ids, prompt_mask = left_pad([t.prompt_ids for t in trajectories], pad_id)
    ids = torch.full((n, width), int(pad_id), dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    trained = torch.zeros((n, width), dtype=torch.long)
    log_probs = torch.zeros((n, width), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        k = t.length
        if k:
            ids[i, :k] = torch.tensor(t.tokens, dtype=torch.long)
            attention[i, :k] = 1
            trained[i, :k] = torch.tensor(t.trained, dtype=torch.long)
            log_probs[i, :k] = torch.tensor(t.log_probs, dtype=torch.float32)
    tensors = {PROMPT_IDS: prompt_ids, PROMPT_MASK: prompt_mask, RESPONSE_IDS: ids, RESPONSE_MASK: trained,
               RESPONSE_ATTENTION_MASK: attention,
               ENV_REWARD: torch.tensor([sum(t.reward.values()) for t in trajectories], dtype=torch.float32),
               NUM_TURNS: torch.tensor([t.turns for t in trajectories], dtype=torch.long),
               TRUNCATED: torch.tensor([int(t.truncated) for t in trajectories], dtype=torch.long),
               ENV_SECONDS: torch.tensor([t.env_seconds for t in trajectories], dtype=torch.float32)}
    if with_log_probs:
        tensors[ROLLOUT_LOG_PROBS] = log_probs * trained
    return Batch.from_tensors(tensors, {REWARD_PARTS: [dict(t.reward) for t in trajectories],
                                        ENV_METRICS: [dict(t.metrics) for t in trajectories]})
