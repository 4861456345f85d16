"""Advantage estimators. Each takes ``AdvantageInputs`` and returns ``(advantages, returns)``, both (B, R),
zero at padded response positions.

An estimator that needs more than the rewards declares it with ``@needs(...)``; the trainer provides:

* ``"values"``: the critic's values ``(B, R)`` (the value of the state before each response token); naming
  it makes the algorithm run a critic role (GAE).
* ``"baseline_scores"``: the reward ``(B,)`` of one greedy response per prompt, broadcast to its group
  (ReMax); naming it makes the trainer generate that greedy response every step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridrl.engines.batch import BASELINE_SCORES, VALUES

#: what an estimator may ask the trainer for (see the module docstring).
KNOWN_NEEDS = frozenset({VALUES, BASELINE_SCORES})


@dataclass
class AdvantageInputs:
    token_rewards: torch.Tensor  # (B, R): the sequence score on its last response token (+ KL penalty if in reward)
    response_mask: torch.Tensor  # (B, R)
    group_index: torch.Tensor  # (B,) long: rows with the same index answer the same prompt
    values: torch.Tensor | None = None  # (B, R) critic values, for GAE
    norm_by_std: bool = True
    options: dict[str, Any] = field(default_factory=dict)
    gamma: float = 1.0  # discount (GAE, REINFORCE++)
    lam: float = 1.0  # GAE's lambda
    baseline_scores: torch.Tensor | None = None  # (B,) reward of the greedy response to the row's prompt (ReMax)


def needs(*names: str) -> Callable[[Callable], Callable]:
    """Declare what an estimator needs besides the rewards (``"values"``, ``"baseline_scores"``)."""
    unknown = set(names) - KNOWN_NEEDS
    if unknown:
        raise ValueError(f"unknown estimator needs {sorted(unknown)} (known: {sorted(KNOWN_NEEDS)})")

    def mark(fn: Callable) -> Callable:
        fn.needs = tuple(names)  # type: ignore[attr-defined]
        return fn

    return mark


def estimator_needs(fn: Callable) -> tuple[str, ...]:
    return tuple(getattr(fn, "needs", ()))


def within_group(fn: Callable) -> Callable:
    """Mark an estimator whose baseline is the other samples of the same prompt: with one sample per prompt
    it has none and the advantage is the raw score, so pre-flight refuses ``algorithm.n_samples=1`` for it."""
    fn.within_group = True  # type: ignore[attr-defined]
    return fn


def compares_within_group(fn: Callable) -> bool:
    return bool(getattr(fn, "within_group", False))


# --- helpers ------------------------------------------------------------------------------------------
def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries (unbiased variance), zero where masked out."""
    m = mask.to(x.dtype)
    n = m.sum()
    mean = (x * m).sum() / n.clamp(min=1.0)
    var = (((x - mean) * m) ** 2).sum() / (n - 1).clamp(min=1.0)
    return (x - mean) * torch.rsqrt(var + eps) * m


def sequence_scores(inputs: AdvantageInputs) -> torch.Tensor:
    """(B,) sum of each row's token rewards (its score plus any KL penalty)."""
    mask = inputs.response_mask.to(inputs.token_rewards.dtype)
    return (inputs.token_rewards * mask).sum(dim=-1)


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


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    advantages = per_seq.unsqueeze(-1) * mask.to(per_seq.dtype)
    return advantages, advantages.clone()


def _reverse_discounted_sum(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t'}`` with ``t'`` the next unmasked position (padding is skipped)."""
    m = mask.to(rewards.dtype)
    running = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    out = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        current = rewards[:, t] + gamma * running
        out[:, t] = current * m[:, t]
        running = current * m[:, t] + running * (1 - m[:, t])
    return out


# --- estimators ---------------------------------------------------------------------------------------
@within_group
def grpo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: the group-normalised sequence score, given to every response token (Dr.GRPO when
    ``norm_by_std`` is off)."""
    adv = group_normalised_scores(sequence_scores(inputs), inputs.group_index, inputs.norm_by_std)
    return _broadcast(adv, inputs.response_mask)


@within_group
def rloo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: score minus the mean score of the *other* samples of the same prompt,
    ``s_i - mean_{j != i} s_j = n/(n-1) * (s_i - mean)``. A group of one keeps its raw score."""
    scores = sequence_scores(inputs)
    out = scores.clone()
    for g in torch.unique(inputs.group_index):
        idx = inputs.group_index == g
        n = int(idx.sum())
        if n > 1:
            s = scores[idx]
            out[idx] = (s - s.mean()) * n / (n - 1)
    return _broadcast(out, inputs.response_mask)


def reinforce_pp(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: per-token discounted return of the token rewards (score + per-token KL penalty when
    the KL is in the reward), whitened over all response tokens of the batch (a global baseline)."""
    returns = _reverse_discounted_sum(inputs.token_rewards, inputs.response_mask, inputs.gamma)
    return masked_whiten(returns, inputs.response_mask), returns


def reinforce_pp_baseline(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++-baseline: sequence score minus its group's mean (a group of one: minus 0), given to every
    token, then whitened over the batch's response tokens."""
    centred = group_normalised_scores(sequence_scores(inputs), inputs.group_index, norm_by_std=False)
    per_token, _ = _broadcast(centred, inputs.response_mask)
    adv = masked_whiten(per_token, inputs.response_mask)
    return adv, adv.clone()


@needs(BASELINE_SCORES)
def remax(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax: the return-to-go of the token rewards minus the reward of the greedy response to the same
    prompt (one extra greedy rollout per prompt, made by the trainer)."""
    if inputs.baseline_scores is None:
        raise ValueError("remax needs baseline_scores (the greedy response's reward per row)")
    mask = inputs.response_mask.to(inputs.token_rewards.dtype)
    returns = (inputs.token_rewards * mask).flip(-1).cumsum(-1).flip(-1) * mask
    advantages = returns - inputs.baseline_scores.to(returns.dtype).unsqueeze(-1) * mask
    return advantages, returns


@needs(VALUES)
def gae(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (PPO). ``values[:, t]`` is the value of the state before response
    token ``t``; the state after the last token is terminal (value 0). Padded positions are skipped.
    Returns ``(whitened advantages, returns = advantages + values)``; the critic regresses on the returns."""
    if inputs.values is None:
        raise ValueError("gae needs the critic's values")
    rewards, values = inputs.token_rewards, inputs.values.to(inputs.token_rewards.dtype)
    m = inputs.response_mask.to(rewards.dtype)
    next_value = torch.zeros(rewards.shape[0], dtype=rewards.dtype)
    running = torch.zeros_like(next_value)
    raw = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + inputs.gamma * next_value - values[:, t]
        current = delta + inputs.gamma * inputs.lam * running
        raw[:, t] = current * m[:, t]
        next_value = values[:, t] * m[:, t] + next_value * (1 - m[:, t])
        running = current * m[:, t] + running * (1 - m[:, t])
    returns = (raw + values) * m
    return masked_whiten(raw, m), returns
