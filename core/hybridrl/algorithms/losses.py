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
