"""Advantage estimators. Each takes ``AdvantageInputs`` and returns ``(advantages, returns)``, both (B, R)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AdvantageInputs:
    token_rewards: torch.Tensor  # (B, R): the sequence score on its last response token (+ KL penalty if in reward)
    response_mask: torch.Tensor  # (B, R)
    group_index: torch.Tensor  # (B,) long: rows with the same index answer the same prompt
    values: torch.Tensor | None = None  # (B, R) critic values, for GAE
    norm_by_std: bool = True
    options: dict[str, Any] = field(default_factory=dict)


def group_normalised_scores(scores: torch.Tensor, group_index: torch.Tensor, norm_by_std: bool,
                            eps: float = 1e-6) -> torch.Tensor:
    """(score - group mean) [/ (group std + eps)]. A group of one has mean 0 and std 1, so its advantage
    is its raw score (as in verl); the std is the unbiased one."""
    out = torch.empty_like(scores)
    for g in torch.unique(group_index):
        idx = group_index == g
        s = scores[idx]
        if s.numel() == 1:
            mean, std = torch.zeros((), dtype=s.dtype), torch.ones((), dtype=s.dtype)
        else:
            mean, std = s.mean(), s.std()
        out[idx] = (s - mean) / (std + eps) if norm_by_std else s - mean
    return out


def grpo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: the group-normalised sequence score, given to every response token (Dr.GRPO when
    ``norm_by_std`` is off)."""
    mask = inputs.response_mask.to(inputs.token_rewards.dtype)
    scores = (inputs.token_rewards * mask).sum(dim=-1)
    adv = group_normalised_scores(scores, inputs.group_index, inputs.norm_by_std)
    advantages = adv.unsqueeze(-1) * mask
    return advantages, advantages.clone()
