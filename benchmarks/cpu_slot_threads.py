"""How a CPU slot's phases change with its torch threads: whether a slot of a two-slot map loses by its one thread.

A run gives each CPU slot ``cores // slots`` torch threads (``hybridrl.runtime.launch``), so a map of two slots on a
2-core machine computes each phase on one thread where a profile of one slot had two; the advisor's cost model
does not scale a phase by its threads. This trains the quick start as it is (one slot) with
``cluster.threads_per_worker`` = each of ``--threads`` (default 1 and the machine's cores), the arms back to back
``--rounds`` times, and fits the exponent ``b`` of ``seconds(t) = seconds(T) x (T / t) ** b`` over the device
phases (generation, reference, update: their summed seconds, the steady steps' mean). ``b`` = 1 is a phase that
scales with its threads, 0 one that does not (the model's assumption).

    python benchmarks/cpu_slot_threads.py --rounds 3      # 3 minutes on 2 cores; writes cpu_slot_threads.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from advice_validation import run_arm  # noqa: E402  (benchmarks/: no package)

#: the phases that run on the slot's device (the driver's work does not change with its threads)
DEVICE_PHASES = ("gen", "ref", "update_actor")


def exponent(seconds: dict[int, float]) -> float:
    """``b`` of ``seconds(t) = seconds(T) x (T / t) ** b`` through the fewest and the most threads measured."""
    few, most = min(seconds), max(seconds)
    return math.log(seconds[few] / seconds[most]) / math.log(most / few)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="examples/quickstart.yaml")
    parser.add_argument("--threads", default=f"1,{os.cpu_count() or 2}", help="comma-separated thread counts")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(HERE / "results" / "cpu_slot_threads.json"))
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    threads = sorted({int(t) for t in args.threads.split(",")})
    if len(threads) < 2:
        raise SystemExit("cpu_slot_threads: --threads needs two counts or more")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="slot-threads-"))
    start = time.perf_counter()
    arms: dict[int, list[dict[str, Any]]] = {t: [] for t in threads}
    for n in range(1, args.rounds + 1):
        for t in threads:
            arm = run_arm(Path(args.config), [f"cluster.threads_per_worker={t}", "cluster.device=cpu"], args.steps,
                          args.skip, workdir / f"threads{t}_round{n}", 600.0)
            if "error" in arm:
                raise SystemExit(f"cpu_slot_threads: {t} thread(s), round {n}: {arm['error']}")
            arms[t].append(arm)
            print(f"  {t} thread(s) round {n}: {arm['mean_step_s']:.3f} s a step", flush=True)
    phases = {t: {p: statistics.fmean(a["phases_s"].get(p, 0.0) for a in runs) for p in DEVICE_PHASES}
              for t, runs in arms.items()}
    device_s = {t: sum(ph.values()) for t, ph in phases.items()}
    result = {
        "benchmark": "cpu_slot_threads", "machine": f"cpu {os.cpu_count()} cores ({platform.machine()})",
        "command": " ".join(["python", "benchmarks/cpu_slot_threads.py", *sys.argv[1:]]),
        "config": args.config, "steps": args.steps, "skip": args.skip, "rounds": args.rounds,
        "step_s": {str(t): round(statistics.fmean(a["mean_step_s"] for a in runs), 4) for t, runs in arms.items()},
        "round_step_s": {str(t): [round(a["mean_step_s"], 4) for a in runs] for t, runs in arms.items()},
        "phases_s": {str(t): {p: round(v, 4) for p, v in ph.items()} for t, ph in phases.items()},
        "phase_exponent": {p: round(exponent({t: phases[t][p] for t in threads}), 3) for p in DEVICE_PHASES},
        "exponent": round(exponent(device_s), 3),
        "wall_s": round(time.perf_counter() - start, 1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("step_s", "phase_exponent", "exponent")}))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
