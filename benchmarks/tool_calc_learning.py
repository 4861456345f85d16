"""Does the CPU tool task learn? One ``hybridrl train examples/tool-calc.yaml`` run (or a finished run folder),
summarised: reward and tool-use rate over the first and the last 10 steps, the curve in blocks of 10 steps, and
the reward and episode plots of ``hybridrl report``. JSON goes to ``--out``, the plots beside it.

    python benchmarks/tool_calc_learning.py --out benchmarks/results/tool_calc_learning.json
    python benchmarks/tool_calc_learning.py --run runs/tool-calc --out benchmarks/results/tool_calc_learning.json
    python benchmarks/tool_calc_learning.py trainer.steps=100 environment.options.call_syntax=expression   # overrides

Minutes to hours on 2 shared CPU cores (the step is ~10-40 s there); ``tests/e2e/test_tool_episodes.py`` has the
short CI check and the slow learning test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tool-calc.yaml"
KEYS = {"reward": "reward/mean", "tool_use_rate": "env/tool_use_rate", "turns": "env/turns_mean",
        "call_reward": "reward/env_call_mean", "answer_reward": "reward/env_answer_mean"}


def mean(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return round(sum(values) / len(values), 4) if values else None


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """First and last 10 steps, and every block of 10, of each of ``KEYS``."""
    first, last = rows[:10], rows[-10:]
    blocks = [rows[i:i + 10] for i in range(0, len(rows), 10)]
    return {
        "steps": len(rows),
        "first_10": {name: mean(first, key) for name, key in KEYS.items()},
        "last_10": {name: mean(last, key) for name, key in KEYS.items()},
        "median_step_s": round(statistics.median(float(r["timing/step"]) for r in rows), 2),
        "curve_per_10_steps": {name: [mean(b, key) for b in blocks] for name, key in
                               (("reward", KEYS["reward"]), ("tool_use_rate", KEYS["tool_use_rate"]))},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", default=None, help="summarise this finished run folder instead of training")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tool_calc_learning.json"))
    parser.add_argument("--command", default=None, help="with --run: the command that trained it (recorded)")
    parser.add_argument("--train-out", default=str(ROOT / "runs" / "tool-calc-learning"))
    parser.add_argument("overrides", nargs="*", help="dotted config overrides for the run")
    args = parser.parse_args()

    from hybridrl.observe.report import load_metrics, write_report

    wall = None
    if args.run is None:
        run = Path(args.train_out)
        cmd = [sys.executable, "-m", "hybridrl.cli", "train", str(EXAMPLE.relative_to(ROOT)), f"trainer.out={run}",
               "trainer.progress=false", "trainer.trackers=[jsonl]", *args.overrides]
        command = " ".join(["hybridrl", *cmd[3:]])
        start = time.perf_counter()
        subprocess.run(cmd, cwd=ROOT, check=True)
        wall = round(time.perf_counter() - start, 1)
    else:
        run, command = Path(args.run), args.command
    rows = load_metrics(run)
    result: dict[str, Any] = {"example": str(EXAMPLE.relative_to(ROOT)), "command": command, "wall_s": wall,
                              "run": str(run), **summarise(rows)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = write_report(run)
    for path in report:
        if path.name in ("reward.png", "episodes.png"):
            shutil.copyfile(path, out.with_name(f"{out.stem}_{path.name}"))
    print(json.dumps(result, indent=2))
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
