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


#: fp32 bytes of one chunk of logits processed at a time by ``chunked_log_probs``.
CHUNK_BYTES = 256 * 2**20


def _chunks(logits: torch.Tensor, budget: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """Ranges over the first dimension whose fp32 copy stays within ``budget`` bytes."""
    per_row = max(1, logits[0].numel() * 4) if logits.shape[0] else 1
    rows = max(1, budget // per_row)
    return [(s, min(s + rows, logits.shape[0])) for s in range(0, logits.shape[0], rows)]


class _LogProbsAndEntropy(torch.autograd.Function):
    """Log-probs of ``labels`` and entropies of ``softmax(logits * inv_temp)``, chunk by chunk in fp32.

    The plain formulas upcast the whole ``(..., V)`` logits to fp32 (and the entropy adds a softmax and a
    product of the same size), all kept for the backward: for a 150k vocabulary that is most of a step's
    activation memory. Here only the (bf16) logits and per-token ``logsumexp``/entropy are saved; forward and
    backward each rebuild one fp32 chunk at a time."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, inv_temp: float, want_entropy: bool):
        ctx.set_materialize_grads(False)  # an output left out of the loss (entropy as a metric) costs nothing
        lead = logits.shape[:-1]
        log_probs = torch.empty(lead, dtype=torch.float32, device=logits.device)
        lse_all = torch.empty(lead, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(lead, dtype=torch.float32, device=logits.device) if want_entropy else None
        for s, e in _chunks(logits):
            z = logits[s:e].float() * inv_temp
            lse = torch.logsumexp(z, dim=-1)
            lse_all[s:e] = lse
            log_probs[s:e] = z.gather(-1, labels[s:e].long().unsqueeze(-1)).squeeze(-1) - lse
            if entropy is not None:
                z.sub_(lse.unsqueeze(-1))  # log p
                entropy[s:e] = -(z.exp() * z).sum(-1)
            del z
        ctx.inv_temp = inv_temp
        ctx.save_for_backward(logits, labels, lse_all, entropy if entropy is not None else lse_all)
        ctx.has_entropy = entropy is not None
        if entropy is None:
            return log_probs, torch.zeros_like(log_probs)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        logits, labels, lse_all, entropy = ctx.saved_tensors
        use_entropy = ctx.has_entropy and grad_entropy is not None
        grad = torch.empty_like(logits)
        for s, e in _chunks(logits):
            z = logits[s:e].float() * ctx.inv_temp
            log_p = z - lse_all[s:e].unsqueeze(-1)
            p = log_p.exp()
            gz = torch.zeros_like(z)
            if grad_log_probs is not None:  # d logp_y / dz = onehot(y) - p
                g = grad_log_probs[s:e].unsqueeze(-1)
                gz -= p * g
                gz.scatter_add_(-1, labels[s:e].long().unsqueeze(-1), g)
            if use_entropy:  # dH / dz_j = -p_j (log p_j + H)
                gz -= p * (log_p + entropy[s:e].unsqueeze(-1)) * grad_entropy[s:e].unsqueeze(-1)
            grad[s:e] = (gz * ctx.inv_temp).to(grad.dtype)
            del z, log_p, p, gz
        return grad, None, None, None


def chunked_log_probs(logits: torch.Tensor, labels: torch.Tensor, temperature: float | None = None,
                      with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log_probs, entropy or None)`` of ``softmax(logits / temperature)``, fp32, differentiable, without an
    fp32 copy of the whole logits (see ``_LogProbsAndEntropy``). ``logits`` (..., V) in any float dtype."""
    inv_temp = 1.0 / float(temperature) if temperature else 1.0
    log_probs, entropy = _LogProbsAndEntropy.apply(logits, labels, inv_temp, with_entropy)
    return log_probs, (entropy if with_entropy else None)
