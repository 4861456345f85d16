"""What running rule rewards in a process pool costs against running them inline in the driver.

Also holds the rule reward of the step benchmark (``bench_reward:digit_share``): the share of digits in the
response (any cheap deterministic function of the text would do there; that benchmark measures compute).

Two measurements, written to ``benchmarks/results/reward_pool.json``:

- ``micro``: one quick-start batch (16 prompts x 16 samples of the reverse task, 2-3 character responses)
  scored by ``InlineRunner`` and by ``ProcessRunner`` with 1 and 2 workers, the median over ``--reps`` calls;
  and a reward that costs ``--work-ms`` per call, where the pool's parallelism can pay for its hop;
- ``train``: the quick start itself (``hybridrl``'s real trainer, ``--steps`` steps) with
  ``roles.reward.runner=inline`` and ``=process``: the median ``timing/reward`` and ``timing/step``.

    python benchmarks/bench_reward.py [--steps 30] [--reps 50] [--skip-train]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def digit_share(prompt: str, response: str, **_: object) -> float:
    return sum(c.isdigit() for c in response) / max(len(response), 1)


def busy_reward(prompt: str, response: str, work_ms: float = 2.0, **_: object) -> float:
    """A reward that computes for ``work_ms`` (a stand-in for a parser or a symbolic check)."""
    end = time.perf_counter() + work_ms / 1000
    x = 0
    while time.perf_counter() < end:
        x += 1
    return float(len(response))


def quickstart_items() -> list[tuple[str, str, dict[str, Any]]]:
    """16 prompts x 16 samples of the reverse task with responses as an early policy writes them."""
    import random

    from hybridrl.tasks.reverse import make_reverse_rows

    rng = random.Random(0)
    rows = make_reverse_rows(2, count=16, seed=0)
    items = []
    for row in rows:
        for _ in range(16):
            response = "".join(rng.choice("0123456789 ab") for _ in range(rng.randint(2, 3)))
            items.append((row["prompt"], response, {"answer": row["answer"], "ground_truth": row["answer"]}))
    return items


def time_runner(runner: Any, items: list, reps: int) -> float:
    runner.run(items)  # warm
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        runner.run(items)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def micro(reps: int, work_ms: float) -> dict[str, float]:
    from hybridrl.rewards.rules import RuleSpec, Term
    from hybridrl.rewards.runner import InlineRunner, ProcessRunner

    items = quickstart_items()
    out: dict[str, float] = {"items": float(len(items))}
    cheap = RuleSpec((Term("reverse", "hybridrl.tasks.reverse:reverse_reward"),))
    busy = RuleSpec((Term("busy", "bench_reward:busy_reward", args={"work_ms": work_ms}),))
    busy_items = items[:64]
    out["busy_items"] = float(len(busy_items))
    out["busy_work_ms"] = work_ms
    cases = (("reverse", cheap, items, reps), ("busy", busy, busy_items, max(3, reps // 10)))
    for name, spec, batch, batch_reps in cases:
        out[f"{name}_inline_s"] = time_runner(InlineRunner(spec), batch, batch_reps)
        for workers in (1, 2):
            start = time.perf_counter()
            pool = ProcessRunner(spec, workers, timeout_s=10.0).start()
            out[f"pool_start_{workers}w_s"] = time.perf_counter() - start
            try:
                out[f"{name}_pool_{workers}w_s"] = time_runner(pool, batch, batch_reps)
            finally:
                pool.close()
    return out


def train(steps: int, skip: int) -> dict[str, dict[str, float]]:
    """The quick start through the real trainer, once per runner."""
    from hybridrl.config import load_config
    from hybridrl.plugins.discovery import get_registry
    from hybridrl.run.preflight import prepare_run
    from hybridrl.run.trainer import Trainer
    from hybridrl.runtime.cluster import detect_cluster

    results: dict[str, dict[str, float]] = {}
    for runner in ("inline", "process"):
        cfg = load_config(ROOT / "examples" / "quickstart.yaml",
                          [f"trainer.steps={steps}", "trainer.progress=false", "trainer.trackers=[jsonl]",
                           f"trainer.out=runs/bench-reward-{runner}", "trainer.resume=never",
                           f"roles.reward.runner={runner}"])
        trainer = Trainer(prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster)))
        try:
            trainer.start()
            history = trainer.fit()
        finally:
            trainer.shutdown()
        rows = history[skip:]
        results[runner] = {
            "steps": float(len(rows)),
            "reward_s_median": statistics.median(r["timing/reward"] for r in rows),
            "step_s_median": statistics.median(r["timing/step"] for r in rows),
            "reward_share_median": statistics.median(r["timing/reward"] / r["timing/step"] for r in rows),
            "reward_last10": statistics.mean(r["reward/mean"] for r in history[-10:]),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--work-ms", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the train figures")
    parser.add_argument("--skip-train", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "reward_pool.json"))
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))  # the pool's processes import bench_reward:busy_reward
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])

    result: dict[str, Any] = {"cpus": os.cpu_count(), "load_avg_1m_start": os.getloadavg()[0]}
    result["micro"] = micro(args.reps, args.work_ms)
    m = result["micro"]
    print(f"one quick-start batch ({int(m['items'])} responses, reverse reward): "
          f"inline {1e3 * m['reverse_inline_s']:.2f} ms, "
          f"pool 1 worker {1e3 * m['reverse_pool_1w_s']:.2f} ms, 2 workers {1e3 * m['reverse_pool_2w_s']:.2f} ms "
          f"(pool start {m['pool_start_2w_s']:.2f} s)")
    print(f"{int(m['busy_items'])} responses at {m['busy_work_ms']:g} ms each: "
          f"inline {1e3 * m['busy_inline_s']:.1f} ms, "
          f"pool 1 worker {1e3 * m['busy_pool_1w_s']:.1f} ms, 2 workers {1e3 * m['busy_pool_2w_s']:.1f} ms")
    if not args.skip_train:
        result["train"] = train(args.steps, args.skip)
        for runner, t in result["train"].items():
            print(f"quick start, runner={runner}: timing/reward {1e3 * t['reward_s_median']:.2f} ms "
                  f"({100 * t['reward_share_median']:.2f} % of the step), timing/step {t['step_s_median']:.3f} s, "
                  f"last-10 reward {t['reward_last10']:.3f}")
    result["load_avg_1m_end"] = os.getloadavg()[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
