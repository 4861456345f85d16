"""Packing buckets of named tensors into one flat byte buffer and back (engine-free, used by the
broadcast bridge): one collective per bucket instead of one per tensor, and the receiver needs only a
bucket-sized buffer, never a second copy of the model."""

from __future__ import annotations

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


def describe_bucket(bucket: list[tuple[str, torch.Tensor]]) -> BucketSpec:
    specs, offset = [], 0
    for name, tensor in bucket:
        nbytes = tensor.numel() * tensor.element_size()
        specs.append(TensorSpec(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."), offset, nbytes))
        offset = _aligned(offset + nbytes)
    return BucketSpec(tuple(specs), offset)


def pack_bucket(bucket: list[tuple[str, torch.Tensor]], spec: BucketSpec, device: str | torch.device) -> torch.Tensor:
    """One uint8 buffer holding every tensor of the bucket at its spec offset."""
    buffer = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
    for (name, tensor), ts in zip(bucket, spec.tensors):
        if name != ts.name:
            raise ValueError(f"bucket order changed: got '{name}', expected '{ts.name}'")
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[ts.offset: ts.offset + ts.nbytes].copy_(flat, non_blocking=True)
    return buffer


def unpack_bucket(buffer: torch.Tensor, spec: BucketSpec) -> list[tuple[str, torch.Tensor]]:
    """Views into ``buffer`` (no copy), shaped and typed as the spec says."""
    out = []
    for ts in spec.tensors:
        view = buffer[ts.offset: ts.offset + ts.nbytes].view(ts.torch_dtype).view(ts.shape)
        out.append((ts.name, view))
    return out
