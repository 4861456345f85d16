"""The process that hosts one or more colocated roles on one device (a Ray actor in a real run).

Roles fused into one process share its memory and its default process group; the worker calls engine
methods by name for the driver and returns the compute time with each result, so the driver can tell model
compute from overhead (dispatch, serialisation, data handling).
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any

import torch

from hybridrl.engines import DataParallelInfo, EngineContext, RolloutEngine, TrainEngine
from hybridrl.observe.console import quiet_library_bars
from hybridrl.observe.device_busy import BusySampler, device_sampler
from hybridrl.observe.gc_pauses import GcPauseMeter
from hybridrl.observe.memory import DeviceMemoryMeter
from hybridrl.observe.profile import CallProfiler
from hybridrl.plugins.discovery import get_registry
from hybridrl.roles import role_spec
from hybridrl.runtime.device_map import WorkerLocation, this_worker_location
from hybridrl.runtime.distributed import init_process_group, node_ip, reserve_port
from hybridrl.weights.bridges import sync_buckets, sync_in_process
from hybridrl.weights.channel import WeightChannel, bucket_specs
from hybridrl.weights.cuda_ipc import IpcOffer, IpcReceiver, IpcSender


class RoleWorker:
    def __init__(self, rank: int, world_size: int, device: str, threads: int | None = None,
                 extra_plugins: tuple[str, ...] = ()) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.extra_plugins = tuple(extra_plugins)
        quiet_library_bars()  # Ray forwards a worker's output through a pipe: no bar frames in the step lines
        if threads:
            torch.set_num_threads(threads)
        self.engines: dict[str, TrainEngine | RolloutEngine] = {}
        self.memory = DeviceMemoryMeter(device, rank)  # device peak per phase; OOM -> DeviceOutOfMemory
        self.profiler = CallProfiler(rank)  # trainer.profile_step: kernel profiles of named calls
        self.gc_pauses = GcPauseMeter()  # gc/<role>.<method>_s: the collector's pauses inside each call
        self.busy: BusySampler | None = None  # NVML utilisation of a CUDA device, from the first engine built
        self.ipc_sender, self.ipc_receiver = IpcSender(), IpcReceiver()  # the CUDA IPC bridge's two sides

    # --- set-up ---------------------------------------------------------------------------------------
    def rendezvous_address(self) -> tuple[str, int]:
        """Address for the process group (asked of rank 0 only)."""
        host = node_ip()
        return host, reserve_port(host)  # held open until this rank serves the store on it

    def location(self) -> WorkerLocation:
        """Where this process runs (node id and address, the GPUs Ray gave it): the driver's device map."""
        return this_worker_location()

    def init_distributed(self, master_addr: str, master_port: int) -> None:
        if self.device == "cuda":
            os.environ.setdefault("LOCAL_RANK", "0")  # Ray narrows CUDA_VISIBLE_DEVICES to this bundle's GPU
        init_process_group(self.rank, self.world_size, master_addr, master_port, self.device)

    def build(self, role: str, backend: str, ctx_fields: dict[str, Any]) -> DataParallelInfo:
        """Construct the role's engine (the backend is loaded here, in the worker, never in the driver)."""
        registry = get_registry(self.extra_plugins)
        entry = registry.backend(role_spec(role).kind, backend)
        engine_cls = entry.load()
        ctx = EngineContext(role=role, backend=backend, rank=self.rank, world_size=self.world_size,
                            device=self.device, **ctx_fields)
        with self.memory.watch(role, "build"):
            self.engines[role] = engine_cls(ctx)
        if self.busy is None:  # CUDA is set up now: the sampler reads the device this process uses
            self.busy = device_sampler(self.device)
        return self.engines[role].data_parallel()

    def build_view(self, role: str, of_role: str, backend: str, ctx_fields: dict[str, Any]) -> DataParallelInfo:
        """A role served by another role's engine in this process instead of an engine of its own: the reference
        of a LoRA actor is the actor's base with the adapters disabled (``TrainEngine.reference_view``)."""
        ctx = EngineContext(role=role, backend=backend, rank=self.rank, world_size=self.world_size,
                            device=self.device, **ctx_fields)
        self.engines[role] = self.engines[of_role].reference_view(ctx)
        return self.engines[role].data_parallel()

    # --- calls ----------------------------------------------------------------------------------------
    def call(self, role: str, method: str, *args: Any, **kwargs: Any) -> tuple[Any, float]:
        """``(engine.method(*args, **kwargs), seconds it took)`` in one round trip: the seconds are the model
        compute the driver sets against the phase's wall time (dispatch, serialisation, data handling)."""
        start = time.perf_counter()
        with self.memory.watch(role, method), self.gc_pauses.watch(role, method), self.profiler.around(role, method):
            result = getattr(self.engines[role], method)(*args, **kwargs)
        return result, time.perf_counter() - start

    def arm_profile(self, calls: list[str], out_dir: str, step: int) -> None:
        """Profile the next call of each ``role.method`` in ``calls`` (``hybridrl.observe.profile``)."""
        self.profiler.arm(calls, out_dir, step)

    # --- weights --------------------------------------------------------------------------------------
    def sync_in_process(self, trainer_role: str, rollout_role: str, bucket_bytes: int) -> dict[str, float]:
        """Colocated bridge: buckets go from the trainer to the rollout inside this process."""
        with self.memory.watch(rollout_role, "reshard"):
            return sync_in_process(self.engines[trainer_role], self.engines[rollout_role], bucket_bytes)

    def export_buckets(self, trainer_role: str, bucket_bytes: int) -> list | None:
        """Split-pool fallback: every rank takes part in the gather; the exporting rank returns the buckets."""
        engine = self.engines[trainer_role]
        buckets = [[(n, t.detach().cpu()) for n, t in bucket] for bucket in sync_buckets(engine, bucket_bytes, False)]
        return buckets if engine.exports_on_rank() else None

    def import_buckets(self, rollout_role: str, buckets: list) -> None:
        engine = self.engines[rollout_role]
        for bucket in buckets:
            engine.import_weights(bucket)
        engine.finish_weight_import()

    # --- broadcast bridge (split pools) ------------------------------------------------------------------
    def exports(self, trainer_role: str) -> bool:
        return self.engines[trainer_role].exports_on_rank()

    def weight_manifest(self, trainer_role: str, bucket_bytes: int) -> list | None:
        """Bucket layout of the export (collective over the trainer's ranks; the exporting rank answers)."""
        engine = self.engines[trainer_role]
        specs = bucket_specs(sync_buckets(engine, bucket_bytes), self._wire_dtype(engine))
        return specs if engine.exports_on_rank() else None

    def _wire_dtype(self, engine: TrainEngine) -> torch.dtype | None:
        """Weights cross pools in the run's compute dtype on GPUs (the rollout computes in it: half the bytes of
        fp32 master weights); on CPU in the master dtype, bit for bit."""
        return engine.ctx.torch_dtype if self.device == "cuda" else None

    def open_weight_channel(self, host: str, port: int, rank: int, world_size: int) -> None:
        self.weight_channel = WeightChannel(host, port, rank, world_size, self.device)

    def send_weights(self, trainer_role: str, bucket_bytes: int, specs: list | None) -> float:
        """Export (every trainer rank takes part) and, on the exporting rank, broadcast the buckets."""
        engine = self.engines[trainer_role]
        buckets = sync_buckets(engine, bucket_bytes)  # each bucket is packed before the next is made
        if not engine.exports_on_rank():
            for _ in buckets:
                pass
            return 0.0
        return float(self.weight_channel.send(buckets, specs))

    def receive_weights(self, rollout_role: str, specs: list) -> float:
        engine = self.engines[rollout_role]
        received = self.weight_channel.receive(specs, engine.import_weights)
        engine.finish_weight_import()
        return float(received)

    # --- CUDA IPC bridge (separate processes on one device) -------------------------------------------------
    def ipc_export_begin(self, trainer_role: str, bucket_bytes: int) -> None:
        """Start an export (every trainer rank, in step: the gathers are collectives). Each rank's transient export
        holds the full weights, as for the in-process bridge: it serves the rollout ranks on its own device."""
        engine = self.engines[trainer_role]
        self._ipc_export = iter(sync_buckets(engine, bucket_bytes))
        self._ipc_wire = self._wire_dtype(engine)

    def ipc_export_next(self) -> IpcOffer | None:
        """The next bucket packed into this rank's IPC buffer, or None once the export is over."""
        bucket = next(self._ipc_export, None)
        return None if bucket is None else self.ipc_sender.offer(bucket, self._ipc_wire)

    def ipc_export_end(self) -> None:
        export, self._ipc_export = self._ipc_export, None
        close = getattr(export, "close", None)
        if close is not None:  # runs the export's own end (an offloaded actor's weights go back to the host)
            close()

    def ipc_import(self, rollout_role: str, offer: IpcOffer) -> None:
        """Import one offered bucket (views of the sender's buffer), finished before answering."""
        self.engines[rollout_role].import_weights(self.ipc_receiver.open(offer))
        self.ipc_receiver.done()

    def weights(self, role: str) -> dict[str, torch.Tensor]:
        """Full weights of a role (tests and checks): export for trainers, named_weights for rollouts."""
        engine = self.engines[role]
        if isinstance(engine, TrainEngine):
            return {n: t.detach().cpu().clone() for b in engine.export_weights(1 << 30) for n, t in b}
        return {n: t.detach().cpu().clone() for n, t in engine.named_weights()}

    def gc_report(self) -> dict[str, float]:
        """The collector's pauses per call since the last report (``GcPauseMeter.report``)."""
        return self.gc_pauses.report()

    def busy_report(self, windows: list[tuple[float, float]]) -> list[float | None] | None:
        """The share of each window ``(lo, hi)`` (seconds since the epoch) this worker's GPU ran kernels, sampled
        by NVML; None without a sampler (the driver keeps the span-based fractions)."""
        return self.busy.fractions(windows) if self.busy is not None else None

    def memory_report(self) -> dict[str, float]:
        """The device peak (MiB) of each phase this worker ran since the last report (GPU only)."""
        return self.memory.report()

    def peak_memory_mb(self) -> float:
        if self.device == "cuda":  # the meter restarts torch's counters each phase: the process's peak is kept there
            from hybridrl.observe.memory import allocated_peak_mb

            return allocated_peak_mb()
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
