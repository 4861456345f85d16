"""Do groups in flight and pipelined steps still learn? Reward curves of the synchronous step (several seeds, for
the seed-to-seed spread) against partial rollouts and pipelined steps at staleness bounds 1 and 2, on CPU, for
the quick start (3-token responses) and the long-tailed copy task (``examples/long-tail.yaml``, 1 to 64 tokens).

Arms (each ``hybridrl train CONFIG`` with the arm's keys and ``trainer.seed``):

* ``sync``: the config as it is, one run per seed;
* ``partial_s1`` / ``partial_s2``: ``roles.rollout.oversample=1.5`` (partial rollouts on), ``trainer.max_staleness``
  1 / 2: a step trains the first groups to complete and resumes the rest under the next weights;
* ``pipelined_s1`` / ``pipelined_s2``: the rollout on a pool of its own generates the next batch while the actor
  trains (``trainer.pipelined``), weights sent every 1 / 2 updates (``trainer.sync_every``), batches up to 1 / 2
  updates old;
* ``refill_s2``: ``partial_s2`` with refill (the engine keeps 1.5 x the step's groups decoding, starting a waiting
  group as each one completes).

Every step's reward goes to ``benchmarks/results/long_tail_cpu.json`` (with each run's first- and last-10 mean,
its version lag and step time) and the curves to ``long_tail_cpu.png``. ``tests/e2e/test_long_tail_learns.py``
runs this script and checks each arm against the synchronous seeds' spread (``within_spread``).

    python benchmarks/long_tail_cpu.py [--tasks quickstart,long-tail] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: task -> (config, steps): enough steps for the curves to have risen clearly, few enough for minutes of CPU
TASKS = {"quickstart": ("examples/quickstart.yaml", 150), "long-tail": ("examples/long-tail.yaml", 40)}
PARTIAL = ["roles.rollout.oversample=1.5", "roles.rollout.partial=true"]
#: a second pool for the rollout (the actor and reference keep theirs): what trainer.pipelined needs
PIPELINED = ["trainer.pipelined=true", "pools.gen={nodes: 1, devices_per_node: 1}", "roles.rollout.pool=gen",
             "cluster.device=cpu", "cluster.devices_per_node=2"]
ARMS = {
    "sync": [],
    "partial_s1": [*PARTIAL, "trainer.max_staleness=1"],
    "partial_s2": [*PARTIAL, "trainer.max_staleness=2"],
    "pipelined_s1": [*PIPELINED, "trainer.max_staleness=1"],
    "pipelined_s2": [*PIPELINED, "trainer.max_staleness=2", "trainer.sync_every=2"],
    "refill_s2": [*PARTIAL, "roles.rollout.refill=true", "trainer.max_staleness=2"],
}
WINDOW = 10  # steps averaged for a run's first and final reward


def run(task: str, arm: str, seed: int, steps: int, work: Path) -> dict[str, Any]:
    """One training run; its per-step rewards and the figures the checks read."""
    config = TASKS[task][0]
    out = work / f"{task}-{arm}-{seed}"
    keys = [f"trainer.steps={steps}", f"trainer.seed={seed}", *ARMS[arm]]
    cmd = [sys.executable, "-m", "hybridrl.cli", "train", config, *keys, f"trainer.out={out}",
           "trainer.progress=false", "trainer.trackers=[jsonl]"]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    metrics = out / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    rewards = [r["reward/mean"] for r in rows]
    lags = [r.get("async/version_lag_max", r.get("async/staleness", 0.0)) for r in rows]
    return {"task": task, "arm": arm, "seed": seed, "ok": proc.returncode == 0 and len(rows) == steps,
            "command": " ".join(["hybridrl", "train", config, *keys]), "wall_s": round(wall, 1),
            "step_s_median": statistics.median(r["timing/step"] for r in rows) if rows else None,
            "reward": rewards, "response_length": [r["response_length/mean"] for r in rows],
            "first10": statistics.mean(rewards[:WINDOW]) if rewards else None,
            "last10": statistics.mean(rewards[-WINDOW:]) if rewards else None,
            "version_lag_max": max(lags) if lags else None,
            "version_lag_mean": statistics.mean(lags) if lags else None,
            "log_tail": "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-3000:]}


def within_spread(runs: list[dict[str, Any]], task: str, floor: float = 0.05) -> dict[str, Any]:
    """The synchronous seeds' range of final (last-10) rewards, widened on each side by its own width (at least
    ``floor``): with three seeds the bare range would miss a fourth draw half the time. Each other arm's final
    reward is checked against it."""
    finals = [r["last10"] for r in runs if r["task"] == task and r["arm"] == "sync" and r["ok"]]
    if len(finals) < 2:
        raise ValueError(f"{task}: the spread needs at least two synchronous seeds, got {len(finals)}")
    lo, hi = min(finals), max(finals)
    tol = max(hi - lo, floor)
    arms = {f"{r['arm']}/{r['seed']}": {"last10": r["last10"],
                                        "within": r["ok"] and lo - tol <= r["last10"] <= hi + tol}
            for r in runs if r["task"] == task and r["arm"] != "sync"}
    return {"sync_last10": finals, "band": [lo - tol, hi + tol], "arms": arms}


def plot(runs: list[dict[str, Any]], tasks: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.2), squeeze=False)
    colours = dict(zip(ARMS, ("tab:blue", "tab:orange", "tab:red", "tab:green", "tab:purple", "tab:brown")))
    for ax, task in zip(axes[0], tasks):
        for r in (r for r in runs if r["task"] == task):
            sync = r["arm"] == "sync"
            ax.plot(r["reward"], color=colours[r["arm"]], alpha=0.5 if sync else 0.9, lw=1.0 if sync else 1.4,
                    label=f"{r['arm']} (seed {r['seed']})")
        ax.set_title(f"{task} ({TASKS[task][0]})")
        ax.set_xlabel("step")
        ax.set_ylabel("reward/mean")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the synchronous arm (the others run the first)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--steps", type=int, default=None, help="default: each task's own (TASKS)")
    parser.add_argument("--out", type=Path, default=RESULTS / "long_tail_cpu.json")
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    tasks, arms, seeds = args.tasks.split(","), args.arms.split(","), [int(s) for s in args.seeds.split(",")]
    work = Path(tempfile.mkdtemp(prefix="long-tail-cpu-"))
    runs: list[dict[str, Any]] = []
    result: dict[str, Any] = {"window": WINDOW, "runs": runs, "spread": {}}
    for task in tasks:
        steps = args.steps or TASKS[task][1]
        for arm in arms:
            for seed in seeds if arm == "sync" else seeds[:1]:
                runs.append(run(task, arm, seed, steps, work))
                print(json.dumps({k: runs[-1][k] for k in ("task", "arm", "seed", "ok", "wall_s", "step_s_median",
                                                           "first10", "last10", "version_lag_max")}), flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(result, indent=1))
        if "sync" in arms and len(seeds) > 1:
            result["spread"][task] = within_spread(runs, task)
            print(json.dumps({task: result["spread"][task]}), flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    if not args.no_plot:
        plot(runs, tasks, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
