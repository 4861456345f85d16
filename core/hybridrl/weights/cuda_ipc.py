"""Weights between two processes on the same GPU, through CUDA IPC (engine-free).

Pools that share devices (``pools.<name>.share``: the trainer and the rollout resident at once) cannot use NCCL
(it refuses two ranks on one device) and should not go through host memory. The sender keeps one device buffer,
packs each bucket into it (``pack_bucket``, in the wire dtype) and offers it: the buffer's IPC handle, opened once
by each receiver and kept, plus the bucket's layout. The receiver imports views of the mapped buffer; it
synchronises before answering, so the sender may pack the next bucket into the same memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.weights.buckets import BucketSpec, describe_bucket, pack_bucket, unpack_bucket


@dataclass(frozen=True)
class IpcOffer:
    """One bucket in the sender's buffer: ``owner`` (the sender's pid) and ``generation`` name the buffer (a new
    one when a bucket outgrew the last), ``handle`` how to map it (``torch.multiprocessing``'s reduction of a
    CUDA tensor), ``spec`` where each tensor lies in it."""

    owner: int
    generation: int
    handle: tuple[Any, tuple[Any, ...]]
    spec: BucketSpec

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes


class IpcSender:
    """The sending side: one buffer, grown (never shrunk) to the largest bucket so far."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.generation = 0
        self._handle: tuple[Any, tuple[Any, ...]] | None = None

    def offer(self, bucket: list[tuple[str, torch.Tensor]], wire_dtype: torch.dtype | None) -> IpcOffer:
        from torch.multiprocessing.reductions import reduce_tensor

        spec = describe_bucket(bucket, wire_dtype)
        if self.buffer is None or self.buffer.numel() < spec.nbytes:
            self.buffer = None  # the old one goes before the new one is made
            self.buffer = torch.empty(spec.nbytes, dtype=torch.uint8, device=torch.cuda.current_device())
            self.generation += 1
            self._handle = reduce_tensor(self.buffer)
        pack_bucket(bucket, spec, self.buffer.device, out=self.buffer)
        torch.cuda.synchronize()  # another process reads it next, outside this process's streams
        assert self._handle is not None
        return IpcOffer(os.getpid(), self.generation, self._handle, spec)


class IpcReceiver:
    """The receiving side: the sender's buffer, mapped once per generation."""

    def __init__(self) -> None:
        self._key: tuple[int, int] | None = None
        self._buffer: torch.Tensor | None = None

    def open(self, offer: IpcOffer) -> list[tuple[str, torch.Tensor]]:
        """The bucket as views of the mapped buffer: valid until the sender packs its next bucket (import them,
        then ``done``)."""
        key = (offer.owner, offer.generation)
        if key != self._key:
            self._buffer = None  # unmap the old one first
            rebuild, args = offer.handle
            self._buffer, self._key = rebuild(*args), key
        assert self._buffer is not None
        return unpack_bucket(self._buffer[: offer.nbytes], offer.spec)

    @staticmethod
    def done() -> None:
        """The import's copies are on this process's streams: finish them before the sender reuses the buffer."""
        torch.cuda.synchronize()
