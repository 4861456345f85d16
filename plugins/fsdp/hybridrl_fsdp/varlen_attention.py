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

A pack with shared prompts (``packing.SharedPrompts``) arrives under ``packing.SHARED_KWARG`` instead: the
prompts attend within themselves, then each row's response segment attends to its prompt's keys and its own,
gathered (``kv_index``), with the causal mask aligned at the segment's end; every kernel takes query and key
segments of different lengths (the sdpa path builds that mask itself).

vLLM's bundled ``vllm_flash_attn`` is not used: it is built for inference (forward kernels only).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

from hybridrl_fsdp.packing import SharedPrompts
from hybridrl_fsdp.settings import PACKED_ATTENTION as KERNELS

PREFIX = "hybridrl_varlen"


def implementation_name(kernel: str) -> str:
    """The ``attn_implementation`` under which ``kernel`` is registered (see ``register``). The name never holds
    "flash": transformers takes any such name for a flash-attention package or hub kernel to import, and fails."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown packed attention kernel '{kernel}' (known: {', '.join(KERNELS)})")
    return PREFIX if kernel == "auto" else f"{PREFIX}_{kernel.replace('flash', 'fa')}"


@cache
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
                     max_length_q: int | None = None, hybridrl_shared_prompts: SharedPrompts | None = None,
                     **_: Any) -> torch.Tensor:
    """``(1, H, T, D)`` query, ``(1, Hkv, T, D)`` key/value (transformers' layout) -> ``(1, T, H, D)``.

    Without ``cu_seq_lens_q`` (or a shared-prompt layout) the input is one batch of whole rows (no padding):
    plain causal attention."""
    if sliding_window is not None:
        raise NotImplementedError("packed micro-batches do not support sliding-window attention layers; "
                                  "set the role's option packing: false")
    if dropout:
        raise NotImplementedError("packed attention has no attention dropout (set attention_dropout to 0)")
    if cu_seq_lens_q is None and hybridrl_shared_prompts is None:
        if attention_mask is not None:
            raise ValueError("packed attention got a padding mask: the engine passes packed rows without one")
        out = F.scaled_dot_product_attention(query, key, value, is_causal=query.shape[2] > 1, scale=scaling,
                                             enable_gqa=key.shape[1] != query.shape[1])
        return out.transpose(1, 2)
    if query.shape[0] != 1:
        raise ValueError(f"packed rows come as one sequence, got a batch of {query.shape[0]}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, heads, D): views of the projections
    chosen = choose_kernel(kernel, q)
    if hybridrl_shared_prompts is not None:
        return _shared_prompt_attention(chosen, q, k, v, hybridrl_shared_prompts, scaling).unsqueeze(0)
    max_len = int(max_length_q) if max_length_q is not None else q.shape[0]
    return _varlen(chosen, q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_len, max_len, scaling).unsqueeze(0)


def _shared_prompt_attention(chosen: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SharedPrompts,
                             scaling: float | None) -> torch.Tensor:
    """``(T, H, D)`` out of a shared-prompt pack: the prompts' segments, then the responses' (module docstring)."""
    p = layout.prompt_tokens
    parts = [_varlen(chosen, q[:p], k[:p], v[:p], layout.prompt_cu, layout.prompt_cu, layout.prompt_max,
                     layout.prompt_max, scaling)] if p else []
    if q.shape[0] > p:
        keys, values = k.index_select(0, layout.kv_index), v.index_select(0, layout.kv_index)
        parts.append(_varlen(chosen, q[p:], keys, values, layout.response_cu_q, layout.response_cu_k,
                             layout.response_max_q, layout.response_max_k, scaling))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _varlen(chosen: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
            max_q: int, max_k: int, scaling: float | None) -> torch.Tensor:
    """Causal attention of query segment ``i`` (``cu_q``) over key segment ``i`` (``cu_k``), the mask aligned
    at the segments' ends; ``(Tq, H, D)`` out. ``cu_k is cu_q`` (the same tensor, a host check) is each segment
    attending to itself, which the sdpa path runs with sdpa's own causal mask."""
    if chosen == "flash_attn":
        from flash_attn import flash_attn_varlen_func

        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scaling,
                                      causal=True)
    if chosen == "torch_flash":
        if k.shape[1] != q.shape[1]:  # grouped-query attention: one kv head per group of query heads
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return _TorchFlashVarlen.apply(q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, max_q, max_k,
                                       scaling if scaling is not None else q.shape[-1] ** -0.5)
    if cu_k is cu_q:
        return _padded_sdpa(q, k, v, cu_q, max_q, scaling)
    return _padded_sdpa_end_aligned(q, k, v, cu_q, cu_k, max_q, max_k, scaling)


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


@cache
def _flash_attn_installed() -> bool:
    """Whether flash-attn 2's varlen kernel can be imported: another package may own the ``flash_attn`` name
    without it (flash-attn 4, which SGLang brings, installs only ``flash_attn.cute``)."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: F401
    except ImportError:
        return False
    return True


@cache
def _torch_flash_available(device: torch.device) -> bool:
    return (torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(device)[0] >= 8)


class _TorchFlashVarlen(torch.autograd.Function):
    """Causal varlen attention through PyTorch's flash-attention ops (forward and backward kernels); q/k/v
    ``(T, H, D)`` contiguous, equal head counts; query and key segments may differ in length (flash-attention
    aligns the causal mask at their ends)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                max_q: int, max_k: int, scale: float) -> torch.Tensor:
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed, offset)
        ctx.max_q, ctx.max_k, ctx.scale = max_q, max_k, scale
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse, cu_q, cu_k, seed, offset = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad_out.contiguous(), q, k, v, out, lse, cu_q, cu_k, ctx.max_q, ctx.max_k, 0.0, True,
            seed, offset, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None, None


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
    source, target = _padded_slots(cu_seqlens, max_len, total)

    def padded(t: torch.Tensor) -> torch.Tensor:
        t = torch.cat([t, t.new_zeros(1, *t.shape[1:])])
        return t.index_select(0, source).view(rows, max_len, *t.shape[1:]).transpose(1, 2)

    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), is_causal=max_len > 1, scale=scaling,
                                         enable_gqa=gqa)
    return out.transpose(1, 2).reshape(rows * max_len, *q.shape[1:]).index_select(0, target)


def _padded_sdpa_end_aligned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                             cu_k: torch.Tensor, max_q: int, max_k: int, scaling: float | None) -> torch.Tensor:
    """``_padded_sdpa`` for key segments longer than their queries: query ``t`` of a segment with ``q_len``
    queries and ``k_len`` keys sees keys ``0 .. k_len - q_len + t`` (an explicit mask; a padding query sees
    every real key, so no softmax row is empty). ``(Tq, H, D)`` out."""
    rows = cu_q.shape[0] - 1
    q_len, k_len = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
    q_slots, q_target = _padded_slots(cu_q, max_q, q.shape[0])
    k_slots, _ = _padded_slots(cu_k, max_k, k.shape[0])

    def padded(t: torch.Tensor, slots: torch.Tensor, width: int) -> torch.Tensor:
        t = torch.cat([t, t.new_zeros(1, *t.shape[1:])])  # slot index len(t) reads this zero row
        return t.index_select(0, slots).view(rows, width, *t.shape[1:]).transpose(1, 2)

    query = torch.arange(max_q, device=q.device)
    key = torch.arange(max_k, device=q.device)
    mask = ((key[None, None, :] < k_len[:, None, None])
            & (key[None, None, :] - query[None, :, None] <= (k_len - q_len)[:, None, None]))
    out = F.scaled_dot_product_attention(padded(q, q_slots, max_q), padded(k, k_slots, max_k),
                                         padded(v, k_slots, max_k), attn_mask=mask[:, None], scale=scaling,
                                         enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2).reshape(rows * max_q, *q.shape[1:]).index_select(0, q_target)


def _padded_slots(cu: torch.Tensor, width: int, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For segments ``cu`` laid out ``(rows, width)``: the token in each slot (``total``, a zero row appended
    after the tokens, where a slot is padding), and each token's slot."""
    starts = cu[:-1].long()
    source = starts[:, None] + torch.arange(width, device=cu.device)[None, :]
    source = torch.where(source < cu[1:].long()[:, None], source, total).flatten()
    token = torch.arange(total, device=cu.device)
    row = torch.searchsorted(cu[1:].to(token.dtype), token, right=True)
    return source, row * width + token - starts[row]
