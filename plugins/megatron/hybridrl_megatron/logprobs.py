"""Per-token log-probs and entropies from logits whose vocabulary is split over tensor-parallel ranks.

Each rank holds the logits of its slice ``[start, start + V_local)`` of the (padded) vocabulary. Nothing
gathers the full vocabulary: the log-sum-exp takes one all-reduce (max) and one all-reduce (sum of exps)
over the tensor-parallel group; the label's logit is read on the rank that owns it and summed over the
group; the entropy takes one more all-reduce (sum of ``exp * logit``). Ids at or above ``vocab_size`` (the
padding Megatron appends to the vocabulary) are left out of every sum. Gradients flow through the sums
(forward all-reduce, backward identity: the loss is replicated on every tensor-parallel rank, so each rank
back-propagates into its own slice only). Pure torch.distributed: no megatron-core needed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group`` forward; identity backward (every rank holds the same downstream loss)."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def _sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    return tensor if group is None else _AllReduceSum.apply(tensor, group)


def _owned_label_logits(z: torch.Tensor, labels: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """Each label's logit where this rank's slice ``z`` (its real ids only) holds the label, else 0: summed over
    the tensor-parallel group, every position gets its label's logit exactly once."""
    valid = z.shape[-1]
    if not valid:
        return torch.zeros(z.shape[:-1], device=z.device)
    local = labels.long() - vocab_start
    owned = (local >= 0) & (local < valid)
    picked = z.gather(-1, local.clamp(0, valid - 1).unsqueeze(-1)).squeeze(-1)
    return torch.where(owned, picked, torch.zeros_like(picked))


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, vocab_size: int,
                             group: dist.ProcessGroup | None = None, with_entropy: bool = False
                             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(full logits)[labels]`` (and the entropy) in fp32, from this rank's vocabulary slice.

    ``logits`` (..., V_local) covers global ids ``vocab_start .. vocab_start + V_local``; ``labels`` (...)
    are global ids below ``vocab_size``; ``group`` is the tensor-parallel group (None: one rank, no
    communication). Returns tensors of shape ``labels.shape``."""
    valid = max(0, min(logits.shape[-1], vocab_size - vocab_start))  # this rank's ids below vocab_size
    z = logits[..., :valid].float()
    lead = z.shape[:-1]
    with torch.no_grad():  # the shift cancels out of every result: no gradient through it
        shift = z.amax(dim=-1) if valid else torch.full(lead, float("-inf"), device=z.device)
        if group is not None:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
    exps = torch.exp(z - shift.unsqueeze(-1))
    sum_exp = _sum(exps.sum(dim=-1), group)
    log_norm = torch.log(sum_exp) + shift

    log_probs = _sum(_owned_label_logits(z, labels, vocab_start), group) - log_norm

    entropy = None
    if with_entropy:
        weighted = _sum((exps * z).sum(dim=-1), group)
        entropy = log_norm - weighted / sum_exp
    return log_probs, entropy


@torch.no_grad()
def vocab_parallel_greedy_margins(logits: torch.Tensor, labels: torch.Tensor, vocab_start: int, vocab_size: int,
                                  group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``max(full logits) - logits[labels]`` (fp32, >= 0; 0: the label is an argmax) from this rank's vocabulary
    slice, padding ids left out: one all-reduce (max) and one (sum of the label's logit, read by its owner)."""
    valid = max(0, min(logits.shape[-1], vocab_size - vocab_start))
    z = logits[..., :valid].float()
    lead = z.shape[:-1]
    top = z.amax(dim=-1) if valid else torch.full(lead, float("-inf"), device=z.device)
    if group is not None:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    picked = _owned_label_logits(z, labels, vocab_start)
    if group is not None:
        dist.all_reduce(picked, group=group)
    return (top - picked).clamp_min(0.0)
