"""Per-token log-probabilities and entropies from logits, in fp32.

Both work on any leading shape ``(..., V)`` and never build a full ``log_softmax`` tensor: the log-prob of a
token is ``logit[token] - logsumexp(logits)``, which needs one ``(...,)`` reduction instead of a second
``(..., V)`` tensor (the logits of a large vocabulary dominate activation memory).
"""

from __future__ import annotations

import torch


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[labels]`` computed in fp32; ``logits`` (..., V), ``labels`` (...) -> (...)."""
    logits = logits.float()
    picked = logits.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` in fp32: ``logsumexp(z) - sum(softmax(z) * z)``; (..., V) -> (...)."""
    logits = logits.float()
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
