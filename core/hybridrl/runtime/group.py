"""Worker groups: one Ray actor per device of a pool (per process slot), and the calls the driver makes.

``call_all`` broadcasts a call to every rank; ``run`` scatters a batch over the data-parallel ranks (padding
it to a multiple of the data-parallel size), gathers the results in order and strips the padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridrl.batch import Batch
from hybridrl.engines import DataParallelInfo
from hybridrl.placement.plan import ProcessGroupPlan


@dataclass
class WorkerGroup:
    plan: ProcessGroupPlan
    workers: list[Any]  # Ray actor handles of RoleWorker, in rank order
    dp: dict[str, list[DataParallelInfo]] = field(default_factory=dict)
    last_compute_s: float = 0.0

    def call_all(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        import ray

        return ray.get([getattr(w, method).remote(*args, **kwargs) for w in self.workers])

    def build(self, role: str, backend: str, ctx_fields: dict[str, Any]) -> None:
        self.dp[role] = self.call_all("build", role, backend, ctx_fields)

    def dp_size(self, role: str) -> int:
        return self.dp[role][0].dp_size

    def run(self, role: str, method: str, batch: Batch, *args: Any, worker_method: str = "call",
            zero_pad_keys: tuple[str, ...] = (), **kwargs: Any) -> Any:
        """Scatter ``batch`` over the role's data-parallel ranks, run ``method`` on each, gather.

        Batches come back concatenated (padding removed); dicts of metrics come back averaged.
        ``zero_pad_keys`` are zeroed in padding rows (masks, so that padding does not train)."""
        return self.gather(self.submit(role, method, batch, *args, worker_method=worker_method,
                                       zero_pad_keys=zero_pad_keys, **kwargs))

    def submit(self, role: str, method: str, batch: Batch, *args: Any, worker_method: str = "call",
               zero_pad_keys: tuple[str, ...] = (), **kwargs: Any) -> "PendingRun":
        """``run`` without waiting: the calls are dispatched and their futures returned, so the driver can
        drive another pool meanwhile (the pipelined loop generates while the actor trains). Calls to one
        worker still execute in submission order."""
        import ray

        infos = self.dp[role]
        dp_size = infos[0].dp_size
        padded, pad = batch.pad_to_multiple(dp_size, zero_pad_keys)
        chunks = padded.chunk(dp_size)
        # One worker: pass the batch inline; several: put each chunk in the object store once.
        payload = chunks if len(self.workers) == 1 else [ray.put(c) for c in chunks]
        lead = (role, method) if worker_method == "call" else (role,)
        futures = [w.timed.remote(worker_method, *lead, payload[info.dp_rank], *args, **kwargs)
                   for w, info in zip(self.workers, infos)]
        return PendingRun(role, futures, pad)

    def gather(self, pending: "PendingRun") -> Any:
        """Wait for a submitted run and assemble its results (see ``run``); sets ``last_compute_s``."""
        import ray

        infos = self.dp[pending.role]
        timed = ray.get(pending.futures)
        results = [r for r, _ in timed]
        self.last_compute_s = max(t for _, t in timed)
        outputs = sorted(((info.dp_rank, r) for info, r in zip(infos, results) if info.returns_output),
                         key=lambda x: x[0])
        values = [r for _, r in outputs]
        if isinstance(values[0], Batch):
            return Batch.concat(values).unpad(pending.pad)
        if isinstance(values[0], dict):
            return average_metrics(values)
        return values


@dataclass
class PendingRun:
    """A dispatched ``WorkerGroup.submit``: the per-rank futures (Ray ObjectRefs) and the padding to strip."""

    role: str
    futures: list[Any]
    pad: int


def average_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = rows[0].keys()
    return {k: sum(float(r[k]) for r in rows) / len(rows) for k in keys}
