"""Attention over packed rows (``packing``): each row attends causally to itself only.

Registered with transformers' ``AttentionInterface`` under the names of ``KERNELS``; a model loaded with one
of them runs every attention layer through ``packed_attention`` and reads the rows' boundaries from the forward's
``cu_seq_lens_q`` / ``max_length_q`` keywords (no mask is built: these names are not in transformers' mask
registry, so its mask step returns None at once, and never scans the positions for packed rows).

The kernels, by name (``auto`` picks the first that applies):

* ``flash_attn``: ``flash_attn.flash_attn_varlen_func`` where the package is installed (CUDA, fp16/bf16);
* ``torch_flash``: PyTorch's own flash-attention varlen kernels (``aten._flash_attention_forward/backward``,
  in every CUDA build of torch; fp16/bf16, sm80+), with their backward in a small autograd function;
* ``sdpa``: the plain path (CPU, fp32, anything else): the packed q/k/v are scattered into a
  ``(rows, longest row)`` layout, ``scaled_dot_product_attention(is_causal=True)`` runs on it (right padding
  needs no mask under a causal mask: a real query never sees a later position), and the outputs are gathered
  back. Only the attention pays for the padding; the projections, MLPs and head stay padding-free.

vLLM's bundled ``vllm_flash_attn`` is not used: it is built for inference (forward kernels only).
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from typing import Any, Callable

import torch
import torch.nn.functional as F

from hybridrl_fsdp.settings import PACKED_ATTENTION as KERNELS

PREFIX = "hybridrl_varlen"


def implementation_name(kernel: str) -> str:
    """The ``attn_implementation`` under which ``kernel`` is registered (see ``register``)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown packed attention kernel '{kernel}' (known: {', '.join(KERNELS)})")
    return PREFIX if kernel == "auto" else f"{PREFIX}_{kernel}"


@lru_cache(maxsize=None)
def register() -> None:
    """Register every kernel with transformers (once per process)."""
    from transformers import AttentionInterface

    for kernel in KERNELS:
        AttentionInterface.register(implementation_name(kernel), _forward_for(kernel))


def _forward_for(kernel: str) -> Callable[..., tuple[torch.Tensor, None]]:
    def forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        return packed_attention(kernel, module, query, key, value, attention_mask, dropout, scaling,
                                sliding_window, **kwargs), None

    forward.__name__ = f"packed_attention_{kernel}"
    return forward


def packed_attention(kernel: str, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
                     sliding_window: int | None, cu_seq_lens_q: torch.Tensor | None = None,
                     max_length_q: int | None = None, **_: Any) -> torch.Tensor:
    """``(1, H, T, D)`` query, ``(1, Hkv, T, D)`` key/value (transformers' layout) -> ``(1, T, H, D)``.

    Without ``cu_seq_lens_q`` the input is one batch of whole rows (no padding): plain causal attention."""
    if sliding_window is not None:
        raise NotImplementedError("packed micro-batches do not support sliding-window attention layers; "
                                  "set the role's option packing: false")
    if dropout:
        raise NotImplementedError("packed attention has no attention dropout (set attention_dropout to 0)")
    if cu_seq_lens_q is None:
        if attention_mask is not None:
            raise ValueError("packed attention got a padding mask: the engine passes packed rows without one")
        out = F.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1, scale=scaling,
                                             enable_gqa=key.shape[1] != query.shape[1])
        return out.transpose(1, 2)
    if query.shape[0] != 1:
        raise ValueError(f"packed rows come as one sequence, got a batch of {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, heads, D): views of the projections
    chosen = choose_kernel(kernel, q)
    max_len = int(max_length_q) if max_length_q is not None else q.shape[0]
    if chosen == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_len, max_len, dropout_p=0.0,
                                     softmax_scale=scaling, causal=True)
    elif chosen == "torch_flash":
        if k.shape[1] != q.shape[1]:  # grouped-query attention: one kv head per group of query heads
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = _TorchFlashVarlen.apply(q.contiguous(), k.contiguous(), v.contiguous(), cu_seq_lens_q, max_len,
                                      scaling if scaling is not None else q.shape[-1] ** -0.5)
    else:
        out = _padded_sdpa(q, k, v, cu_seq_lens_q, max_len, scaling)
    return out.unsqueeze(0)


def choose_kernel(kernel: str, q: torch.Tensor) -> str:
    """The kernel that runs for ``q`` (``(T, H, D)``): the one asked for, or under ``auto`` the first of
    flash_attn, torch_flash, sdpa that applies. Asking for a kernel that cannot run raises."""
    half = q.dtype in (torch.float16, torch.bfloat16)
    fits = q.is_cuda and half and q.shape[-1] <= 256
    if kernel == "auto":
        if fits and _flash_attn_installed():
            return "flash_attn"
        if fits and _torch_flash_available(q.device):
            return "torch_flash"
        return "sdpa"
    if kernel == "flash_attn" and not (fits and _flash_attn_installed()):
        raise RuntimeError("packed_attention 'flash_attn' needs the flash-attn package and fp16/bf16 CUDA tensors")
    if kernel == "torch_flash" and not (fits and _torch_flash_available(q.device)):
        raise RuntimeError("packed_attention 'torch_flash' needs fp16/bf16 CUDA tensors on an sm80+ GPU with "
                           "torch's flash attention")
    return kernel


@lru_cache(maxsize=None)
def _flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@lru_cache(maxsize=None)
def _torch_flash_available(device: torch.device) -> bool:
    return (torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(device)[0] >= 8)


class _TorchFlashVarlen(torch.autograd.Function):
    """Causal varlen attention through PyTorch's flash-attention ops (forward and backward kernels); q/k/v
    ``(T, H, D)`` contiguous, equal head counts."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                scale: float) -> torch.Tensor:
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, seed, offset)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse, cu_seqlens, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, ctx.max_len, ctx.max_len, 0.0, True,
            seed, offset, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def _padded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                 scaling: float | None) -> torch.Tensor:
    """Causal attention of packed ``(T, heads, D)`` rows through sdpa on a right-padded ``(rows, max_len)``
    layout (see the module docstring); ``(T, H, D)`` out. Index arithmetic only: nothing is read back. Rows all
    of one length are a plain view; otherwise one ``index_select`` each way (its backward is an ``index_add``)."""
    total, rows = q.shape[0], cu_seqlens.shape[0] - 1
    gqa = k.shape[1] != q.shape[1]
    if total == rows * max_len:  # every row max_len long (known on the host: shapes only)
        out = F.scaled_dot_product_attention(*(t.view(rows, max_len, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)),
                                             is_causal=max_len > 1, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(total, *q.shape[1:])
    starts = cu_seqlens[:-1].long()
    slot = torch.arange(max_len, device=q.device)
    source = starts[:, None] + slot[None, :]  # (rows, max_len) token of each padded slot ...
    real = source < cu_seqlens[1:].long()[:, None]
    source = torch.where(real, source, total).flatten()  # ... or the zero row appended at index T
    token = torch.arange(total, device=q.device)
    row = torch.searchsorted(cu_seqlens[1:].to(token.dtype), token, right=True)
    target = row * max_len + token - starts[row]  # the padded slot of each token

    def padded(t: torch.Tensor) -> torch.Tensor:
        t = torch.cat([t, t.new_zeros(1, *t.shape[1:])])
        return t.index_select(0, source).view(rows, max_len, *t.shape[1:]).transpose(1, 2)

    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), is_causal=max_len > 1, scale=scaling,
                                         enable_gqa=gqa)
    return out.transpose(1, 2).reshape(rows * max_len, *q.shape[1:]).index_select(0, target)
