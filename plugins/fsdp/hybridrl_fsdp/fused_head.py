"""The LM head fused with the per-token log-prob and entropy: the (tokens x vocab) logits never exist at once.

``linear_log_probs(hidden, weight, bias, labels, ...)`` computes ``log softmax(hidden @ weight.T / T)[labels]``
(and the entropy of that distribution) chunk by chunk over the tokens: each chunk's logits are made by one matmul,
reduced to three numbers per token, and dropped. The backward makes them again, chunk by chunk, turns them into
``d loss / d logits`` in place and feeds the two matmuls of the gradients. Only the hidden states and three fp32
numbers per token are kept between forward and backward.

``kept_logits`` (``options.head_logits: keep``, which the memory plan picks where they fit) trades that memory for
the recomputing matmul: the forward keeps the micro-batch's logits (tokens x vocab, compute dtype) and the
backward turns them into their gradient in place. At 0.5B-3B that matmul is 3-9% of an update's FLOPs. The
micro-batches of one update write their logits into one buffer (``KeptLogits``): a fresh multi-GiB tensor per
micro-batch lets the next forward's activations split the block the last one freed, and the allocator then maps
a second one (measured: 30 GiB more at the peak instead of the 19 GiB kept).

Why not liger-kernel's fused linear cross-entropy: it computes the gradients during the forward and scales them
by a scalar upstream gradient in the backward, which is wrong for a per-token upstream gradient (a PPO loss of
the log-probs); it has no entropy output and no temperature; and it is Triton-only. The per-chunk softmax math runs
in Triton kernels on CUDA (``head_kernels``: one read of the chunk forward, one read and write backward) and in
eager PyTorch elsewhere.

``LogProbHead`` puts this in the model: the causal LM's ``lm_head`` (an ``nn.Linear``) becomes one, same weight
and name, and while ``head.computing(labels, ...)`` is active its forward returns ``(..., 2)`` log-probs and
entropies instead of logits. The head thus runs inside the model's own forward, where FSDP has gathered the
weight, and its gradient reaches the weight (tied to the embedding or not) like the plain head's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from hybridrl_fsdp import head_kernels

#: bytes of one chunk's logits (in their own dtype with the Triton kernels, fp32 temporaries without).
CHUNK_BYTES_TRITON = 2**30
CHUNK_BYTES_EAGER = 256 * 2**20


def _chunk_rows(n_cols: int, element_bytes: int, budget: int) -> int:
    return max(1, budget // max(1, n_cols * element_bytes))


# --- the chunk math, eager ----------------------------------------------------------------------------------
def _stats_eager(logits: torch.Tensor, labels: torch.Tensor, inv_temp: float, want_entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``head_kernels.chunk_stats`` in PyTorch (``logits`` is the caller's own scratch: changed in place)."""
    z = logits.float()
    if inv_temp != 1.0:
        z = z.mul_(inv_temp)
    lse = torch.logsumexp(z, dim=-1)
    log_probs = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    entropy = None
    if want_entropy:
        log_p = z.sub_(lse.unsqueeze(-1))
        entropy = -(log_p.exp() * log_p).sum(-1)
    return lse, log_probs, entropy


def _grad_eager(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None,
                grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, inv_temp: float
                ) -> torch.Tensor:
    """``head_kernels.chunk_grad_`` in PyTorch: ``d loss / d logits`` in the logits' dtype."""
    z = logits.float()
    if inv_temp != 1.0:
        z = z.mul_(inv_temp)
    log_p = z.sub_(lse.unsqueeze(-1))
    p = log_p.exp()
    grad = torch.zeros_like(p)
    if grad_log_probs is not None:  # d logp_y / dz_j = [j == y] - p_j
        grad.addcmul_(p, grad_log_probs.unsqueeze(-1), value=-1.0)
        grad.scatter_add_(-1, labels.unsqueeze(-1), grad_log_probs.unsqueeze(-1))
    if grad_entropy is not None and entropy is not None:  # dH / dz_j = -p_j (log p_j + H)
        grad.sub_(p * log_p.add_(entropy.unsqueeze(-1)) * grad_entropy.unsqueeze(-1))
    if inv_temp != 1.0:
        grad.mul_(inv_temp)
    return grad.to(logits.dtype)


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and head_kernels.available()


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.addmm(bias, hidden, weight.t()) if bias is not None else hidden @ weight.t()


class KeptLogits:
    """The buffer the micro-batches of one update keep their logits in (see the module docstring): taken by a
    forward, given back by its backward; ``release`` frees it (the engine calls it when the update ends). A
    forward that finds it taken (a second forward before the first one's backward) gets a tensor of its own."""

    def __init__(self, rows: int | None = None) -> None:
        self.rows = rows  # what to allocate for at least (the micro-batch's token budget), None: what is asked
        self._storage: torch.Tensor | None = None
        self._taken = False

    def take(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, bool]:
        """``(rows x cols logits, whether they are this buffer's)``."""
        need = rows * cols
        if self._taken:
            return torch.empty(rows, cols, dtype=dtype, device=device), False
        storage = self._storage
        if storage is None or storage.numel() < need or storage.dtype != dtype or storage.device != device:
            self._storage = storage = None  # freed before the larger one is made
            self._storage = storage = torch.empty(max(need, (self.rows or 0) * cols), dtype=dtype, device=device)
        self._taken = True
        return storage[:need].view(rows, cols), True

    def give_back(self) -> None:
        self._taken = False

    def release(self) -> None:
        self._storage, self._taken = None, False

    @property
    def bytes(self) -> int:
        return 0 if self._storage is None else self._storage.numel() * self._storage.element_size()


class _LinearLogProbs(torch.autograd.Function):
    """See ``linear_log_probs``. ``triton`` picks the chunk math (the engine passes ``_use_triton``; the tests
    also run the kernels under Triton's interpreter on CPU)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                inv_temp: float, want_entropy: bool, triton: bool, chunk_rows: int,
                keep_in: KeptLogits | None = None):
        ctx.set_materialize_grads(False)  # an output left out of the loss (entropy as a metric) costs nothing
        n = hidden.shape[0]
        stats = head_kernels.chunk_stats if triton else _stats_eager
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        log_probs = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if want_entropy else None
        kept, owner = (None, None) if keep_in is None else keep_in.take(n, weight.shape[0], hidden.dtype,
                                                                          hidden.device)
        for s in range(0, n, chunk_rows):
            e = min(s + chunk_rows, n)
            if kept is None:
                chunk = _logits(hidden[s:e], weight, bias)
            else:  # the eager statistics write over their input: they get a copy of what is kept
                chunk = _logits_into(kept[s:e], hidden[s:e], weight, bias)
                chunk = chunk if triton else chunk.clone()
            c_lse, c_lp, c_ent = stats(chunk, labels[s:e], inv_temp, want_entropy)
            lse[s:e], log_probs[s:e] = c_lse, c_lp
            if entropy is not None:
                entropy[s:e] = c_ent
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.kept = kept  # not a saved tensor: the backward consumes it in place, once
        ctx.kept_in = keep_in if owner else None  # the buffer to give back once the backward consumed it
        ctx.inv_temp, ctx.triton, ctx.chunk_rows = inv_temp, triton, chunk_rows
        if entropy is None:
            entropy = torch.zeros_like(lse)
            ctx.mark_non_differentiable(entropy)
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        if entropy is None:
            grad_entropy = None
        kept, ctx.kept = ctx.kept, None
        kept_in, ctx.kept_in = ctx.kept_in, None
        if grad_log_probs is None and grad_entropy is None:
            if kept_in is not None:
                kept_in.give_back()
            return (None,) * 9
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        want_bias = bias is not None and ctx.needs_input_grad[2]
        n, rows = hidden.shape[0], ctx.chunk_rows if kept is None else hidden.shape[0]  # kept: one pass, two GEMMs
        grad_fn = head_kernels.chunk_grad_ if ctx.triton else _grad_eager
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # Several chunks: accumulate the weight's gradient in fp32 (a bf16 sum of chunk products loses bits).
        acc_dtype = weight.dtype if n <= rows else torch.float32
        grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_bias else None
        for s in range(0, n, rows):
            e = min(s + rows, n)
            logits = _logits(hidden[s:e], weight, bias) if kept is None else kept[s:e]
            grad = grad_fn(logits, labels[s:e], lse[s:e],
                           None if entropy is None else entropy[s:e],
                           None if grad_log_probs is None else grad_log_probs[s:e].float().contiguous(),
                           None if grad_entropy is None else grad_entropy[s:e].float().contiguous(), ctx.inv_temp)
            if grad_hidden is not None:
                torch.mm(grad, weight, out=grad_hidden[s:e])
            if grad_weight is not None:
                part = grad.t() @ hidden[s:e]
                grad_weight.add_(part)
            if grad_bias is not None:
                grad_bias.add_(grad.sum(0, dtype=torch.float32))
            del grad, logits
        del kept
        if kept_in is not None:
            kept_in.give_back()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def _logits_into(out: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
                 ) -> torch.Tensor:
    if bias is not None:
        return torch.addmm(bias, hidden, weight.t(), out=out)
    return torch.mm(hidden, weight.t(), out=out)


def linear_log_probs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                     temperature: float | None = None, with_entropy: bool = False, triton: bool | None = None,
                     chunk_rows: int | None = None, kept_logits: KeptLogits | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log_probs, entropy or None)`` of ``labels`` under ``softmax(hidden @ weight.T (+ bias)) / temperature``,
    fp32, shaped like ``labels``; differentiable in ``hidden``, ``weight`` and ``bias``. ``hidden`` is
    ``(..., H)`` and ``labels`` ``(...)``; the logits are made ``chunk_rows`` tokens at a time (default: about
    ``CHUNK_BYTES_*`` of them). ``kept_logits``: where a backward will follow, keep them there for it instead
    of making them again (see the module docstring)."""
    lead = labels.shape
    flat = hidden.reshape(-1, hidden.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if triton is None:
        triton = _use_triton(flat)
    if chunk_rows is None:
        vocab = weight.shape[0]
        chunk_rows = (_chunk_rows(vocab, flat.element_size(), CHUNK_BYTES_TRITON) if triton
                      else _chunk_rows(vocab, 4, CHUNK_BYTES_EAGER))
    inv_temp = 1.0 / float(temperature) if temperature else 1.0
    differentiable = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (flat, weight, bias))
    log_probs, entropy = _LinearLogProbs.apply(flat, weight, bias, labels.reshape(-1).long().contiguous(),
                                               inv_temp, with_entropy, bool(triton), int(chunk_rows),
                                               kept_logits if differentiable else None)
    return log_probs.view(lead), (entropy.view(lead) if with_entropy else None)


# --- in the model -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class HeadRequest:
    """What the head computes instead of logits: the labels its input rows predict (shaped like the input
    without its last dimension), the sampling temperature to undo, and whether entropies are wanted."""

    labels: torch.Tensor
    temperature: float | None
    with_entropy: bool


class LogProbHead(nn.Linear):
    """A causal LM's ``lm_head`` that, while a ``HeadRequest`` is active, returns ``(..., 2)`` fp32 log-probs
    and entropies (0 when not asked) instead of ``(..., V)`` logits; otherwise a plain ``nn.Linear``."""

    _request: HeadRequest | None = None
    #: where the logits are kept from forward to backward (``options.head_logits: keep``, ``keep_logits``)
    #: instead of being made again; None: made again
    kept_logits: KeptLogits | None = None

    def keep_logits(self, token_budget: int | None) -> None:
        """Keep the logits for the backward from now on, in a buffer sized for ``token_budget`` rows at least."""
        self.kept_logits = KeptLogits(token_budget)

    def release_kept_logits(self) -> None:
        """Free the kept logits' buffer (the end of an update: the memory goes back to the other roles)."""
        if self.kept_logits is not None:
            self.kept_logits.release()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        request = self._request
        if request is None:
            return super().forward(hidden)
        if request.labels.shape != hidden.shape[:-1]:
            raise ValueError(f"the head got hidden states {tuple(hidden.shape)} for labels "
                             f"{tuple(request.labels.shape)}")
        log_probs, entropy = linear_log_probs(hidden, self.weight, self.bias, request.labels, request.temperature,
                                              request.with_entropy, kept_logits=self.kept_logits)
        if entropy is None:
            entropy = torch.zeros_like(log_probs)
        return torch.stack([log_probs, entropy], dim=-1)

    @contextmanager
    def computing(self, labels: torch.Tensor, temperature: float | None, with_entropy: bool) -> Iterator[None]:
        """Inside: the head's forward returns log-probs of ``labels`` (and entropies), see the class."""
        self._request = HeadRequest(labels, temperature, with_entropy)
        try:
            yield
        finally:
            self._request = None


def install_log_prob_head(model: nn.Module) -> LogProbHead | None:
    """Turn the model's output projection into a ``LogProbHead`` in place (same parameters, same names, tied
    weights stay tied). None when the model has no plain ``nn.Linear`` head (it then keeps its own)."""
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if type(head) is nn.Linear:
        head.__class__ = LogProbHead
        return head  # type: ignore[return-value]
    return head if isinstance(head, LogProbHead) else None
