"""KL estimators between the policy and the reference, per token (Schulman's k1, k2, k3)."""

from __future__ import annotations

import torch


def k1(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """log(p/q): unbiased, high variance, can be negative."""
    return log_probs - ref_log_probs


def k2(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """0.5 * log(p/q)^2: biased, low variance, non-negative."""
    return 0.5 * (log_probs - ref_log_probs).square()


def k3(log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """q/p - log(q/p) - 1: unbiased and non-negative. The log-ratio is clamped to [-20, 20] and the result
    to [-10, 10] so that one far-off token cannot blow up the loss."""
    log_ratio = (ref_log_probs - log_probs).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)
