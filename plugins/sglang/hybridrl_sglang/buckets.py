"""A bucket of named tensors as one flat byte buffer plus metadata, SGLang's ``flattened_bucket`` format
(engine-free).

``update_weights_from_tensor(load_format="flattened_bucket")`` sends one CUDA-IPC handle per bucket instead of
one per tensor (opening IPC handles is what costs); the scheduler rebuilds each tensor as
``flat[start:end].view(dtype).reshape(shape)``. Two ways to get the flat buffer:

* *shared*: every tensor of the bucket is a contiguous view into one storage (the broadcast bridge's receive
  buffer, or a trainer's flat parameter buffer): the storage itself is sent, zero copies;
* *packed*: otherwise the tensors are copied into a new buffer, floating-point ones cast to the engine's dtype
  (half the bytes of a float32 master copy), each start aligned so any dtype view of it is legal.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ALIGN = 64


@dataclass(frozen=True)
class FlatEntry:
    """Where one tensor lives in the flat uint8 buffer (SGLang's ``FlattenedTensorMetadata`` fields)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    start: int
    end: int

    @property
    def numel(self) -> int:
        """SGLang's ``numel`` field: the byte count of the slice (it flattens to uint8)."""
        return self.end - self.start


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def target_dtype(tensor: torch.Tensor, engine_dtype: torch.dtype | None) -> torch.dtype:
    """Floating-point tensors travel in the engine's dtype; integer and bool tensors keep theirs."""
    if engine_dtype is not None and tensor.is_floating_point():
        return engine_dtype
    return tensor.dtype


def plan_packed(bucket: Sequence[tuple[str, torch.Tensor]], engine_dtype: torch.dtype | None
                ) -> tuple[list[FlatEntry], int]:
    """Layout of a packed buffer: ``(entries, total bytes)``, each start a multiple of ``ALIGN``."""
    entries, offset = [], 0
    for name, tensor in bucket:
        dtype = target_dtype(tensor, engine_dtype)
        nbytes = tensor.numel() * torch.empty((), dtype=dtype).element_size()
        entries.append(FlatEntry(name, tuple(tensor.shape), dtype, offset, offset + nbytes))
        offset = _aligned(offset + nbytes)
    return entries, offset


def pack(bucket: Sequence[tuple[str, torch.Tensor]], engine_dtype: torch.dtype | None,
         device: torch.device | str) -> tuple[torch.Tensor, list[FlatEntry]]:
    """Copy (and cast) the bucket into one new uint8 buffer on ``device``."""
    entries, total = plan_packed(bucket, engine_dtype)
    flat = torch.empty(max(total, 1), dtype=torch.uint8, device=device)
    for (_name, tensor), entry in zip(bucket, entries):
        view = flat[entry.start:entry.end].view(entry.dtype).view(entry.shape)
        view.copy_(tensor.detach(), non_blocking=True)
    return flat, entries


def shared_storage(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[FlatEntry]] | None:
    """``(uint8 view of the whole storage, entries)`` when every tensor is a contiguous view into the same
    storage, so the storage can be sent as it is; else ``None``."""
    if not bucket:
        return None
    storage = bucket[0][1].untyped_storage()
    entries = []
    for name, tensor in bucket:
        if not tensor.is_contiguous() or tensor.untyped_storage().data_ptr() != storage.data_ptr():
            return None
        if tensor.untyped_storage().nbytes() != storage.nbytes():
            return None
        start = tensor.storage_offset() * tensor.element_size()
        entries.append(FlatEntry(name, tuple(tensor.shape), tensor.dtype, start,
                                 start + tensor.numel() * tensor.element_size()))
    flat = torch.empty(0, dtype=torch.uint8, device=bucket[0][1].device).set_(storage)
    return flat, entries


def flatten(bucket: Sequence[tuple[str, torch.Tensor]], engine_dtype: torch.dtype | None,
            device: torch.device | str) -> tuple[torch.Tensor, list[FlatEntry], bool]:
    """``(flat buffer on device, entries, shared)``: the shared storage when possible, else a packed copy."""
    dev = torch.device(device)
    found = shared_storage(bucket)
    if found is not None and found[0].device == dev:
        return found[0], found[1], True
    flat, entries = pack(bucket, engine_dtype, dev)
    return flat, entries, False


def rebuild(flat: torch.Tensor, entries: Sequence[FlatEntry]) -> list[tuple[str, torch.Tensor]]:
    """What SGLang's ``FlattenedTensorBucket.reconstruct_tensors`` does with the buffer (for checks)."""
    return [(e.name, flat[e.start:e.end].view(e.dtype).reshape(e.shape)) for e in entries]
