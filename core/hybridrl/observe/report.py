"""``hybridrl report RUN``: PNG plots and a Markdown summary of a run, from ``metrics.jsonl`` and ``config.json``
(and the device timeline from ``spans.jsonl``: ``hybridrl.observe.timeline``).

Everything is computed from the files a run leaves behind (no Ray, no model), so a report can be made on a
laptop from a run copied off a cluster. Plots use matplotlib's Agg canvas directly (no pyplot, no display).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hybridrl.errors import HybridRLError
from hybridrl.observe.spans import DRIVER, PHASE_ROLES

IDLE = "idle"


class ReportError(HybridRLError, ValueError):
    """The run folder has no metrics to report."""

    exit_status = 2  # refused before any work


# --- reading ---------------------------------------------------------------------------------------

def load_metrics(run: str | Path) -> list[dict[str, Any]]:
    """Rows of ``metrics.jsonl`` ordered by step; a step logged twice (a resumed run) keeps its last row."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise ReportError(f"no metrics.jsonl in '{run}' (give the run's trainer.out folder)")
    rows: dict[int, dict[str, Any]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ReportError(f"{path}:{n} is not JSON") from None
        rows[int(row["step"])] = row
    if not rows:
        raise ReportError(f"{path} holds no steps yet")
    return [rows[s] for s in sorted(rows)]


def load_run_config(run: str | Path) -> dict[str, Any]:
    path = Path(run) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows where ``key`` has a number."""
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            steps.append(int(row["step"]))
            values.append(float(value))
    return steps, values


def phases(rows: list[dict[str, Any]]) -> list[str]:
    """Timed phases in the order they first appear (``timing/step`` is the whole, not a phase, and a pipelined
    run's ``timing/overlap_saved`` is a difference of times; its ``gen`` overlaps the other phases)."""
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            if key.startswith("timing/") and key not in ("timing/step", "timing/overlap_saved"):
                seen.setdefault(key.removeprefix("timing/"), None)
    return list(seen)


def _total(rows: list[dict[str, Any]], key: str) -> float:
    return sum(series(rows, key)[1])


# --- where the devices spent their time --------------------------------------------------------------

def role_pools(config: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, str]:
    """role -> pool as the run placed it: a role's ``pool``, else the first pool. A critic that the config
    left to the default sits with the actor when the run timed critic phases."""
    pools = list(config.get("pools") or {"default": {}})
    roles = config.get("roles") or {}
    out: dict[str, str] = {}
    for role, rcfg in roles.items():
        if rcfg is None:
            continue
        if role == "reward" and not (rcfg.get("pool") or rcfg.get("model")):
            continue  # a rule reward runs in the driver
        out[role] = rcfg.get("pool") or pools[0]
    timed = set(phases(rows))
    if "critic" not in out and timed & {"values", "update_critic"} and "actor" in out:
        out["critic"] = out["actor"]
    return out


def device_time(config: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Seconds each pool's devices spent in each phase over the run, plus ``idle``; the ``driver`` row holds
    the phases that use no device (data, rule rewards, advantages) and the step time no phase covers.
    Phases run one after another, so a pool's phases and its idle time add up to the run's wall time."""
    wall = _total(rows, "timing/step")
    placed = role_pools(config, rows)
    pool_names = list(config.get("pools") or {}) or sorted(set(placed.values()))
    out: dict[str, dict[str, float]] = {pool: {} for pool in pool_names if pool in placed.values()}
    driver: dict[str, float] = {}
    for phase in phases(rows):
        seconds = _total(rows, f"timing/{phase}")
        pools = {placed[r] for r in PHASE_ROLES.get(phase, ()) if r in placed}
        if not pools:
            driver[phase] = driver.get(phase, 0.0) + seconds
        for pool in pools:
            out.setdefault(pool, {})[phase] = seconds
    for spent in out.values():
        spent[IDLE] = max(0.0, wall - sum(spent.values()))
    timed = sum(_total(rows, f"timing/{p}") for p in phases(rows))
    driver["untimed"] = max(0.0, wall - timed)
    out[DRIVER] = driver
    return out


def pool_sizes(config: dict[str, Any]) -> dict[str, int]:
    return {name: int(p.get("nodes", 1)) * int(p.get("devices_per_node", 1))
            for name, p in (config.get("pools") or {}).items()}


# --- summary -----------------------------------------------------------------------------------------

@dataclass
class Summary:
    steps: int
    last_step: int
    reward_first: float | None  # mean of reward/mean over the first (up to) 10 steps
    reward_last: float | None  # ... and over the last (up to) 10
    window: int
    median_step_s: float | None
    total_s: float
    phase_share: dict[str, float]  # share of the summed step time
    overhead_share: float | None  # share of step time outside model compute
    busy_share: dict[str, float]  # pool -> share of wall time its devices were busy
    mfu: float | None = None
    peak_memory_mb: dict[str, float] = field(default_factory=dict)
    val: dict[str, dict[str, float]] = field(default_factory=dict)  # val metric -> first, last, best, best_step


def validation_summary(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """First, last and best (highest) value of each top-level validation metric (``val/reward/mean``,
    ``val/pass@k``, ``val/best@k``), with the step of the best."""
    keys = sorted({k for row in rows for k in row
                   if (k.startswith("val/") and k.count("/") == 1) or k == "val/reward/mean"})
    out: dict[str, dict[str, float]] = {}
    for key in keys:
        steps, values = series(rows, key)
        if values:
            best = max(range(len(values)), key=values.__getitem__)
            out[key] = {"first": values[0], "first_step": float(steps[0]), "last": values[-1],
                        "last_step": float(steps[-1]), "best": values[best], "best_step": float(steps[best])}
    return out


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize(rows: list[dict[str, Any]], config: dict[str, Any]) -> Summary:
    _, reward = series(rows, "reward/mean")
    _, step_s = series(rows, "timing/step")
    window = min(10, len(reward))
    total = sum(step_s)
    shares = {p: _total(rows, f"timing/{p}") / total for p in phases(rows)} if total > 0 else {}
    compute_keys = sorted({k for row in rows for k in row if k.startswith("compute/")})
    if compute_keys and total > 0:
        overhead: float | None = max(0.0, 1.0 - sum(_total(rows, k) for k in compute_keys) / total)
    else:
        overhead = _mean(series(rows, "perf/overhead_fraction")[1])
    busy = {pool: 1.0 - spent.get(IDLE, 0.0) / total for pool, spent in device_time(config, rows).items()
            if pool != DRIVER} if total > 0 else {}
    peak_keys = sorted({k for r in rows for k in r if k.startswith("memory/") and k.endswith("/peak_mb")})
    memory = {k.split("/")[1]: max(series(rows, k)[1]) for k in peak_keys if series(rows, k)[1]}
    return Summary(
        steps=len(step_s) or len(rows), last_step=int(rows[-1]["step"]),
        reward_first=_mean(reward[:window]) if window else None,
        reward_last=_mean(reward[-window:]) if window else None, window=window,
        median_step_s=statistics.median(step_s) if step_s else None, total_s=total,
        phase_share=shares, overhead_share=overhead, busy_share=busy,
        mfu=_mean(series(rows, "perf/mfu")[1]), peak_memory_mb=memory, val=validation_summary(rows))


def _num(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def render_summary(s: Summary, plots: dict[str, str], config: dict[str, Any]) -> str:
    sizes = pool_sizes(config)
    overhead_pct = None if s.overhead_share is None else 100 * s.overhead_share
    lines = ["# Run summary", "",
             "| | |", "|---|---|",
             f"| steps | {s.steps} (last step {s.last_step}) |",
             f"| reward, first {s.window} steps | {_num(s.reward_first, '.4f')} |",
             f"| reward, last {s.window} steps | {_num(s.reward_last, '.4f')} |",
             f"| median step time | {_num(s.median_step_s, '.3f')} s |",
             f"| total step time | {s.total_s:.1f} s |",
             f"| overhead share (outside model compute) | {_num(overhead_pct, '.1f')} % |"]
    if s.mfu is not None:
        lines.append(f"| mean MFU | {100 * s.mfu:.1f} % |")
    if s.val:
        lines += ["", "## Validation", "", "| metric | first | last | best (step) |", "|---|---|---|---|"]
        lines += [f"| {key} | {v['first']:.4f} (step {v['first_step']:.0f}) | {v['last']:.4f} (step "
                  f"{v['last_step']:.0f}) | {v['best']:.4f} (step {v['best_step']:.0f}) |" for key, v in s.val.items()]
    lines += ["", "## Phase shares of step time", "", "| phase | share |", "|---|---|"]
    lines += [f"| {p} | {100 * v:.1f} % |" for p, v in sorted(s.phase_share.items(), key=lambda kv: -kv[1])]
    lines += ["", "## Device busy time", "", "| pool | devices | busy share |", "|---|---|---|"]
    lines += [f"| {pool} | {sizes.get(pool, '?')} | {100 * v:.1f} % |" for pool, v in s.busy_share.items()]
    if s.peak_memory_mb:
        lines += ["", "## Peak memory per role", "", "| role | MiB |", "|---|---|"]
        lines += [f"| {role} | {mb:.0f} |" for role, mb in s.peak_memory_mb.items()]
    lines += ["", "## Plots", ""]
    lines += [f"![{title}]({name})" for title, name in plots.items()]
    return "\n".join(lines) + "\n"


# --- plots -----------------------------------------------------------------------------------------

def _figure(width: float = 8.0, height: float = 4.0) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ReportError("hybridrl report needs matplotlib: pip install matplotlib (or 'hybridrl[plots]')") from exc
    return Figure(figsize=(width, height), dpi=100, layout="constrained")


def _integer_steps(ax: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_reward(rows: list[dict[str, Any]], path: Path) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    steps, mean = series(rows, "reward/mean")
    band = [r for r in rows
            if isinstance(r.get("reward/min"), (int, float)) and isinstance(r.get("reward/max"), (int, float))]
    if band:
        ax.fill_between([r["step"] for r in band], [r["reward/min"] for r in band], [r["reward/max"] for r in band],
                        alpha=0.2, label="min-max")
    ax.plot(steps, mean, label="mean")
    val_steps, val_mean = series(rows, "val/reward/mean")
    if val_mean:
        ax.plot(val_steps, val_mean, marker="o", label="validation mean")
    ax.set(xlabel="step", ylabel="reward", title="Reward")
    _integer_steps(ax)
    ax.legend(loc="best")
    fig.savefig(path)


def plot_response_length(rows: list[dict[str, Any]], path: Path) -> None:
    fig = _figure()
    ax = fig.add_subplot()
    for key, label in (("response_length/mean", "mean"), ("response_length/max", "max")):
        steps, values = series(rows, key)
        if values:
            ax.plot(steps, values, label=label)
    ax.set(xlabel="step", ylabel="tokens", title="Response length")
    _integer_steps(ax)
    ax.legend(loc="best")
    fig.savefig(path)


#: the episode metrics a multi-turn run logs (``hybridrl.environments.metrics``): rates on the left axis.
EPISODE_RATES = (("env/tool_use_rate", "tool-use rate"), ("env/truncated_rate", "truncated"),
                 ("env/tool_errors_mean", "tool errors / episode"))


def has_episodes(rows: list[dict[str, Any]]) -> bool:
    return any("env/turns_mean" in r for r in rows)


def plot_episodes(rows: list[dict[str, Any]], path: Path) -> None:
    """A multi-turn run's episodes over steps: tool-use and truncation rates, tool errors, and turns."""
    fig = _figure()
    ax = fig.add_subplot()
    for key, label in EPISODE_RATES:
        steps, values = series(rows, key)
        if values:
            ax.plot(steps, values, label=label)
    ax.set(xlabel="step", ylabel="rate", title="Episodes")
    turns_ax = ax.twinx()
    steps, turns = series(rows, "env/turns_mean")
    turns_ax.plot(steps, turns, color="black", linestyle="--", label="turns (mean)")
    turns_ax.set_ylabel("turns")
    _integer_steps(ax)
    lines, labels = ax.get_legend_handles_labels()
    more, more_labels = turns_ax.get_legend_handles_labels()
    ax.legend(lines + more, labels + more_labels, loc="best")
    fig.savefig(path)


def plot_phase_times(rows: list[dict[str, Any]], path: Path) -> None:
    """Stacked bars: each step's time split into its phases, and the part no phase covers."""
    fig = _figure(max(8.0, min(20.0, len(rows) * 0.15)), 4.5)
    ax = fig.add_subplot()
    steps = [int(r["step"]) for r in rows]
    bottom = [0.0] * len(rows)
    for phase in phases(rows):
        values = [float(r.get(f"timing/{phase}") or 0.0) for r in rows]
        ax.bar(steps, values, bottom=bottom, label=phase, width=0.8)
        bottom = [b + v for b, v in zip(bottom, values)]
    rest = [max(0.0, float(r.get("timing/step") or 0.0) - b) for r, b in zip(rows, bottom)]
    ax.bar(steps, rest, bottom=bottom, label="untimed", width=0.8, color="lightgrey")
    ax.set(xlabel="step", ylabel="seconds", title="Time per phase")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.savefig(path)


def plot_device_time(config: dict[str, Any], rows: list[dict[str, Any]], path: Path) -> None:
    """One horizontal bar per pool (and the driver): seconds in each phase, then idle."""
    spent = device_time(config, rows)
    sizes = pool_sizes(config)
    names = list(spent)
    fig = _figure(9.0, 1.2 + 0.6 * len(names))
    ax = fig.add_subplot()
    labels = [f"{n} ({sizes[n]} dev)" if n in sizes else n for n in names]
    all_phases = [p for p in phases(rows)] + ["untimed", IDLE]
    left = [0.0] * len(names)
    for phase in all_phases:
        values = [spent[n].get(phase, 0.0) for n in names]
        if not any(values):
            continue
        color = "lightgrey" if phase in (IDLE, "untimed") else None
        ax.barh(labels, values, left=left, label=phase, color=color, hatch="//" if phase == IDLE else None)
        left = [a + v for a, v in zip(left, values)]
    ax.invert_yaxis()
    ax.set(xlabel="seconds over the run", title="Where each pool's devices spent the run")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
    fig.savefig(path)


# --- the report ----------------------------------------------------------------------------------

PLOTS = {"reward": "reward.png", "response length": "response_length.png", "time per phase": "phase_times.png",
         "device time": "device_time.png"}
EPISODES_PLOT = "episodes.png"  # multi-turn runs only


def run_timeline(run: str | Path, step: int | None, rows: list[dict[str, Any]]) -> tuple[Any, int] | None:
    """The run's spans (with the sampled busy fractions of its metric ``rows``) and the step to draw (``step``,
    default the last), or None for a run without spans (an older run) when no step was asked for; a step asked of
    a run without it is a ``ReportError``."""
    from hybridrl.observe.timeline import RunSpans, TimelineError, missing_spans

    if step is None and missing_spans(run) is not None:
        return None
    try:
        spans = RunSpans.read(run, rows)
        return spans, spans.pick(step, run)
    except TimelineError as exc:
        raise ReportError(str(exc)) from None


def render_timeline(timeline: dict[str, Any]) -> str:
    lines = ["", f"## Device timeline (step {timeline['step']}, {timeline['step_s']:.3f} s)", "",
             "| device | busy this step | busy over the run: mean (min-max) |", "|---|---|---|"]
    lines += [f"| {label} | {100 * d['busy_step']:.1f} % | {100 * d['busy_mean']:.1f} % "
              f"({100 * d['busy_min']:.0f}-{100 * d['busy_max']:.0f} %) |" for label, d in timeline["devices"].items()]
    return "\n".join(lines) + "\n"


def write_report(run: str | Path, out: str | Path | None = None, step: int | None = None) -> list[Path]:
    """Write the plots, ``summary.md`` and ``summary.json`` into ``out`` (default ``RUN/report``); with the run's
    ``spans.jsonl``, the device timeline of ``step`` (default the last) too."""
    from hybridrl.observe.timeline import TIMELINE_PLOT, plot_timeline, timeline_summary

    rows = load_metrics(run)
    config = load_run_config(run)
    timeline = run_timeline(run, step, rows)  # before anything is written: a missing step is refused
    out_dir = Path(out) if out is not None else Path(run) / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {name: out_dir / name for name in PLOTS.values()}
    plot_reward(rows, paths["reward.png"])
    plot_response_length(rows, paths["response_length.png"])
    plot_phase_times(rows, paths["phase_times.png"])
    plot_device_time(config, rows, paths["device_time.png"])
    plots = dict(PLOTS)
    if has_episodes(rows):  # a multi-turn run
        plots["episodes"] = EPISODES_PLOT
        paths[EPISODES_PLOT] = out_dir / EPISODES_PLOT
        plot_episodes(rows, paths[EPISODES_PLOT])
    extra: dict[str, Any] = {}
    if timeline is not None:
        spans, chosen = timeline
        plots["device timeline"] = TIMELINE_PLOT
        paths[TIMELINE_PLOT] = out_dir / TIMELINE_PLOT
        plot_timeline(spans, chosen, paths[TIMELINE_PLOT], _figure)
        extra["timeline"] = timeline_summary(spans, chosen)
    summary = summarize(rows, config)
    text = render_summary(summary, plots, config)
    if "timeline" in extra:
        head, _, tail = text.partition("\n## Plots")
        text = head.rstrip("\n") + "\n" + render_timeline(extra["timeline"]) + "\n## Plots" + tail
    (out_dir / "summary.md").write_text(text)
    (out_dir / "summary.json").write_text(json.dumps({**asdict(summary), "device_seconds": device_time(config, rows),
                                                      **extra}, indent=2) + "\n")
    return [*paths.values(), out_dir / "summary.md", out_dir / "summary.json"]
