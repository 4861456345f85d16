"""Packing buckets of named tensors into one flat byte buffer and back (engine-free, used by the
broadcast bridge): one collective per bucket instead of one per tensor, and the receiver needs only a
bucket-sized buffer, never a second copy of the model."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

ALIGN = 64  # bytes; any dtype view of an aligned slice is legal


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass(frozen=True)
class BucketSpec:
    tensors: tuple[TensorSpec, ...]
    nbytes: int


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def describe_bucket(bucket: list[tuple[str, torch.Tensor]], wire_dtype: torch.dtype | None = None) -> BucketSpec:
    """The bucket's layout in one flat buffer. ``wire_dtype``: floating tensors travel in that dtype (e.g. the
    rollout's bf16 instead of the trainer's fp32 master weights: half the bytes, cast while packing)."""
    specs, offset = [], 0
    for name, tensor in bucket:
        dtype = wire_dtype if wire_dtype is not None and tensor.is_floating_point() else tensor.dtype
        nbytes = tensor.numel() * torch.empty((), dtype=dtype).element_size()
        specs.append(TensorSpec(name, tuple(tensor.shape), str(dtype).removeprefix("torch."), offset, nbytes))
        offset = _aligned(offset + nbytes)
    return BucketSpec(tuple(specs), offset)


def pack_bucket(bucket: list[tuple[str, torch.Tensor]], spec: BucketSpec, device: str | torch.device,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """One uint8 buffer holding every tensor of the bucket at its spec offset (cast to the spec's dtype where it
    differs: the copy into the buffer does the cast, no extra tensor is made). ``out``: a uint8 buffer of at
    least ``spec.nbytes`` to pack into (its first ``spec.nbytes`` are returned) instead of a new one."""
    buffer = torch.empty(spec.nbytes, dtype=torch.uint8, device=device) if out is None else out[: spec.nbytes]
    for (name, tensor), ts in zip(bucket, spec.tensors):
        if name != ts.name:
            raise ValueError(f"bucket order changed: got '{name}', expected '{ts.name}'")
        target = buffer[ts.offset: ts.offset + ts.nbytes]
        if tensor.dtype == ts.torch_dtype:
            target.copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
        else:
            target.view(ts.torch_dtype).view(ts.shape).copy_(tensor.detach(), non_blocking=True)
    return buffer


def unpack_bucket(buffer: torch.Tensor, spec: BucketSpec) -> list[tuple[str, torch.Tensor]]:
    """Views into ``buffer`` (no copy), shaped and typed as the spec says."""
    out = []
    for ts in spec.tensors:
        view = buffer[ts.offset: ts.offset + ts.nbytes].view(ts.torch_dtype).view(ts.shape)
        out.append((ts.name, view))
    return out


def group_into_buckets(items: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int
                       ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The train engines' export rule: a bucket closes once it holds ``bucket_bytes``, and a tensor of at least
    ``bucket_bytes`` travels alone. Lazy: a tensor is asked for only when its bucket is being filled."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    return _group(items, bucket_bytes)


def _group(items: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    filled = 0
    for name, tensor in items:
        nbytes = tensor.nbytes
        if nbytes >= bucket_bytes and bucket:
            yield bucket
            bucket, filled = [], 0
        bucket.append((name, tensor))
        filled += nbytes
        if filled >= bucket_bytes:
            yield bucket
            bucket, filled = [], 0
    if bucket:
        yield bucket
