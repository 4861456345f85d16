"""Policy losses (per token) and loss aggregation (per token -> scalar share of the global loss)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.engines import LossScale


@dataclass(frozen=True)
class PolicyLossSettings:
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(x.dtype)
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def ppo_clip(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
             mask: torch.Tensor, settings: PolicyLossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate with asymmetric bounds ``[1 - clip_low, 1 + clip_high]`` and, when
    ``dual_clip`` is set, the dual-clip bound ``dual_clip * -A`` for negative advantages."""
    log_ratio = (log_probs - old_log_probs).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high)
    loss = torch.maximum(unclipped, clipped)
    clipfrac = (clipped > unclipped).to(loss.dtype)
    if settings.dual_clip is not None:
        dual = -advantages * settings.dual_clip
        loss = torch.where(advantages < 0, torch.minimum(loss, dual), loss)
    metrics = {
        "clipfrac": masked_mean(clipfrac, mask),
        "ppo_kl": masked_mean(-log_ratio, mask),
        "ratio": masked_mean(ratio, mask),
    }
    return loss, metrics


def gspo(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
         mask: torch.Tensor, settings: PolicyLossSettings) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the clipped surrogate on the *sequence* ratio ``s_i = exp(mean_t log(pi/pi_old))`` (the
    geometric mean of the token ratios), bounds ``[1 - clip_low, 1 + clip_high]``. Per token it is written
    ``s_i * pi(y_t) / sg(pi(y_t))``: the same value as ``s_i``, but each token gets its own gradient
    ``s_i * grad log pi(y_t) / |y_i|`` (GSPO-token, as in the paper and verl). Pair with seq-mean-token-mean."""
    m = mask.to(log_probs.dtype)
    lengths = m.sum(-1).clamp(min=1.0)
    seq_log_ratio = ((log_probs - old_log_probs) * m).sum(-1) / lengths  # (B,)
    log_ratio = log_probs - log_probs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = log_ratio.clamp(max=10.0).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - settings.clip_low, 1.0 + settings.clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {
        "clipfrac": masked_mean((clipped > unclipped).to(loss.dtype), mask),
        "ppo_kl": masked_mean(-(log_probs - old_log_probs), mask),
        "ratio": masked_mean(ratio.detach(), mask),
    }
    return loss, metrics


def truncated_is_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, mask: torch.Tensor,
                         cap: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling (TIS, Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"): the tokens were sampled by the rollout's policy (stale weights when pipelined,
    or an engine whose numerics differ from the trainer's), while the PPO ratio is taken against ``pi_old``,
    the trainer's log-probs at train time. Each token's policy loss is weighted by
    ``min(pi_old / pi_rollout, cap)`` (no gradient through it), which corrects the sampling distribution while
    the truncation bounds the variance. Returns the weights and ``tis_ratio`` (mean untruncated ratio),
    ``tis_weight`` (mean weight applied) and ``tis_clipfrac`` (share of tokens truncated)."""
    ratio = (old_log_probs.detach() - rollout_log_probs.detach()).clamp(-20.0, 20.0).exp()
    weights = ratio.clamp(max=cap)
    metrics = {"tis_ratio": masked_mean(ratio, mask), "tis_weight": masked_mean(weights, mask),
               "tis_clipfrac": masked_mean((ratio > cap).to(ratio.dtype), mask)}
    return weights, metrics


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       cliprange: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's value loss per token, ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, +-c) - R)^2)``: the new
    value may not move more than ``cliprange`` from the value the advantages were computed with (``None``:
    plain ``0.5 * (V - R)^2``). Returns ``(loss, clipped)``, the second a 0/1 tensor of where the clipped
    branch was the larger one."""
    unclipped = (values - returns).square()
    if cliprange is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    clipped_values = old_values + (values - old_values).clamp(-cliprange, cliprange)
    clipped = (clipped_values - returns).square()
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).to(values.dtype)


def token_mean(token_loss: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    """Mean over every response token of the global batch."""
    return (token_loss * mask).sum() / max(scale.total_tokens, 1.0) * scale.dp_size


def seq_mean_token_sum(token_loss: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    """Per-sequence token sums, averaged over the sequences of the global batch."""
    return (token_loss * mask).sum() / max(scale.total_sequences, 1.0) * scale.dp_size


def seq_mean_token_mean(token_loss: torch.Tensor, mask: torch.Tensor, scale: LossScale) -> torch.Tensor:
    """Per-sequence token means, averaged over the sequences of the global batch."""
    mask = mask.to(token_loss.dtype)
    per_seq = (token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
    return per_seq.sum() / max(scale.total_sequences, 1.0) * scale.dp_size
