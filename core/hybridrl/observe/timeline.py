"""The device timeline of ``hybridrl report``: one row per device, coloured by phase, for one step, read from
``spans.jsonl`` (``hybridrl.observe.spans``), beside each device's busy fraction over the run: the one the run
logged (``device/<pool>.<rank>/busy`` in ``metrics.jsonl``, NVML-sampled where a worker sampled it), else the
spans' (a device is busy while any phase runs on it)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrl.errors import HybridRLError
from hybridrl.observe.spans import (
    DRIVER,
    SPANS_FILE,
    STEP,
    Span,
    SpansError,
    busy_fractions,
    device_rows,
    load_spans,
)

TIMELINE_PLOT = "timeline.png"


class TimelineError(HybridRLError, ValueError):
    """A step or the spans the timeline needs are missing (the report turns it into one sentence)."""


def missing_spans(run: str | Path) -> str | None:
    """Why ``run`` has no timeline (one sentence), or None when it has spans."""
    path = Path(run) / SPANS_FILE
    if path.is_file() and path.stat().st_size > 0:
        return None
    return (f"'{run}' has no {SPANS_FILE} (phase spans per device): it was trained by a hybridrl that did not "
            "record them, or has not finished a step; train or resume it with this version to record them")


@dataclass
class RunSpans:
    """A run's spans by step and the devices they name, with each step's busy fraction per device."""

    steps: dict[int, list[Span]]
    pools: dict[str, int]  # pool -> ranks seen
    logged: dict[int, dict[tuple[str, int], float]] = field(default_factory=dict)  # step -> NVML-sampled busy

    @property
    def sampled(self) -> bool:
        """Whether any step's busy fractions were sampled (``device/busy_sampled``)."""
        return bool(self.logged)

    @classmethod
    def read(cls, run: str | Path, metrics: Iterable[dict[str, Any]] = ()) -> RunSpans:
        """The spans of ``run``, with the sampled busy fractions of its ``metrics`` rows (``load_metrics``)."""
        why = missing_spans(run)
        if why is not None:
            raise TimelineError(why)
        try:
            steps = load_spans(Path(run) / SPANS_FILE)
        except SpansError as exc:
            raise TimelineError(str(exc)) from None
        pools: dict[str, int] = {}
        for spans in steps.values():
            for s in spans:
                if s.pool is not None and s.ranks:
                    pools[s.pool] = max(pools.get(s.pool, 0), max(s.ranks) + 1)
        return cls(dict(sorted(steps.items())), pools, sampled_busy_of(metrics))

    def pick(self, step: int | None, run: str | Path) -> int:
        """``step``, or the last one recorded; a step not recorded is a ``TimelineError`` naming those there are."""
        if step is None:
            return max(self.steps)
        if step not in self.steps:
            have = list(self.steps)
            held = f"steps {have[0]}-{have[-1]}" if have == list(range(have[0], have[-1] + 1)) else \
                f"steps {', '.join(map(str, have))}"
            raise TimelineError(f"step {step} is not in {Path(run) / SPANS_FILE}, which holds {held} (give --step "
                                "one of them, or leave --step out for the last)")
        return step

    def window(self, step: int) -> tuple[float, float]:
        """The step's wall-clock start and end (its ``step`` span, else the first start and last end)."""
        spans = self.steps[step]
        frame = next((s for s in spans if s.phase == STEP), None)
        if frame is not None:
            return frame.start, frame.end
        return min(s.start for s in spans), max(s.end for s in spans)

    def busy(self, step: int) -> dict[tuple[str, int], float]:
        """Each device's busy fraction in ``step``: the sampled one the run logged, else the spans'."""
        lo, hi = self.window(step)
        logged = self.logged.get(step, {})
        return {key: logged.get(key, value)
                for key, value in busy_fractions(self.steps[step], self.pools, lo, hi).items()}

    def busy_by_device(self) -> dict[tuple[str, int], list[float]]:
        """Each device's busy fraction, step by step (in ``steps`` order)."""
        out: dict[tuple[str, int], list[float]] = {(p, r): [] for p, n in self.pools.items() for r in range(n)}
        for step in self.steps:
            for key, value in self.busy(step).items():
                out[key].append(value)
        return out


def sampled_busy_of(metrics: Iterable[dict[str, Any]]) -> dict[int, dict[tuple[str, int], float]]:
    """The busy fractions of the steps whose devices were sampled (``device/busy_sampled`` > 0), per device
    (a joined label, ``main.0-63``, stands for each of its ranks); empty without such steps."""
    out: dict[int, dict[tuple[str, int], float]] = {}
    for row in metrics:
        if not row.get("device/busy_sampled") or "step" not in row:
            continue
        devices: dict[tuple[str, int], float] = {}
        for key, value in row.items():
            if not (key.startswith("device/") and key.endswith("/busy")):
                continue
            pool, _, ranks = key[len("device/"):-len("/busy")].rpartition(".")
            first, _, last = ranks.partition("-")
            if not pool or not first.isdigit() or not (last or first).isdigit():
                continue
            for rank in range(int(first), int(last or first) + 1):
                devices[(pool, rank)] = float(value)
        out[int(row["step"])] = devices
    return out


def _signature(spans: list[Span], pool: str, rank: int) -> tuple[tuple[str, float, float], ...]:
    return tuple((s.phase, s.start, s.end) for s in spans if s.pool == pool and rank in s.ranks)


def timeline_rows(spans: RunSpans, step: int) -> list[tuple[str, list[tuple[str, int]]]]:
    """The rows of the timeline: one per device (devices with the same spans and busy history joined past
    ``DEVICE_METRICS_LIMIT`` devices: ``device_rows``)."""
    history = spans.busy_by_device()
    values = {key: (_signature(spans.steps[step], *key), tuple(history[key])) for key in history}
    return device_rows(values)


def timeline_summary(spans: RunSpans, step: int) -> dict[str, Any]:
    """The numbers the plot shows: per row, the step's busy fraction and the run's mean, min and max."""
    history = spans.busy_by_device()
    busy = spans.busy(step)
    rows = {}
    for label, devices in timeline_rows(spans, step):
        series = history[devices[0]]
        rows[label] = {"devices": len(devices), "busy_step": busy[devices[0]],
                       "busy_mean": sum(series) / len(series) if series else 0.0,
                       "busy_min": min(series, default=0.0), "busy_max": max(series, default=0.0)}
    lo, hi = spans.window(step)
    return {"step": step, "step_s": hi - lo, "busy_source": "sampled" if spans.sampled else "spans",
            "devices": rows}


def phase_colors(phases: list[str]) -> dict[str, Any]:
    from matplotlib import colormaps

    cmap = colormaps["tab20"]
    return {p: cmap(i % 20) for i, p in enumerate(phases)}


def plot_timeline(spans: RunSpans, step: int, path: Path, figure: Any) -> None:
    """Left: the step, one row per device (and the driver on top), a bar per span coloured by phase. Right:
    each row's busy fraction at every step of the run (a heat map, same rows)."""
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    rows = timeline_rows(spans, step)
    lo, hi = spans.window(step)
    step_spans = [s for s in spans.steps[step] if s.phase != STEP]
    phases = list(dict.fromkeys(s.phase for s in step_spans))
    colors = phase_colors(phases)
    labels = [DRIVER] + [label for label, _ in rows]
    fig = figure(13.0, 2.2 + 0.35 * len(labels))
    grid = fig.add_gridspec(1, 2, width_ratios=(3, 1.4))
    ax = fig.add_subplot(grid[0])
    heat = fig.add_subplot(grid[1], sharey=ax)
    drawn: set[str] = set()
    for y, label in enumerate(labels):
        if label == DRIVER:
            mine = [s for s in step_spans if s.role == DRIVER]
        else:
            pool, rank = rows[y - 1][1][0]
            mine = [s for s in step_spans if s.pool == pool and rank in s.ranks]
        for s in mine:
            ax.broken_barh([(s.start - lo, s.end - s.start)], (y - 0.4, 0.8), color=colors[s.phase],
                           label=None if s.phase in drawn else s.phase)
            drawn.add(s.phase)
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    ax.set_xlim(0, max(hi - lo, 1e-6))
    ax.set(xlabel=f"seconds into step {step}", title=f"Step {step}: phases per device")
    if phases:
        fig.legend(loc="outside lower center", ncol=min(8, len(phases)), fontsize="small")
    history = spans.busy_by_device()
    steps = list(spans.steps)
    matrix = np.full((len(labels), len(steps)), np.nan)
    for y, (_, devices) in enumerate(rows, start=1):
        matrix[y] = history[devices[0]]
    image = heat.imshow(np.ma.masked_invalid(matrix), aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0,
                        interpolation="nearest", extent=(steps[0] - 0.5, steps[-1] + 0.5, len(labels) - 0.5, -0.5))
    heat.tick_params(labelleft=False)
    heat.set(xlabel="step", title="busy fraction per step" + (" (sampled)" if spans.sampled else " (spans)"))
    heat.xaxis.set_major_locator(MaxNLocator(integer=True))
    heat.axvline(step, color="white", linewidth=0.8, linestyle=":")
    fig.colorbar(image, ax=heat, fraction=0.08, label="busy")
    fig.savefig(path)
