"""The quick start with a Megatron actor and reference: does it learn, and how long is a step?

    python plugins/megatron/benchmarks/quickstart.py --tp 2            # runs it (about 300 steps)
    python plugins/megatron/benchmarks/quickstart.py --summarize RUNDIR # summarises a finished run

Prints and writes ``plugins/megatron/benchmarks/results/quickstart_tp{T}_pp{P}.json``: mean reward of the
first and last 10 steps, median step time and median time of every phase.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
RESULTS = Path(__file__).with_name("results")


def summarize(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["reward/mean"] for r in rows]
    phases = sorted({k for r in rows for k in r if k.startswith("timing/")})
    return {
        "run": str(run), "steps": len(rows),
        "reward_first10": statistics.fmean(rewards[:10]), "reward_last10": statistics.fmean(rewards[-10:]),
        "step_seconds_median": statistics.median(r["timing/step"] for r in rows),
        "phase_seconds_median": {k.removeprefix("timing/"): statistics.median(r[k] for r in rows if k in r)
                                 for k in phases},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--summarize", type=Path, help="summarise this finished run instead of training")
    args = parser.parse_args()
    world = args.tp * args.pp
    run = args.summarize or ROOT / "runs" / f"megatron-quickstart-tp{args.tp}-pp{args.pp}"
    wall = None
    if args.summarize is None:
        cmd = ["hybridrl", "train", str(ROOT / "examples" / "quickstart.yaml"), "roles.actor.backend=megatron",
               "roles.ref.backend=megatron", f"roles.actor.options.tensor_parallel={args.tp}",
               f"roles.actor.options.pipeline_parallel={args.pp}", f"pools.main.devices_per_node={world}",
               f"trainer.steps={args.steps}", f"trainer.out={run}", "trainer.progress=false"]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT)
        wall = time.perf_counter() - start
    result = {**summarize(run), "tensor_parallel": args.tp, "pipeline_parallel": args.pp, "wall_seconds": wall}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"quickstart_tp{args.tp}_pp{args.pp}.json"
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(f"written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
