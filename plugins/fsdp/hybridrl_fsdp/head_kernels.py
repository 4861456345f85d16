"""Triton kernels for the fused LM head (``fused_head``): the softmax statistics of one chunk of logits, and the
gradient with respect to those logits written over them in place.

The eager formulas read and write the (tokens x vocab) chunk several times in fp32 (upcast, max, exp, sum,
gather, and as many again for the entropy and the backward); at a 152k vocabulary that memory traffic costs more
than the head's matmul. Each kernel here reads the chunk once in its own dtype (the backward also writes it once),
one program per row, with fp32 running sums per lane (an online softmax: no second pass for the maximum).

Kernels are defined on first use, so Triton is imported only where they run (CUDA; or Triton's interpreter on CPU
in the tests, ``TRITON_INTERPRET=1`` before the first call, see ``kernels.cache_clear``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from functools import cache
from typing import Any

import torch

#: columns each program handles per iteration (a power of two; smaller vocabularies use the next power of two).
BLOCK = 4096
NUM_WARPS = 8


def available() -> bool:
    """Whether the kernels can run on CUDA tensors here."""
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def _block(n_cols: int) -> int:
    return min(BLOCK, 1 << max(4, (n_cols - 1).bit_length()))


def chunk_stats(logits: torch.Tensor, labels: torch.Tensor, inv_temp: float, want_entropy: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(logsumexp, log-prob of the label, entropy or None)`` of each row of ``logits * inv_temp``, fp32."""
    rows, n_cols = logits.shape
    out = torch.empty(3 if want_entropy else 2, rows, dtype=torch.float32, device=logits.device)
    if rows:
        kernels()[0][(rows,)](logits, logits.stride(0), labels, out[0], out[1], out[-1], float(inv_temp),
                              N_COLS=n_cols, WANT_ENTROPY=want_entropy, BLOCK=_block(n_cols), num_warps=NUM_WARPS)
    return out[0], out[1], (out[2] if want_entropy else None)


def chunk_grad_(logits: torch.Tensor, labels: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None,
                grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, inv_temp: float
                ) -> torch.Tensor:
    """Overwrite ``logits`` with ``d loss / d logits`` given the upstream gradients of the log-probs and entropies
    (either may be None); returns ``logits``."""
    rows, n_cols = logits.shape
    has_lp, has_ent = grad_log_probs is not None, grad_entropy is not None and entropy is not None
    if rows:
        kernels()[1][(rows,)](logits, logits.stride(0), labels, lse, entropy if has_ent else lse,
                              grad_log_probs if has_lp else lse, grad_entropy if has_ent else lse,
                              float(inv_temp), N_COLS=n_cols, HAS_GRAD_LOG_PROBS=has_lp, HAS_GRAD_ENTROPY=has_ent,
                              BLOCK=_block(n_cols), num_warps=NUM_WARPS)
    return logits


@cache
def kernels() -> tuple[Any, Any]:
    """``(stats, grad)``, the two Triton kernels of ``_head_triton`` (imported once; after ``cache_clear`` the
    module is imported again, so a changed ``TRITON_INTERPRET`` takes effect)."""
    name = "hybridrl_fsdp._head_triton"
    module = importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
    return module.softmax_stats, module.softmax_grad
