"""A stand-alone collective group for weight transfer between pools.

Each worker process already has a default process group spanning its own pool; the trainer's exporting
rank and the rollout ranks live in different pools, so the bridge opens a separate group over a TCPStore
(gloo on CPU, NCCL on GPU) without touching the default one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

from hybridrl.runtime.distributed import COLLECTIVE_TIMEOUT_S, tcp_store
from hybridrl.weights.buckets import BucketSpec, describe_bucket, pack_bucket, unpack_bucket


class WeightChannel:
    """Rank 0 sends, every other rank receives; at most ``max_in_flight`` buckets are outstanding."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, device: str,
                 timeout_s: float = COLLECTIVE_TIMEOUT_S, max_in_flight: int = 2) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.max_in_flight = max_in_flight
        timeout = timedelta(seconds=timeout_s)
        store = tcp_store(host, port, world_size, rank == 0, timeout_s)
        prefixed = dist.PrefixStore("hybridrl-weights", store)
        self._store = store  # keep the server alive as long as the group
        if device == "cuda":  # a timeout, so that a dead peer ends the broadcast with an error, not a hang
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
            self.buffer_device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
            self.buffer_device = torch.device("cpu")

    def _broadcast(self, tensor: torch.Tensor):
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.group.broadcast([tensor], opts)

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], specs: list[BucketSpec]) -> int:
        """Broadcast each bucket as one flat buffer; returns the bytes sent."""
        pending: deque = deque()
        sent = 0
        for bucket, spec in zip(buckets, specs, strict=True):
            while len(pending) >= self.max_in_flight:
                pending.popleft()[0].wait()
            buffer = pack_bucket(bucket, spec, self.buffer_device)
            pending.append((self._broadcast(buffer), buffer))
            sent += spec.nbytes
        while pending:
            pending.popleft()[0].wait()
        return sent

    def receive(self, specs: list[BucketSpec], consume: Callable[[list[tuple[str, torch.Tensor]]], None]) -> int:
        """Receive every bucket and hand it to ``consume`` (the engine's import) as views of the buffer."""
        pending: deque = deque()
        received = 0
        for spec in specs:
            buffer = torch.empty(spec.nbytes, dtype=torch.uint8, device=self.buffer_device)
            pending.append((self._broadcast(buffer), buffer, spec))
            if len(pending) >= self.max_in_flight:
                received += self._consume_oldest(pending, consume)
        while pending:
            received += self._consume_oldest(pending, consume)
        return received

    @staticmethod
    def _consume_oldest(pending: deque, consume: Callable) -> int:
        work, buffer, spec = pending.popleft()
        work.wait()
        consume(unpack_bucket(buffer, spec))
        return spec.nbytes

    def close(self) -> None:
        self.group = None  # type: ignore[assignment]
        self._store = None  # type: ignore[assignment]


def bucket_specs(buckets: Iterable[list[tuple[str, torch.Tensor]]], wire_dtype: torch.dtype | None = None
                 ) -> list[BucketSpec]:
    return [describe_bucket(b, wire_dtype) for b in buckets]
