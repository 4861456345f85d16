"""One kernel for all of a bucket's copies (casting), over the whole device.

``torch._foreach_copy_`` cuts the tensors into 64K-value chunks and launches at most 320 of them per kernel:
for a 0.5B model's buckets that is ~25 kernels, each too small to fill an H200 (132 SMs) for long, with a
tail between them; one flat cast copy of the same values is ~10% faster. Here a Triton kernel is given, per
tensor, where its source and destination start (in elements from a base tensor of the same dtype, so the
device's 16-byte vector loads still apply) and a table of which tensor each program block copies: every
block of every tensor runs in one grid. The tables are built once for fixed addresses (what a recorded CUDA
graph replays), so the launch is one call per (source dtype, destination dtype) group.

The planning (``plan_blocks``) is plain Python on addresses and sizes, testable anywhere; the kernel needs
Triton and a CUDA device (``available``).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import torch

#: Values one program copies (a power of two; the last block of a tensor is masked).
BLOCK = 4096
#: Bytes of the widest vector load the kernel may be told its addresses allow.
VECTOR_BYTES = 16
#: Dtypes the kernel reads and writes (the cast between any two of them is Triton's round-to-nearest-even,
#: what ``Tensor.copy_`` does).
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class BlockPlan:
    """One launch: tensor ``i`` starts ``src_offsets[i]`` / ``dst_offsets[i]`` elements from the base
    tensors and holds ``numels[i]`` values; program ``p`` copies block ``p - first_block[block_tensor[p]]``
    of tensor ``block_tensor[p]``. ``src_align`` / ``dst_align``: the largest count of elements (a power of
    two, at most a vector's worth) that divides every offset."""

    src_offsets: tuple[int, ...]
    dst_offsets: tuple[int, ...]
    numels: tuple[int, ...]
    first_block: tuple[int, ...]
    block_tensor: tuple[int, ...]
    src_align: int
    dst_align: int


def _align(offsets: Sequence[int], element_size: int) -> int:
    """Largest power-of-two element count, up to ``VECTOR_BYTES`` worth, dividing every offset."""
    align = max(VECTOR_BYTES // element_size, 1)
    while align > 1 and any(off % align for off in offsets):
        align //= 2
    return align


def plan_blocks(src_ptrs: Sequence[int], dst_ptrs: Sequence[int], numels: Sequence[int], src_size: int,
                dst_size: int, block: int = BLOCK, src_base: int | None = None,
                dst_base: int | None = None) -> BlockPlan:
    """The tables of one launch for tensors at byte addresses ``src_ptrs`` / ``dst_ptrs`` (element sizes
    ``src_size`` / ``dst_size``) of ``numels`` values each, in elements from the addresses ``src_base`` /
    ``dst_base`` (default: the first pair's). Empty tensors get no block. Raises ``ValueError`` for an address
    that is not a whole number of elements from its base (the kernel can only step in elements)."""
    if not (len(src_ptrs) == len(dst_ptrs) == len(numels)) or not numels:
        raise ValueError("plan_blocks needs one source address, destination address and size per tensor")
    src_offsets, dst_offsets = [], []
    for ptrs, size, base, out in ((src_ptrs, src_size, src_base, src_offsets),
                                  (dst_ptrs, dst_size, dst_base, dst_offsets)):
        base = ptrs[0] if base is None else base
        for ptr in ptrs:
            delta = ptr - base
            if delta % size:
                raise ValueError(f"address {ptr:#x} is not a whole number of {size}-byte elements from {base:#x}")
            out.append(delta // size)
    first_block, block_tensor = [], []
    for i, numel in enumerate(numels):
        first_block.append(len(block_tensor))
        block_tensor.extend([i] * math.ceil(numel / block))
    return BlockPlan(tuple(src_offsets), tuple(dst_offsets), tuple(numels), tuple(first_block),
                     tuple(block_tensor), _align(src_offsets, src_size), _align(dst_offsets, dst_size))


def available() -> bool:
    """Whether the kernel can run here: Triton importable and a CUDA device present."""
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def supports(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> bool:
    """Whether the kernel can run here (``available``) and every pair can go through it (``fits``), on CUDA."""
    return bool(dsts) and dsts[0].is_cuda and available() and fits(dsts, srcs)


def fits(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> bool:
    """Whether every pair can go through the kernel: all on one device, contiguous, the same number of values,
    a dtype of ``DTYPES`` on both sides."""
    if not dsts or len(dsts) != len(srcs):
        return False
    device = dsts[0].device
    return all(d.device == device and s.device == device and d.is_contiguous() and s.is_contiguous()
               and d.numel() == s.numel() and d.dtype in DTYPES and s.dtype in DTYPES for d, s in zip(dsts, srcs))


class FusedCopy:
    """``dst.copy_(src)`` for fixed pairs, one kernel per (source dtype, destination dtype) group. Holds its
    tables on the device for as long as it lives (keep it with any graph that recorded a call), but no
    reference to the pairs: the offsets count from one-value tensors of its own, so an importer keeping it
    never keeps an exporter's tensors alive."""

    def __init__(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], block: int = BLOCK) -> None:
        if not fits(dsts, srcs):
            raise ValueError("FusedCopy needs pairs of contiguous float32/bfloat16/float16 tensors of equal size "
                             "on one device")
        groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
        for i, (d, s) in enumerate(zip(dsts, srcs)):
            if d.numel():
                groups.setdefault((s.dtype, d.dtype), []).append(i)
        self.block = block
        self.warps = max(1, min(16, block // 1024))  # 32 values a thread at the default block
        self._launches: list[tuple[Any, ...]] = []
        device = dsts[0].device
        for (src_dtype, dst_dtype), members in groups.items():
            ds, ss = [dsts[i] for i in members], [srcs[i] for i in members]
            # the bases: allocations of their own, so aligned for the widest vector
            src_base = torch.empty(1, dtype=src_dtype, device=device)
            dst_base = torch.empty(1, dtype=dst_dtype, device=device)
            plan = plan_blocks([s.data_ptr() for s in ss], [d.data_ptr() for d in ds], [d.numel() for d in ds],
                               ss[0].element_size(), ds[0].element_size(), block,
                               src_base.data_ptr(), dst_base.data_ptr())
            as_tensor = lambda xs, dtype: torch.tensor(xs, dtype=dtype, device=device)  # noqa: E731
            self._launches.append((src_base, dst_base, as_tensor(plan.src_offsets, torch.int64),
                                   as_tensor(plan.dst_offsets, torch.int64), as_tensor(plan.numels, torch.int64),
                                   as_tensor(plan.first_block, torch.int32), as_tensor(plan.block_tensor, torch.int32),
                                   len(plan.block_tensor), plan.src_align, plan.dst_align))

    @property
    def launches(self) -> int:
        """Kernels one call launches."""
        return len(self._launches)

    def __call__(self) -> None:
        kernel = _kernel()
        for src, dst, src_off, dst_off, numels, first, which, blocks, src_align, dst_align in self._launches:
            kernel[(blocks,)](src, dst, src_off, dst_off, numels, first, which, BLOCK=self.block,
                              SRC_ALIGN=src_align, DST_ALIGN=dst_align, num_warps=self.warps)


@lru_cache(maxsize=None)
def _kernel() -> Any:
    """The Triton kernel, defined on first use (Triton is imported only where the kernel runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_cast_copy(src_base, dst_base, src_offsets, dst_offsets, numels, first_block, block_tensor,
                          BLOCK: tl.constexpr, SRC_ALIGN: tl.constexpr, DST_ALIGN: tl.constexpr):
        pid = tl.program_id(0)
        t = tl.load(block_tensor + pid)
        start = (pid - tl.load(first_block + t)).to(tl.int64) * BLOCK
        n = tl.load(numels + t)
        src = src_base + tl.multiple_of(tl.load(src_offsets + t), SRC_ALIGN)
        dst = dst_base + tl.multiple_of(tl.load(dst_offsets + t), DST_ALIGN)
        idx = start + tl.arange(0, BLOCK)
        # a narrowing cast rounds to nearest, ties to even (Triton's default), as ``Tensor.copy_`` does
        if start + BLOCK <= n:  # a whole block: unmasked, so the loads and stores can be vectors
            tl.store(dst + idx, tl.load(src + idx).to(dst_base.dtype.element_ty))
        else:
            mask = idx < n
            tl.store(dst + idx, tl.load(src + idx, mask=mask).to(dst_base.dtype.element_ty), mask=mask)

    return grouped_cast_copy
