"""Reasoning-length RL, as a benchmark: GRPO steps with long, ragged responses, one arm per scheduling mode.

The workload: 64 prompts x 8 samples, 256-token prompts, each response's length drawn from a lognormal with median
512 tokens and sigma 1.0, capped at 4096 (``roles.rollout.response_lengths`` with ``ignore_eos``: seeded, so
every arm decodes the same lengths). ``--workload standard`` is the fixed 256-token shape instead. Each arm runs
``hybridrl train`` with ``model.path`` and the workload's keys, plus the arm's own keys:

* ``sync``: the README's defaults (every step waits for its longest response);
* ``oversample``: ``roles.rollout.oversample=1.25`` (partial rollouts on, by default);
* ``oversample_refill``: the same with refill (the engine keeps 1.25 x the step's groups decoding);
* ``oversample_refill_graphs_512``: that with vLLM's own CUDA-graph capture (up to 512 sequences);
* ``oversample_drop``: oversampling without partial rollouts (unfinished groups are dropped);
* ``oversample_1.5``: ``roles.rollout.oversample=1.5``;
* ``oversample_2_s2_refill``: ``roles.rollout.oversample=2``, ``trainer.max_staleness=2``, refill;
* ``fractional``: the rollout on a pool of its own that shares the trainer's GPU (``pools.gen.share``), both
  resident at once, ``trainer.mode=async``: the next step generates while this one trains, weights by CUDA IPC;
* ``fractional_x2``: that with 2 rollout replicas side by side on the GPU (``pools.gen.per_device``), each with
  half of the requests.

While an arm runs, ``nvidia-smi`` samples the GPU's utilisation every 200 ms (the busy fraction). Per arm the
JSON holds trained samples and response tokens per second in steady state (the steps after ``--skip``), phase
times, the busy fraction, version lag and peak memory; ``long_tail_<size>.json`` (``standard_<size>.json`` for the
fixed shape) holds every arm measured in one call.

    python benchmarks/long_tail.py --size 0.5b --arms sync,oversample          # on the GPU host (benchmarks/gpu)
    python benchmarks/long_tail.py --size tiny --device cpu --backend hf --steps 3 --prompts 4 --samples 4 \\
        --prompt-len 16 --median 8 --max-new-tokens 48                         # a CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

from grpo_step import write_prompts  # noqa: E402  (benchmarks/ is not a package)
from model_sizes import ensure_model, train_run  # noqa: E402
from run_steps import steady_steps  # noqa: E402

#: the rollout on a pool of its own on the trainer's GPU, steps overlapped (docs/long-tail.md)
FRACTIONAL = ["pools.train.nodes=1", "pools.gen.share=train", "roles.actor.pool=train", "roles.rollout.pool=gen",
              "trainer.mode=async"]
ARMS: dict[str, list[str]] = {
    "sync": [],
    "oversample": ["roles.rollout.oversample=1.25"],
    "oversample_refill": ["roles.rollout.oversample=1.25", "roles.rollout.refill=true"],
    "oversample_refill_graphs_512": ["roles.rollout.oversample=1.25", "roles.rollout.refill=true",
                                     "roles.rollout.options.graph_sequences=512"],
    "oversample_drop": ["roles.rollout.oversample=1.25", "roles.rollout.partial=false"],
    "oversample_1.5": ["roles.rollout.oversample=1.5"],
    "oversample_2_s2_refill": ["roles.rollout.oversample=2", "trainer.max_staleness=2", "roles.rollout.refill=true"],
    "fractional": [*FRACTIONAL],
    "fractional_x2": [*FRACTIONAL, "pools.gen.per_device=2"],
}
#: how each arm schedules its steps (the result's ``mode``)
MODES = {"sync": "sync", "fractional": "async_fractional", "fractional_x2": "async_fractional"}


class BusySampler:
    """The GPU's utilisation (``nvidia-smi``, every 200 ms) while an arm runs; None on a machine without it."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self.proc: subprocess.Popen | None = None
        self.thread: threading.Thread | None = None

    def __enter__(self) -> BusySampler:
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                          "-lms", "200"], stdout=subprocess.PIPE, text=True)
            self.thread = threading.Thread(target=self._read, daemon=True)
            self.thread.start()
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.samples.append(float(line.split(",")[0]) / 100.0)
            except ValueError:
                pass

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=5)

    def fraction(self, start: int = 0) -> float | None:
        """Mean utilisation over the samples from ``start`` on (None without samples)."""
        part = self.samples[start:]
        return statistics.mean(part) if part else None


def workload(args: argparse.Namespace, model_dir: Path, data: Path, out: Path) -> dict[str, Any]:
    """``model.path`` and the workload's keys, nothing else."""
    cuda = args.device == "cuda"
    rollout: dict[str, Any] = {"backend": args.backend, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    if args.workload == "long_tail":
        rollout["response_lengths"] = {"median": args.median, "sigma": args.sigma, "seed": 0}
    else:
        rollout["min_new_tokens"] = args.max_new_tokens
    return {
        "model": {"path": str(model_dir), "dtype": "bfloat16" if cuda else "float32"},
        "data": {"train": str(data), "max_prompt_len": args.prompt_len, "prompts_per_step": args.prompts,
                 "shuffle": False},
        "algorithm": {"name": "grpo", "n_samples": args.samples,
                      "kl": {"coef": 0.001, "estimator": "k3", "as": "loss"}},
        "roles": {"rollout": rollout, "reward": {"fn": "bench_reward:digit_share"}},
        "trainer": {"steps": args.steps, "out": str(out), "trackers": ["jsonl"], "progress": False, "log_samples": 0},
        "cluster": {"device": args.device},
    }


def run_arm(args: argparse.Namespace, arm: str, model_dir: Path, data: Path, timeout: float) -> dict[str, Any]:
    workdir = Path(args.workdir)
    run_dir = workdir / f"run-{args.workload}-{arm}"
    shutil.rmtree(run_dir, ignore_errors=True)  # the benchmark's own scratch: a fresh run each call
    cfg_path = workdir / f"config-{args.workload}-{arm}.json"
    cfg_path.write_text(json.dumps(workload(args, model_dir, data, run_dir)))
    overrides = [*ARMS[arm], *args.override]
    with BusySampler() as busy:
        code, log, wall = train_run(cfg_path, overrides, timeout)
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.log_dir) / f"long_tail_{args.workload}_{arm}.log").write_text(str(log)[-300_000:])
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    return summary(args, arm, overrides, rows, code, wall, busy, str(log))


def summary(args: argparse.Namespace, arm: str, overrides: list[str], rows: list[dict[str, Any]], code: int,
            wall: float, busy: BusySampler, log: str) -> dict[str, Any]:
    """The arm's figures over its steady steps (``run_steps.steady_steps``: after ``--skip``, a pipelined arm's
    last step also left out: it trains with no generation running beside it, which no step of a longer run does)."""
    steady = steady_steps(rows, args.skip) or rows
    result: dict[str, Any] = {"arm": arm, "mode": MODES.get(arm, "groups_in_flight"),
                              "overrides": overrides, "defaults": not overrides,
                              "ok": code == 0 and len(rows) == args.steps, "steps": len(rows), "wall_s": wall,
                              "steady_steps": len(steady)}
    if steady:
        def median(key: str) -> float | None:
            values = [r[key] for r in steady if key in r]
            return statistics.median(values) if values else None

        step_s = sum(r["timing/step"] for r in steady) / len(steady)
        samples = args.prompts * args.samples
        tokens = statistics.mean(r["response_length/mean"] for r in steady) * samples
        result.update({
            "step_s": step_s, "samples_per_s": samples / step_s, "tokens_per_s": tokens / step_s,
            "phases_s": {k.removeprefix("timing/"): median(k) for k in sorted({k for r in steady for k in r})
                         if k.startswith("timing/")},
            "version_lag_mean": median("async/version_lag_mean") or 0.0,
            "version_lag_max": max((r.get("async/version_lag_max", 0.0) for r in steady), default=0.0),
            "thrown_tokens": median("rollout/thrown_tokens"), "partial_share": median("rollout/partial_share"),
            "peak_mb": max((r.get("memory/device_peak_mb") or 0.0) for r in rows) or None,
            "response_length_mean": median("response_length/mean"), "reward_mean": [r["reward/mean"] for r in rows],
            "step_seconds": [r["timing/step"] for r in rows],
            "per_step": [{k: v for k, v in r.items() if k.startswith(("timing/", "rollout/", "async/", "memory/device",
                                                                      "response_length/", "perf/gen"))}
                         for r in rows]})
    result["busy_fraction"] = busy.fraction()
    if not result["ok"]:
        result["log_tail"] = log[-6000:]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0.5b", help="0.5b, 1.5b, ... (examples/configs/qwen2.5-<size>) or tiny")
    parser.add_argument("--workload", choices=["long_tail", "standard"], default="long_tail")
    parser.add_argument("--arms", default="sync,oversample", help=f"comma-separated: {', '.join(ARMS)}")
    parser.add_argument("--backend", default="vllm")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the steady state")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--median", type=int, default=512, help="long_tail: the lengths' median")
    parser.add_argument("--sigma", type=float, default=1.0, help="long_tail: the lengths' lognormal sigma")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: 4096 (long_tail), 256 (standard)")
    parser.add_argument("--timeout", type=float, default=560.0, help="seconds for one arm")
    parser.add_argument("--budget", type=float, default=None, help="seconds for every arm of this call together")
    parser.add_argument("--workdir", default="/tmp/long-tail")
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("override", nargs="*", help="extra config overrides (key=value) for every arm")
    args = parser.parse_args()
    if args.max_new_tokens is None:
        args.max_new_tokens = 4096 if args.workload == "long_tail" else 256
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir, _ = ensure_model(args.size, "bfloat16" if args.device == "cuda" else "float32", workdir)
    data = workdir / f"prompts-{args.prompt_len}.jsonl"
    write_prompts(data, args.prompts * (args.steps + 4), args.prompt_len)  # + the groups oversampling draws
    out = Path(args.out_dir) / f"{args.workload}_{args.size}.json"
    start, arms = time.perf_counter(), []
    for arm in [a.strip() for a in args.arms.split(",") if a.strip()]:
        timeout = args.timeout
        if args.budget is not None:
            timeout = min(timeout, args.budget - (time.perf_counter() - start) - 5)
            if timeout < 60:
                print(f"long_tail: no time left for arm {arm}", flush=True)
                break
        arms.append(run_arm(args, arm, model_dir, data, timeout))
        brief = {k: arms[-1].get(k) for k in ("arm", "ok", "steps", "step_s", "samples_per_s", "tokens_per_s",
                                              "busy_fraction", "version_lag_mean", "peak_mb")}
        print(json.dumps(brief), flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"size": args.size, "workload": args.workload, "backend": args.backend,
                                   "device": args.device, "arms": arms}, indent=2))  # after each arm: kept if cut
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
