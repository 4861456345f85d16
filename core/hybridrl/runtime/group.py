"""Worker groups: one Ray actor per device of a pool (per process slot), and the calls the driver makes.

Every call of an engine method comes back as a ``Result``: the gathered value and the compute seconds of its
slowest rank (the time spent inside the engine method, without dispatch and serialisation), so the driver can
tell model compute from overhead without reading anything off the group afterwards.

* ``call`` scatters a batch over the role's data-parallel ranks (padding it to a multiple of their number),
  runs the method on each and gathers the results in order (``submit``/``wait``: the same without waiting);
* ``broadcast`` runs an engine method with the same arguments on every rank (sleep, wake, checkpoints);
* ``call_all`` runs a method of the worker itself on every rank (set-up, weight transfer, memory figures).

Every wait on the workers' results has the group's deadline (``trainer.step_timeout_s``,
``hybridrl.runtime.deadline``): ranks that do not answer in time raise ``WorkersNotAnswering``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hybridrl.engines import DataParallelInfo
from hybridrl.engines.batch import Batch, token_balanced_order
from hybridrl.placement.plan import ProcessGroupPlan
from hybridrl.runtime.deadline import CallDeadline, Waited, wait_all


@dataclass(frozen=True)
class Result:
    """What an engine call gave back: ``value`` (a Batch concatenated over data-parallel ranks, metrics averaged,
    or the list of per-rank values) and ``compute_s``, the slowest rank's seconds inside the engine method."""

    value: Any
    compute_s: float


@dataclass
class PendingCall:
    """A dispatched ``WorkerGroup.submit``: the per-rank futures (Ray ObjectRefs) and the padding to strip."""

    role: str
    futures: list[Any]
    pad: int
    order: Any = None  # the rows' order in the scatter (token balancing), undone in ``wait``; None: as given
    method: str = ""


@dataclass
class WorkerGroup:
    plan: ProcessGroupPlan
    workers: list[Any]  # Ray actor handles of RoleWorker, in rank order
    dp: dict[str, list[DataParallelInfo]] = field(default_factory=dict)
    locations: list[Any] = field(default_factory=list)  # WorkerLocation of each rank (runtime.device_map)
    deadline: CallDeadline | None = None  # how long a wait on the workers may take (None: no limit)

    def gather(self, futures: list[Any], what: str, ranks: list[int] | None = None) -> list[Any]:
        """The results of ``futures`` (one per rank, in rank order, or of ``ranks``) within the deadline."""
        return wait_all([Waited(self, futures, what, ranks)], self.deadline)[0]

    def call_all(self, worker_method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """A method of ``RoleWorker`` itself on every rank, waited for; the per-rank results in rank order."""
        return self.gather([getattr(w, worker_method).remote(*args, **kwargs) for w in self.workers], worker_method)

    def build(self, role: str, backend: str, ctx_fields: dict[str, Any]) -> None:
        self.dp[role] = self.call_all("build", role, backend, ctx_fields)

    def build_view(self, role: str, of_role: str, backend: str, ctx_fields: dict[str, Any]) -> None:
        """``role`` served by ``of_role``'s engine in the same processes (``RoleWorker.build_view``)."""
        self.dp[role] = self.call_all("build_view", role, of_role, backend, ctx_fields)

    def dp_size(self, role: str) -> int:
        return self.dp[role][0].dp_size

    def broadcast(self, role: str, method: str, *args: Any, **kwargs: Any) -> Result:
        """``engine.method(*args, **kwargs)`` on every rank of ``role``; the value is the per-rank list."""
        timed = self.gather([w.call.remote(role, method, *args, **kwargs) for w in self.workers], f"{role}.{method}")
        return Result([r for r, _ in timed], max(t for _, t in timed))

    def call(self, role: str, method: str, batch: Batch, *args: Any, zero_pad_keys: tuple[str, ...] = (),
             **kwargs: Any) -> Result:
        """Scatter ``batch`` over the role's data-parallel ranks, run ``engine.method(chunk, *args)`` on each,
        gather: batches come back concatenated (padding removed), dicts of metrics averaged.
        ``zero_pad_keys`` are zeroed in padding rows (masks, so that padding does not train)."""
        return self.wait(self.submit(role, method, batch, *args, zero_pad_keys=zero_pad_keys, **kwargs))

    def submit(self, role: str, method: str, batch: Batch, *args: Any, zero_pad_keys: tuple[str, ...] = (),
               **kwargs: Any) -> PendingCall:
        """``call`` without waiting: the calls are dispatched and their futures returned, so the driver can
        drive another pool meanwhile (the pipelined loop generates while the actor trains). Calls to one
        worker still execute in submission order."""
        import ray

        infos = self.dp[role]
        dp_size = infos[0].dp_size
        padded, pad = batch.pad_to_multiple(dp_size, zero_pad_keys)
        order = token_balanced_order(padded, dp_size)  # ranks get equal rows and near-equal tokens
        chunks = (padded.index(order) if order is not None else padded).chunk(dp_size)
        # One worker: pass the batch inline; several: put each chunk in the object store once.
        payload = chunks if len(self.workers) == 1 else [ray.put(c) for c in chunks]
        futures = [w.call.remote(role, method, payload[info.dp_rank], *args, **kwargs)
                   for w, info in zip(self.workers, infos)]
        return PendingCall(role, futures, pad, order, method)

    def wait(self, pending: PendingCall) -> Result:
        """Wait for a submitted call and assemble its results (see ``call``)."""
        infos = self.dp[pending.role]
        timed = self.gather(pending.futures, f"{pending.role}.{pending.method}")
        compute_s = max(t for _, t in timed)
        outputs = sorted(((info.dp_rank, r) for info, (r, _) in zip(infos, timed) if info.returns_output),
                         key=lambda x: x[0])
        values = [r for _, r in outputs]
        if isinstance(values[0], Batch):
            merged = Batch.concat(values)
            if pending.order is not None:
                merged = merged.index(pending.order.argsort())
            return Result(merged.unpad(pending.pad), compute_s)
        if isinstance(values[0], dict):
            return Result(average_metrics(values), compute_s)
        return Result(values, compute_s)


def average_metrics(rows: list[dict[str, float]]) -> dict[str, float]:
    keys = rows[0].keys()
    return {k: sum(float(r[k]) for r in rows) / len(rows) for k in keys}


def unique_groups(groups: dict[str, WorkerGroup]) -> list[WorkerGroup]:
    """Each worker group once (colocated roles fused into one process share their group)."""
    return list({id(g): g for g in groups.values()}.values())
