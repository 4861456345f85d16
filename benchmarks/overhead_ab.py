"""The quick start's step time, this checkout against another one (a baseline commit), measured side by side.

Runs ``benchmarks/overhead.py`` of each checkout with each checkout's own Python (a virtualenv where that
checkout is installed), in turns - A B, B A, A B ... - so both see the same machine load, and reads every step's
``timing/step`` from the runs' ``metrics.jsonl``. Reports the median step of each side over all their measured
steps, the ratio of those medians, and the ratio of each round's pair of medians (a loaded machine drifts:
pairs taken close in time keep the ratio honest). Writes JSON.

    git clone --shared . /tmp/base && git -C /tmp/base checkout <commit>   # and a venv with it installed
    python benchmarks/overhead_ab.py --baseline /tmp/base --baseline-python /path/venv/bin/python \
        [--rounds 3] [--steps 12] [--skip 2] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_side(root: Path, python: str, steps: int, skip: int, out_dir: Path, overrides: list[str],
             attempts: int = 3) -> list[float]:
    """One quick-start run of ``root``'s overhead benchmark; the step seconds after the warm-up. A run that
    fails is started again (on a loaded machine Ray's start-up can time out), ``attempts`` times at most."""
    cmd = [python, str(root / "benchmarks" / "overhead.py"), "--steps", str(steps), "--skip", str(skip),
           "--out", str(out_dir.with_suffix(".json")), f"trainer.out={out_dir}", *overrides]
    for attempt in range(1, attempts + 1):
        shutil.rmtree(out_dir, ignore_errors=True)
        done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
        if done.returncode == 0:
            break
        print(f"attempt {attempt}/{attempts} of {root.name} failed ({done.returncode}): "
              f"{done.stderr.strip().splitlines()[-1:] or ''}", flush=True)
    else:
        sys.exit(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [float(r["timing/step"]) for r in rows if "timing/step" in r][skip:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the other checkout (its own benchmarks/overhead.py)")
    parser.add_argument("--baseline-python", required=True, help="a Python where the baseline is installed")
    parser.add_argument("--this", default=str(ROOT), help="the checkout measured against the baseline "
                        "(default: this one)")
    parser.add_argument("--python", default=sys.executable, help="a Python where that checkout is installed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="warm-up steps of each run left out")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "overhead_ab_cpu.json"))
    parser.add_argument("overrides", nargs="*", help="config overrides given to both sides")
    args = parser.parse_args()

    baseline, this = Path(args.baseline).resolve(), Path(args.this).resolve()
    commit = {side: subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                                   text=True).stdout.strip() for side, path in (("this", this), ("baseline", baseline))}
    sides = {"this": (this, args.python), "baseline": (baseline, args.baseline_python)}
    steps: dict[str, list[float]] = {"this": [], "baseline": []}
    rounds = []
    work = Path(tempfile.mkdtemp(prefix="overhead-ab-"))
    t0 = time.perf_counter()
    try:
        for r in range(args.rounds):
            order = ["baseline", "this"] if r % 2 == 0 else ["this", "baseline"]
            medians = {}
            for side in order:
                root, python = sides[side]
                got = run_side(root, python, args.steps, args.skip, work / f"{side}-{r}", args.overrides)
                steps[side] += got
                medians[side] = statistics.median(got)
                print(f"round {r + 1}/{args.rounds} {side:<8} median step {medians[side]:.3f}s "
                      f"({len(got)} steps)", flush=True)
            rounds.append({"order": order, "median_step_s": medians,
                           "speedup": medians["baseline"] / medians["this"]})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = {side: statistics.median(values) for side, values in steps.items()}
    result = {
        "what": "quick start (examples/quickstart.yaml) median step, side by side, runs interleaved",
        "commits": commit, "overrides": args.overrides, "rounds": rounds,
        "steps_per_run": args.steps, "warmup_steps_left_out": args.skip,
        "median_step_s": median, "step_s": steps,
        "speedup_of_medians": median["baseline"] / median["this"],
        "speedup_median_of_rounds": statistics.median(r["speedup"] for r in rounds),
        "wall_seconds": time.perf_counter() - t0,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"median step: baseline {commit['baseline']} {median['baseline']:.3f}s, this {commit['this']} "
          f"{median['this']:.3f}s -> {result['speedup_of_medians']:.2f}x "
          f"(median of the rounds' ratios {result['speedup_median_of_rounds']:.2f}x)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
