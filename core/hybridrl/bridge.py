"""Reshard bridges: move the actor's weights into the rollout engine after every update.

The general path is a stream of buckets of HF-named tensors: the trainer exports, the engine imports. The
transport follows from placement: ``in_process`` when both roles live in one process, ``object_store``
(Ray's object store, driven from the driver) when they live in different processes. A plugin may register a
faster bridge for a specific backend pair through ``registry.add_bridge``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

from hybridrl import hookimpl

if TYPE_CHECKING:
    from hybridrl.controller import WorkerGroup
    from hybridrl.engines import RolloutEngine, TrainEngine


def sync_in_process(trainer: "TrainEngine", rollout: "RolloutEngine", bucket_bytes: int) -> dict[str, float]:
    """Stream buckets from ``trainer.export_weights`` into ``rollout.import_weights`` (one bucket in memory
    at a time beyond the two models)."""
    start = time.perf_counter()
    nbytes, buckets = 0, 0
    for bucket in trainer.export_weights(bucket_bytes):
        rollout.import_weights(bucket)
        nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        buckets += 1
    rollout.finish_weight_import()
    return {"bytes": float(nbytes), "buckets": float(buckets), "seconds": time.perf_counter() - start}


class Bridge(Protocol):
    def sync(self, trainer: "WorkerGroup", trainer_role: str, rollout: "WorkerGroup", rollout_role: str,
             bucket_bytes: int) -> dict[str, float]: ...


class InProcessBridge:
    """Both roles in the same worker processes: each worker moves its own weights."""

    def sync(self, trainer: "WorkerGroup", trainer_role: str, rollout: "WorkerGroup", rollout_role: str,
             bucket_bytes: int) -> dict[str, float]:
        stats = trainer.call_all("sync_in_process", trainer_role, rollout_role, bucket_bytes)
        return {"bytes": stats[0]["bytes"], "buckets": stats[0]["buckets"]}


class ObjectStoreBridge:
    """Roles in different processes: the exporting trainer rank's buckets go through Ray's object store
    to every rollout rank. The general fallback; a collective broadcast is faster on real networks."""

    def sync(self, trainer: "WorkerGroup", trainer_role: str, rollout: "WorkerGroup", rollout_role: str,
             bucket_bytes: int) -> dict[str, float]:
        import ray

        exported = [b for b in trainer.call_all("export_buckets", trainer_role, bucket_bytes) if b is not None]
        buckets = exported[0]
        ref = ray.put(buckets)
        rollout.call_all("import_buckets", rollout_role, ref)
        nbytes = sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)
        return {"bytes": float(nbytes), "buckets": float(len(buckets))}


def transport_for(same_process: bool) -> str:
    return "in_process" if same_process else "object_store"


@hookimpl
def hybridrl_register_backends(registry: Any) -> None:
    registry.add_bridge("*", "*", "in_process", InProcessBridge)
    registry.add_bridge("*", "*", "object_store", ObjectStoreBridge)
