"""How much of a quick-start step is spent outside model compute.

Runs the quick start (or any config) through the real trainer and splits each step's wall time into model
compute inside the workers (generation, log-prob and update passes, timed around the engine calls) and
everything else: dispatch, serialisation, resharding, rewards, data handling. Prints a table and writes JSON.

    python benchmarks/overhead.py [--steps 30] [--skip 3] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

from hybridrl.config import load_config
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.preflight import prepare_run
from hybridrl.run.trainer import Trainer
from hybridrl.runtime.cluster import detect_cluster

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "examples" / "quickstart.yaml"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the figures")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "overhead.json"))
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    cfg = load_config(args.config, [f"trainer.steps={args.steps}", "trainer.progress=false",
                                    "trainer.trackers=[jsonl]", "trainer.out=runs/bench-overhead", *args.overrides])
    shutil.rmtree(cfg.trainer.out, ignore_errors=True)  # a new run each time (a folder holding an old one is refused)
    trainer = Trainer(prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster)))
    try:
        trainer.start()
        t0 = time.perf_counter()
        history = trainer.fit()
        wall = time.perf_counter() - t0
    finally:
        trainer.shutdown()
    steps = history[args.skip:] or history
    step_s = [m["timing/step"] for m in steps]
    compute_s = [sum(v for k, v in m.items() if k.startswith("compute/")) for m in steps]
    phases = sorted({k for m in steps for k in m if k.startswith("timing/") and k != "timing/step"})
    result = {
        "config": args.config, "overrides": args.overrides, "steps_measured": len(steps),
        "step_seconds_median": statistics.median(step_s),
        "compute_seconds_median": statistics.median(compute_s),
        "overhead_fraction": 1.0 - sum(compute_s) / sum(step_s),
        "overhead_seconds_per_step": (sum(step_s) - sum(compute_s)) / len(steps),
        "phase_seconds_median": {p.removeprefix("timing/"): statistics.median(m.get(p, 0.0) for m in steps)
                                 for p in phases},
        "wall_seconds": wall,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'phase':<16}{'median s':>10}")
    for phase, sec in result["phase_seconds_median"].items():
        print(f"{phase:<16}{sec:>10.4f}")
    print(f"step median {result['step_seconds_median']:.3f}s, model compute median "
          f"{result['compute_seconds_median']:.3f}s")
    print(f"outside model compute: {100 * result['overhead_fraction']:.1f}% of step time "
          f"({result['overhead_seconds_per_step'] * 1000:.0f} ms/step); target < 15%")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
