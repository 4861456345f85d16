"""Split mode through SGLang's own weight-update group (opt-in: ``roles.rollout.options.weight_sync=distributed``).

The default split path is the core's ``BroadcastBridge``: the rollout worker receives each bucket into a buffer
on its GPU (``hybridrl.weights.channel.WeightChannel``) and ``SGLangRollout.import_weights`` hands that buffer to the
schedulers by CUDA IPC, zero copy. This module is the alternative where the schedulers themselves join the
group (``init_weights_update_group``) and receive each bucket with ``update_weights_from_distributed(load_format=
"flattened_bucket")``: no receive buffer or CUDA context in the worker process, and tensor-parallel ranks each
receive their copy directly.

The trainer side needs no SGLang: ``open_group`` makes the same group SGLang's ``init_custom_process_group``
makes (TCP rendezvous, ``PrefixStore(group_name)``), and ``pack_flat`` lays a bucket out as SGLang's
``FlattenedTensorBucket`` does (the tensors' bytes concatenated, no padding), in the order of ``receive_layout``,
which sorts each bucket by element size so that every tensor starts aligned for its dtype. It runs in the
trainer's worker through Ray's ``__ray_call__`` (the worker has no method for it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from hybridrl.weights.bridges import BroadcastBridge

if TYPE_CHECKING:
    from hybridrl.runtime.group import WorkerGroup

GROUP_NAME = "hybridrl-sglang-weights"
#: per bucket: ``(name, dtype name, shape)`` in the order of the flat buffer.
Layout = list[list[tuple[str, str, list[int]]]]


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _element_size(dtype_name: str) -> int:
    return torch.empty((), dtype=_dtype(dtype_name)).element_size()


def receive_layout(specs: Sequence[Any], engine_dtype: str) -> Layout:
    """The flat layout of every bucket of the trainer's manifest (``hybridrl.weights.buckets.BucketSpec``s):
    floating-point tensors travel in the engine's dtype; within a bucket, larger elements first (stable), so
    each tensor's byte offset is a multiple of its element size in a padding-free concatenation."""
    layout: Layout = []
    for spec in specs:
        entries = []
        for ts in spec.tensors:
            dtype = engine_dtype if _dtype(ts.dtype).is_floating_point else ts.dtype
            entries.append((ts.name, dtype, list(ts.shape)))
        entries.sort(key=lambda e: -_element_size(e[1]))
        layout.append(entries)
    return layout


def flat_nbytes(entries: Sequence[tuple[str, str, list[int]]]) -> int:
    total = 0
    for _, dtype, shape in entries:
        n = 1
        for d in shape:
            n *= int(d)
        total += n * _element_size(dtype)
    return total


def pack_flat(bucket: Iterable[tuple[str, torch.Tensor]], entries: Sequence[tuple[str, str, list[int]]],
              device: torch.device | str) -> torch.Tensor:
    """One uint8 buffer with the bucket's tensors (cast as ``entries`` say) back to back, in ``entries`` order."""
    tensors = dict(bucket)
    if set(tensors) != {e[0] for e in entries}:
        raise ValueError(f"bucket holds {sorted(tensors)}, the layout {sorted(e[0] for e in entries)}")
    flat = torch.empty(max(flat_nbytes(entries), 1), dtype=torch.uint8, device=device)
    offset = 0
    for name, dtype, shape in entries:
        tensor = tensors[name]
        if list(tensor.shape) != list(shape):
            raise ValueError(f"'{name}': shape {list(tensor.shape)}, layout {shape}")
        nbytes = tensor.numel() * _element_size(dtype)
        flat[offset:offset + nbytes].view(_dtype(dtype)).view(tensor.shape).copy_(tensor.detach(), non_blocking=True)
        offset += nbytes
    return flat


def open_group(host: str, port: int, rank: int, world_size: int, group_name: str, backend: str,
               timeout_s: float = 600.0) -> Any:
    """The process group SGLang's ``init_custom_process_group`` makes, joined from outside SGLang (a group next
    to the default one, made from a TCP rendezvous at ``host:port``; rank 0 hosts the store)."""
    import torch.distributed.distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{host}:{port}", rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    from packaging.version import Version

    options_key = "backend_options" if Version(torch.__version__).release[:2] >= (2, 6) else "pg_options"
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store, group_name=group_name,
                                           timeout=timeout, **{options_key: None})
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def broadcast_buckets(pg: Any, buckets: Iterable[list[tuple[str, torch.Tensor]]], layout: Layout,
                      device: torch.device | str, max_in_flight: int = 2) -> int:
    """Send every bucket from rank 0 of ``pg``; at most ``max_in_flight`` buffers alive. Returns bytes sent."""
    import torch.distributed as dist

    pending: list[tuple[Any, torch.Tensor]] = []
    sent = 0
    for bucket, entries in zip(buckets, layout, strict=True):
        while len(pending) >= max_in_flight:
            work, _ = pending.pop(0)
            work.wait()
        flat = pack_flat(bucket, entries, device)
        pending.append((dist.broadcast(flat, src=0, group=pg, async_op=True), flat))
        sent += flat_nbytes(entries)
    for work, _ in pending:
        work.wait()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return sent


# --- run inside the trainer's RoleWorker (``actor.__ray_call__``) ----------------------------------------------
def _sender_open(worker: Any, host: str, port: int, world_size: int, group_name: str) -> None:
    backend = "nccl" if worker.device == "cuda" else "gloo"
    worker._sglang_weight_group = open_group(host, port, 0, world_size, group_name, backend)


def _sender_send(worker: Any, trainer_role: str, bucket_bytes: int, layout: Layout) -> float:
    engine = worker.engines[trainer_role]
    buckets = engine.export_weights(bucket_bytes)
    if not engine.exports_on_rank():
        for _ in buckets:  # the export is collective over the trainer's ranks
            pass
        return 0.0
    device = torch.device("cuda", torch.cuda.current_device()) if worker.device == "cuda" else torch.device("cpu")
    return float(broadcast_buckets(worker._sglang_weight_group, buckets, layout, device))


class SGLangBroadcastBridge:
    """Split pools with an SGLang rollout. ``weight_sync=channel`` (default): the core's ``BroadcastBridge``
    unchanged; ``weight_sync=distributed``: SGLang's schedulers join the group and receive directly."""

    def __init__(self) -> None:
        self.fallback = BroadcastBridge()
        self.mode: str | None = None
        self.layout: Layout | None = None

    def _open(self, trainer: WorkerGroup, trainer_role: str, rollout: WorkerGroup, rollout_role: str,
              bucket_bytes: int) -> None:
        import ray

        manifests = trainer.call_all("weight_manifest", trainer_role, bucket_bytes)
        specs = next(m for m in manifests if m is not None)
        self.layout = rollout.broadcast(rollout_role, "distributed_layout", specs).value[0]
        sender = trainer.workers[trainer.call_all("exports", trainer_role).index(True)]
        host, port = ray.get(sender.rendezvous_address.remote())
        tps = rollout.broadcast(rollout_role, "engine_ranks").value  # tensor-parallel size on leaders, else 0
        world, offsets, offset = 1, [], 1
        for n in tps:
            offsets.append(offset if n else None)
            offset += n
            world += n
        calls = [sender.__ray_call__.remote(_sender_open, host, port, world, GROUP_NAME)]
        calls += [w.call.remote(rollout_role, "open_update_group", host, port, off, world, GROUP_NAME)
                  for w, off in zip(rollout.workers, offsets) if off is not None]
        ray.get(calls)

    def sync(self, trainer: WorkerGroup, trainer_role: str, rollout: WorkerGroup, rollout_role: str,
             bucket_bytes: int) -> dict[str, float]:
        import ray

        if self.mode is None:
            self.mode = rollout.broadcast(rollout_role, "weight_sync_mode").value[0]
        if self.mode != "distributed":
            return self.fallback.sync(trainer, trainer_role, rollout, rollout_role, bucket_bytes)
        if self.layout is None:
            self._open(trainer, trainer_role, rollout, rollout_role, bucket_bytes)
        sends = [w.__ray_call__.remote(_sender_send, trainer_role, bucket_bytes, self.layout) for w in trainer.workers]
        receives = [w.call.remote(rollout_role, "receive_distributed", self.layout, GROUP_NAME)
                    for w in rollout.workers]
        sent = ray.get(sends)
        ray.get(receives)
        return {"bytes": max(sent), "buckets": float(len(self.layout or []))}
