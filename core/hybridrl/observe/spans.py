"""Phase spans: which devices each phase of a step kept busy, from when to when, on how many tokens.

The phase timer (``hybridrl.observe.timing``) notes each phase's wall-clock start and end; at the end of a step
the spans are tied to devices through the placement plan (a phase's roles -> their pool -> its ranks) and
appended to ``<trainer.out>/spans.jsonl``, one line per (phase, role). A device's busy fraction of the step is
the union of its spans over the step's wall time, logged as ``device/<pool>.<rank>/busy``. Measured on the
driver's clock: a device counts as busy while the driver waits on a call to its role, whatever the kernels do
inside it. Given the worker groups, a GPU whose worker samples NVML reports its kernel utilisation over the step
instead (``hybridrl.observe.device_busy``), and ``device/busy_sampled`` says the share of devices measured so;
each phase's sampled share of its devices while it ran is ``busy/<phase>``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hybridrl.errors import HybridRLError

if TYPE_CHECKING:
    from hybridrl.observe.timing import PhaseTimer
    from hybridrl.placement.plan import PlacementPlan

log = logging.getLogger(__name__)

#: the pooled roles whose devices each timed phase keeps busy; phases not listed run in the driver.
PHASE_ROLES: dict[str, tuple[str, ...]] = {
    "wake": ("rollout",), "gen": ("rollout",), "gen_baseline": ("rollout",), "sleep": ("rollout",),
    "sync_check": ("rollout", "actor"), "ref": ("ref",), "values": ("critic",), "old_log_prob": ("actor",),
    "update_critic": ("critic",), "update_actor": ("actor",), "reshard": ("actor", "rollout"),
    "reward": ("reward",), "val": ("rollout",),
}
#: the role of a span that no pooled role works in (data, rule rewards, advantages, waits)
DRIVER = "driver"
SPANS_FILE = "spans.jsonl"
#: the span each step writes for itself: its wall time, the frame of its phases' spans
STEP = "step"
#: with more devices than this in the run, ranks of a pool with the same busy fraction share one metric
#: (``device/<pool>.0-63/busy``), so that a 512-GPU run logs a few keys per pool, not 512
DEVICE_METRICS_LIMIT = 16

#: which of a step's token counts each phase worked on: the responses, or prompts and responses
RESPONSE_PHASES = ("gen", "gen_baseline")
SEQUENCE_PHASES = ("reward", "ref", "old_log_prob", "values")
UPDATE_PHASES = ("update_actor", "update_critic")  # once per epoch


@dataclass(frozen=True)
class Span:
    """One phase of one step on the devices of one role's pool (``pool`` None and no ranks: the driver)."""

    step: int
    phase: str
    role: str
    pool: str | None
    ranks: tuple[int, ...]
    start: float  # seconds since the epoch
    end: float
    tokens: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "phase": self.phase, "role": self.role, "pool": self.pool,
                "ranks": rank_ranges(self.ranks), "start": round(self.start, 6), "end": round(self.end, 6),
                "tokens": self.tokens}

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> Span:
        ranks = tuple(r for first, last in row.get("ranks") or () for r in range(int(first), int(last) + 1))
        tokens = row.get("tokens")
        return cls(int(row["step"]), str(row["phase"]), str(row["role"]), row.get("pool"), ranks,
                   float(row["start"]), float(row["end"]), None if tokens is None else int(tokens))


def rank_ranges(ranks: Iterable[int]) -> list[list[int]]:
    """``[0, 1, 2, 5]`` -> ``[[0, 2], [5, 5]]``: a pool's ranks in a line of constant size."""
    out: list[list[int]] = []
    for r in sorted(ranks):
        if out and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return out


def merged_seconds(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Seconds of ``[lo, hi]`` covered by the union of ``intervals`` (overlaps counted once)."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    total, end = 0.0, lo
    for a, b in clipped:
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def busy_fractions(spans: Iterable[Span], devices: Mapping[str, int], lo: float, hi: float
                   ) -> dict[tuple[str, int], float]:
    """``(pool, rank) -> share of [lo, hi]`` some span kept it busy, for every device of ``devices`` (pool ->
    size), idle ones at 0."""
    per: dict[tuple[str, int], list[tuple[float, float]]] = {(p, r): [] for p, n in devices.items() for r in range(n)}
    for span in spans:
        for rank in span.ranks:
            if (span.pool, rank) in per:
                per[(str(span.pool), rank)].append((span.start, span.end))
    wall = max(hi - lo, 1e-9)
    return {key: min(1.0, merged_seconds(iv, lo, hi) / wall) for key, iv in per.items()}


def device_rows(values: Mapping[tuple[str, int], Any], limit: int = DEVICE_METRICS_LIMIT
                ) -> list[tuple[str, list[tuple[str, int]]]]:
    """Labels for per-device values: ``main.3`` each while the run has at most ``limit`` devices, else runs of
    consecutive ranks of a pool with equal values joined (``main.0-63``). Returns (label, its devices)."""
    keys = list(values)
    if len(keys) <= limit:
        return [(f"{p}.{r}", [(p, r)]) for p, r in keys]
    out: list[tuple[str, list[tuple[str, int]]]] = []
    for pool, rank in keys:
        last = out[-1][1][-1] if out else None
        if last is not None and last[0] == pool and last[1] == rank - 1 and values[last] == values[(pool, rank)]:
            out[-1][1].append((pool, rank))
        else:
            out.append(("", [(pool, rank)]))
    return [(f"{run[0][0]}.{run[0][1]}" + (f"-{run[-1][1]}" if len(run) > 1 else ""), run) for _, run in out]


def busy_metrics(busy: Mapping[tuple[str, int], float], limit: int = DEVICE_METRICS_LIMIT) -> dict[str, float]:
    """``device/<pool>.<rank>/busy`` per device (ranks joined beyond ``limit`` devices: ``device_rows``)."""
    return {f"device/{label}/busy": busy[run[0]] for label, run in device_rows(busy, limit)}


def phase_busy_metrics(spans: Iterable[Span], windows: list[tuple[float, float]],
                       per_window: Mapping[tuple[str, int], list[float | None]]) -> dict[str, float]:
    """``busy/<phase>``: the NVML busy share of the phase's devices while it ran, over its spans and devices
    weighted by the spans' seconds (a device counted once where several roles of the phase share it), for the
    phases with a sampled device. It says how much of a phase the GPU computes: a phase with a low share (a
    host-bound generation) leaves room to a process beside it on the same GPU (a fractional map)."""
    index = {window: i for i, window in enumerate(windows)}
    weighted: dict[str, float] = {}
    seconds: dict[str, float] = {}
    seen: set[tuple[str, float, float, str, int]] = set()
    for span in spans:
        i = index.get((span.start, span.end))
        if i is None or span.pool is None or span.end <= span.start:
            continue
        for rank in span.ranks:
            values = per_window.get((span.pool, rank))
            key = (span.phase, span.start, span.end, span.pool, rank)
            if values is None or values[i] is None or key in seen:
                continue
            seen.add(key)
            weighted[span.phase] = weighted.get(span.phase, 0.0) + float(values[i]) * (span.end - span.start)
            seconds[span.phase] = seconds.get(span.phase, 0.0) + span.end - span.start
    return {f"busy/{phase}": weighted[phase] / seconds[phase] for phase in weighted}


@dataclass
class SpanLog:
    """Turns each step's phase timer into spans on the plan's devices, appends them to ``spans.jsonl`` and
    gives the step's busy-fraction metrics."""

    role_pools: dict[str, str]  # pooled role -> its pool
    pool_sizes: dict[str, int]  # pool -> devices (ranks)
    path: Path | None = None  # None: nothing written (tests, a plan without a run folder)
    epochs: int = 1
    busy_source: str | None = None  # the last source line logged (``device_busy.source_line``)
    #: a pool on another pool's devices (``pools.<name>.share``) -> (that pool, the owner's rank of each its ranks)
    guests: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)

    @classmethod
    def for_plan(cls, plan: PlacementPlan, out: str | Path | None, epochs: int = 1) -> SpanLog:
        """The plan's roles on their devices. A fractional pool's devices are its host's: its spans and busy
        fractions go to the host's ranks, so a GPU both pools run on is one device, not two."""
        guests = {pool: (host, tuple(plan.pools[host].index(d) for d in plan.pools[pool]))
                  for pool, host in plan.shares.items() if pool in plan.pools and host in plan.pools}
        used = set(plan.role_pool.values())
        return cls(dict(plan.role_pool), {p: len(d) for p, d in plan.pools.items() if p in used and p not in guests},
                   Path(out) / SPANS_FILE if out is not None else None, epochs, guests=guests)

    def spans(self, step: int, timer: PhaseTimer, step_seconds: float, response_tokens: int, all_tokens: int
              ) -> list[Span]:
        """The step's own span (phase ``step``, the driver's: the frame of the others), then one per phase and
        role, in the order the phases ended."""
        out = [Span(step, STEP, DRIVER, None, (), timer.started, timer.started + step_seconds)]
        for phase, start, end in timer.spans:
            tokens = (response_tokens if phase in RESPONSE_PHASES else all_tokens if phase in SEQUENCE_PHASES
                      else all_tokens * self.epochs if phase in UPDATE_PHASES else None)
            roles = [r for r in PHASE_ROLES.get(phase, ()) if r in self.role_pools]
            if not roles:
                out.append(Span(step, phase, DRIVER, None, (), start, end, tokens))
            for role in roles:
                pool = self.role_pools[role]
                if pool in self.guests:  # on the host's devices: spans there
                    pool, host_ranks = self.guests[pool]
                    ranks = tuple(sorted(set(host_ranks)))
                else:
                    ranks = tuple(range(self.pool_sizes[pool]))
                out.append(Span(step, phase, role, pool, ranks, start, end, tokens))
        return out

    def record_step(self, step: int, timer: PhaseTimer, step_seconds: float, response_tokens: int,
                    all_tokens: int, groups: Mapping[str, Any] | None = None) -> dict[str, float]:
        """Append the step's spans to the file and return ``device/<pool>.<rank>/busy`` for the step; with the
        worker ``groups``, NVML's value where a worker sampled one, and ``device/busy_sampled``."""
        spans = self.spans(step, timer, step_seconds, response_tokens, all_tokens)
        if self.path is not None:
            from hybridrl.run.file_modes import open_private

            with open_private(self.path) as f:
                f.writelines(json.dumps(s.to_json()) + "\n" for s in spans)
        lo, hi = timer.started, timer.started + step_seconds
        busy = busy_fractions(spans, self.pool_sizes, lo, hi)
        if groups is None:
            return busy_metrics(busy)
        from hybridrl.observe.device_busy import merge_busy, sampled_busy, source_line

        windows = [(lo, hi), *sorted({(s.start, s.end) for s in spans if s.pool is not None})]
        per_window = sampled_busy(groups, windows, self.guests)
        step_busy = {key: values[0] for key, values in per_window.items() if values[0] is not None}
        busy, sampled = merge_busy(busy, step_busy)
        line = source_line(sampled, len(busy))
        if line != self.busy_source:
            log.info("%s", line)
            self.busy_source = line
        return (busy_metrics(busy) | {"device/busy_sampled": sampled / max(len(busy), 1)}
                | phase_busy_metrics(spans, windows, per_window))


class SpansError(HybridRLError, ValueError):
    """spans.jsonl cannot be read (the report names the line)."""


def load_spans(path: str | Path) -> dict[int, list[Span]]:
    """step -> its spans; a step recorded again (re-run after a resume) keeps its last recording."""
    out: dict[int, list[Span]] = {}
    current: int | None = None
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            span = Span.from_json(json.loads(line))
        except (ValueError, KeyError, TypeError):
            raise SpansError(f"{path}:{n} is not a span line") from None
        if span.step != current or span.phase == STEP:  # a recording of a step begins with its own span
            out[span.step] = []  # a step seen before is replaced by this later recording
            current = span.step
        out[span.step].append(span)
    return out
