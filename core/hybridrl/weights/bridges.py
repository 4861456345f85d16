"""Reshard bridges: move the actor's weights into the rollout engine after every update.

The general path is a stream of buckets of HF-named tensors: the trainer exports, the engine imports. The
transport follows from placement: ``in_process`` when both roles live in one process, ``broadcast`` (a
collective group between pools) when they live in different processes, ``object_store`` (Ray's object
store, driven from the driver) as the fallback. A plugin may register a
faster bridge for a specific backend pair through ``registry.add_bridge``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from operator import attrgetter, itemgetter
from typing import TYPE_CHECKING, Any

from hybridrl import hookimpl

if TYPE_CHECKING:
    from hybridrl.engines import RolloutEngine, TrainEngine, WeightBucket
    from hybridrl.placement.plan import PlacementPlan
    from hybridrl.runtime.group import WorkerGroup


#: Bucket size floor when no memory is at stake (views copied in place). Buckets then only pace the work:
#: each costs a fixed share of host work (import call, placing its tensors, a copy launch) that overlaps the
#: previous bucket's copies, so a few large ones beat many small ones, and one alone would start the copies
#: only after checking every tensor (figures: the README's vLLM section, ``benchmarks/vllm_rollout.py``'s
#: ``kv_only*`` variants).
VIEW_BUCKET_BYTES = 512 * 2**20


def sync_in_process(trainer: TrainEngine, rollout: RolloutEngine, bucket_bytes: int,
                    views_in_large_buckets: bool = True) -> dict[str, float]:
    """Stream buckets from ``trainer.export_weights`` into ``rollout.import_weights`` (one bucket in memory
    at a time beyond the two models). When the exporter hands views of its live weights and the importer
    copies them straight in, no memory is at stake and buckets are at least ``VIEW_BUCKET_BYTES``
    (``views_in_large_buckets=False`` keeps ``bucket_bytes`` regardless)."""
    start = time.perf_counter()
    if views_in_large_buckets and _views_in_place(trainer, rollout):
        bucket_bytes = max(bucket_bytes, VIEW_BUCKET_BYTES)
    nbytes, buckets = 0, 0
    for bucket in sync_buckets(trainer, bucket_bytes):  # imported before the next is made
        rollout.import_weights(bucket)
        nbytes += sum(map(_NBYTES, map(_TENSOR, bucket)))
        buckets += 1
    rollout.finish_weight_import()
    stats = {"bytes": float(nbytes), "buckets": float(buckets), "seconds": time.perf_counter() - start}
    stats.update({k: float(v) for k, v in rollout.import_stats().items()})
    return stats


_TENSOR, _NBYTES = itemgetter(1), attrgetter("nbytes")


def sync_buckets(trainer: TrainEngine, bucket_bytes: int, transient: bool = True) -> Iterator[WeightBucket]:
    """What a weight sync sends: a LoRA actor whose rollout serves adapters (``ctx.lora.sync == 'adapter'``) its
    adapters alone (``export_adapter``), any other trainer its full weights (``export_weights_transient`` for an
    importer that copies each bucket before the next is made, ``export_weights`` otherwise)."""
    lora = trainer.ctx.lora
    if lora is not None and lora.sends_adapters:
        return trainer.export_adapter(bucket_bytes)
    return trainer.export_weights_transient(bucket_bytes) if transient else trainer.export_weights(bucket_bytes)


def _views_in_place(trainer: TrainEngine, rollout: RolloutEngine) -> bool:
    """Both sides of the contract's defaults say no; an engine that hands views (or copies straight in) says
    so at the time of the sync (the vLLM importer only once its copy plan is learnt)."""
    return trainer.transient_export_holds_views() and rollout.imports_without_staging()


class InProcessBridge:
    """Both roles in the same worker processes: each worker moves its own weights."""

    def sync(self, trainer: WorkerGroup, trainer_role: str, rollout: WorkerGroup, rollout_role: str,
             bucket_bytes: int) -> dict[str, float]:
        stats = trainer.call_all("sync_in_process", trainer_role, rollout_role, bucket_bytes)
        return dict(stats[0])  # rank 0's figures (bytes, buckets, seconds and the engine's own import_stats)


class ObjectStoreBridge:
    """Roles in different processes: the exporting trainer rank's buckets go through Ray's object store
    to every rollout rank. The general fallback; a collective broadcast is faster on real networks."""

    def sync(self, trainer: WorkerGroup, trainer_role: str, rollout: WorkerGroup, rollout_role: str,
             bucket_bytes: int) -> dict[str, float]:
        import ray

        exported = [b for b in trainer.call_all("export_buckets", trainer_role, bucket_bytes) if b is not None]
        buckets = exported[0]
        ref = ray.put(buckets)
        rollout.call_all("import_buckets", rollout_role, ref)
        nbytes = sum(t.numel() * t.element_size() for bucket in buckets for _, t in bucket)
        return {"bytes": float(nbytes), "buckets": float(len(buckets))}


class BroadcastBridge:
    """Roles on different pools: a collective group joins the trainer's exporting rank (root) and every
    rollout rank; buckets are broadcast as flat buffers, at most two in flight, and imported from the
    receive buffer (no second copy of the model on the rollout side). Gloo on CPU, NCCL on GPU."""

    def __init__(self) -> None:
        self.specs: list | None = None

    def _open(self, trainer: WorkerGroup, trainer_role: str, rollout: WorkerGroup, bucket_bytes: int) -> None:
        from hybridrl.runtime.deadline import Waited, wait_all

        manifests = trainer.call_all("weight_manifest", trainer_role, bucket_bytes)
        self.specs = next(m for m in manifests if m is not None)
        exports = trainer.call_all("exports", trainer_role)
        rank = exports.index(True)
        sender = trainer.workers[rank]
        host, port = trainer.gather([sender.rendezvous_address.remote()], "rendezvous_address", [rank])[0]
        world = 1 + len(rollout.workers)
        wait_all([Waited(trainer, [sender.open_weight_channel.remote(host, port, 0, world)], "open_weight_channel",
                         [rank]),
                  Waited(rollout, [w.open_weight_channel.remote(host, port, 1 + i, world)
                                   for i, w in enumerate(rollout.workers)], "open_weight_channel")],
                 trainer.deadline)

    def sync(self, trainer: WorkerGroup, trainer_role: str, rollout: WorkerGroup, rollout_role: str,
             bucket_bytes: int) -> dict[str, float]:
        from hybridrl.runtime.deadline import Waited, wait_all

        if self.specs is None:
            self._open(trainer, trainer_role, rollout, bucket_bytes)
        sends = [w.send_weights.remote(trainer_role, bucket_bytes, self.specs) for w in trainer.workers]
        receives = [w.receive_weights.remote(rollout_role, self.specs) for w in rollout.workers]
        sent, _ = wait_all([Waited(trainer, sends, f"{trainer_role}.send_weights"),
                            Waited(rollout, receives, f"{rollout_role}.receive_weights")], trainer.deadline)
        return {"bytes": max(sent), "buckets": float(len(self.specs or []))}


class CudaIpcBridge:
    """Roles in separate processes on the same devices (fractional pools): every trainer rank packs its transient
    export, bucket by bucket, into a device buffer of its own, and the rollout ranks on its device import views of
    that buffer through a CUDA IPC handle (``hybridrl.weights.cuda_ipc``): no copy through the host, no NCCL."""

    def sync(self, trainer: WorkerGroup, trainer_role: str, rollout: WorkerGroup, rollout_role: str,
             bucket_bytes: int) -> dict[str, float]:
        from hybridrl.runtime.deadline import Waited, wait_all

        sender_of = _sender_on_device(trainer, rollout)
        nbytes, buckets = 0, 0
        trainer.call_all("ipc_export_begin", trainer_role, bucket_bytes)
        try:
            while True:
                offers = trainer.call_all("ipc_export_next")
                if all(offer is None for offer in offers):
                    break
                imports = [w.ipc_import.remote(rollout_role, offers[sender_of[i]])
                           for i, w in enumerate(rollout.workers)]
                wait_all([Waited(rollout, imports, f"{rollout_role}.ipc_import")], trainer.deadline)
                nbytes += max(offer.nbytes for offer in offers if offer is not None)
                buckets += 1
        finally:
            trainer.call_all("ipc_export_end")
        rollout.call_all("call", rollout_role, "finish_weight_import")
        return {"bytes": float(nbytes), "buckets": float(buckets)}


def _sender_on_device(trainer: WorkerGroup, rollout: WorkerGroup) -> list[int]:
    """For each rollout rank, the trainer rank on its device (CUDA IPC maps memory within one device only)."""
    rank_on = {device: rank for rank, device in enumerate(trainer.plan.devices)}
    missing = [str(d) for d in rollout.plan.devices if d not in rank_on]
    if missing:
        raise RuntimeError(f"the cuda_ipc bridge needs a trainer rank on every rollout device; none on {missing}")
    return [rank_on[d] for d in rollout.plan.devices]


def transport_for(same_process: bool, colocated: bool = False, device: str = "cpu",
                  same_devices: bool = False) -> str:
    """In-process when the roles share a process; CUDA IPC between processes on the same GPUs (fractional
    pools: NCCL refuses two ranks on one device); Ray's object store for colocated roles in separate processes
    on GPUs; otherwise a collective broadcast (gloo on CPU, between any processes)."""
    if same_process:
        return "in_process"
    if device == "cuda" and same_devices and not colocated:
        return "cuda_ipc"
    if colocated and device == "cuda":
        return "object_store"
    return "broadcast"


def resolve_transport(setting: str, plan: PlacementPlan) -> str:
    """``roles.rollout.weight_transport`` as the run uses it: ``auto`` follows the placement (``transport_for``)."""
    if setting != "auto":
        return setting
    return transport_for(plan.same_process("actor", "rollout"), plan.colocated("actor", "rollout"),
                         plan.cluster.device, plan.same_devices("actor", "rollout"))


def bridge_placement_problems(cfg: Any, plan: PlacementPlan, registry: Any) -> list[tuple[str, str]]:
    """The bridge the run would use, refused where the placement puts its two sides farther apart than it
    reaches (``BridgeEntry.scope``): an in-process bridge between two processes, a node-local one (CUDA IPC,
    shared memory) between pools, which are placement groups of their own that Ray may put on other machines."""
    if "actor" not in plan.role_pool or "rollout" not in plan.role_pool:
        return []
    key = "roles.rollout.weight_transport"
    transport = resolve_transport(cfg.roles.rollout.weight_transport, plan)
    trainer, rollout = plan.group_of("actor"), plan.group_of("rollout")
    try:
        entry = registry.bridge(trainer.roles["actor"], rollout.roles["rollout"], transport)
    except Exception as exc:  # noqa: BLE001 - RegistryError: no bridge for the pair
        return [(key, str(exc))]

    def where(group: Any, role: str) -> str:
        nodes = ", ".join(f"node{n}" for n in dict.fromkeys(d.node for d in group.devices))
        return f"{role} on pool '{group.pool}' ({nodes})"

    apart = f"{where(trainer, 'the actor')}, {where(rollout, 'the rollout')}"
    if entry.scope == "process" and not plan.same_process("actor", "rollout"):
        return [(key, f"the '{transport}' bridge needs the actor and the rollout in one process; they run in "
                      f"separate processes ({apart}): set it to auto or broadcast")]
    if entry.scope == "device" and not plan.same_devices("actor", "rollout"):
        return [(key, f"the '{transport}' bridge maps memory within one device; the actor and the rollout are on "
                      f"different devices ({apart}): use broadcast, or give the rollout's pool "
                      f"pools.<name>.share: {plan.role_pool['actor']}")]
    if entry.scope == "node" and not plan.same_devices("actor", "rollout"):
        return [(key, f"the '{transport}' bridge ({entry.plugin}) reaches only within a machine; the actor and the "
                      f"rollout are on separate pools ({apart}), which Ray may place on other machines: colocate "
                      "them on one pool, or use broadcast")]
    return []


@hookimpl
def hybridrl_register_backends(registry: Any) -> None:
    registry.add_bridge("*", "*", "in_process", InProcessBridge, scope="process")
    registry.add_bridge("*", "*", "object_store", ObjectStoreBridge)
    registry.add_bridge("*", "*", "broadcast", BroadcastBridge)
    registry.add_bridge("*", "*", "cuda_ipc", CudaIpcBridge, scope="device")
