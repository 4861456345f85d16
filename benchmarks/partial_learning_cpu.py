"""Does the quick start still learn with groups in flight? Reward curves of the synchronous step against
oversampling with partial rollouts (staleness bound 1 and 2), over several seeds, on CPU.

Each arm runs ``hybridrl train examples/quickstart.yaml`` with its keys and ``trainer.seed``; the reward of
every step goes to ``benchmarks/results/partial_learning_cpu.json`` (with the mean of the first and last 10 steps
per run) and the curves to ``partial_learning_cpu.png``.

    python benchmarks/partial_learning_cpu.py [--steps 120] [--seeds 0,1]
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

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ARMS = {
    "sync": [],
    "oversample_1.5": ["roles.rollout.oversample=1.5"],
    "oversample_1.5_staleness_2": ["roles.rollout.oversample=1.5", "trainer.max_staleness=2"],
}


def run(arm: str, seed: int, steps: int, work: Path) -> dict:
    out = work / f"{arm}-{seed}"
    cmd = [sys.executable, "-m", "hybridrl.cli", "train", str(ROOT / "examples" / "quickstart.yaml"),
           f"trainer.steps={steps}", f"trainer.seed={seed}", f"trainer.out={out}", "trainer.progress=false",
           "trainer.trackers=[jsonl]", *ARMS[arm]]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - start
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()] \
        if (out / "metrics.jsonl").exists() else []
    rewards = [r["reward/mean"] for r in rows]
    return {"arm": arm, "seed": seed, "ok": proc.returncode == 0 and len(rows) == steps, "wall_s": wall,
            "command": " ".join(["hybridrl", "train", "examples/quickstart.yaml", *cmd[5:]]), "reward": rewards,
            "first10": statistics.mean(rewards[:10]) if rewards else None,
            "last10": statistics.mean(rewards[-10:]) if rewards else None,
            "version_lag_mean": statistics.mean(r.get("async/version_lag_mean", 0.0) for r in rows) if rows else None,
            "log_tail": "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-3000:]}


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colours = dict(zip(ARMS, ("tab:blue", "tab:orange", "tab:green")))
    for r in runs:
        ax.plot(r["reward"], color=colours[r["arm"]], alpha=0.8, label=f"{r['arm']} (seed {r['seed']})")
    ax.set_xlabel("step")
    ax.set_ylabel("reward/mean")
    ax.set_title("quick start: synchronous against groups in flight")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", type=Path, default=RESULTS / "partial_learning_cpu.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="partial-learning-"))
    runs = []
    for arm in args.arms.split(","):
        for seed in [int(s) for s in args.seeds.split(",")]:
            runs.append(run(arm, seed, args.steps, work))
            print(json.dumps({k: runs[-1][k] for k in ("arm", "seed", "ok", "wall_s", "first10", "last10",
                                                       "version_lag_mean")}), flush=True)
            args.out.write_text(json.dumps({"steps": args.steps, "runs": runs}, indent=2))
    plot(runs, args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
