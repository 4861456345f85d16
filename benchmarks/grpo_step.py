"""The standard GRPO step benchmark: where a colocated one-GPU step spends its time.

The workload is fixed so that results compare across versions (issue 9):
Qwen2.5-0.5B shape (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied
embeddings), random bf16 weights; GRPO; 64 prompts x 8 samples = 512 sequences per step; 128-token prompts;
exactly 256 new tokens per sample (min = max, EOS ignored); KL to the reference as a loss (coef 0.001); one
optimizer step per RL step over all 512 sequences; AdamW; actor and reference on FSDP2 and the rollout engine
(``--backend``) all colocated on one GPU; run through ``hybridrl train`` for ``--steps`` steps.

Writes ``benchmarks/results/grpo_step_<backend>.json``: median and per-step seconds, per-phase seconds, generated
and training tokens/s, MFU, peak memory. ``--compare`` prints every backend's result file side by side.

    python benchmarks/grpo_step.py --backend vllm            # on the GPU host
    python benchmarks/grpo_step.py --shape tiny --device cpu --backend hf --steps 2   # smoke test
    python benchmarks/grpo_step.py --compare

The rule reward (``bench_reward:digit_share``) scores the share of digits in the decoded response; with random
weights most tokens lie outside the bundled character tokenizer's vocabulary, so rewards are mostly 0. The
compute of every phase does not depend on the rewards.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

from vllm_rollout import SHAPES, build_model  # noqa: E402  (benchmarks/ is not a package)

#: the workload, fixed; ``--shape tiny`` and ``--prompts``/``--samples``/``--new-tokens`` exist for smoke tests.
STANDARD = {"prompts": 64, "samples": 8, "prompt_len": 128, "new_tokens": 256, "kl_coef": 0.001}
PHASES = ["data", "wake", "gen", "sleep", "reward", "ref", "old_log_prob", "adv", "update_actor", "reshard", "step"]


def write_prompts(path: Path, count: int, prompt_len: int) -> None:
    """``count`` distinct prompts of exactly ``prompt_len`` tokens under the bundled character tokenizer."""
    from hybridrl.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    alphabet = "0123456789abcdefghijklmnopqrstuvwxyz"
    rows = []
    for i in range(count):
        text = "".join(alphabet[(i * 7 + j * 13 + (i * j) % 5) % len(alphabet)] for j in range(prompt_len))
        n = len(tok(text)["input_ids"])
        text = text[: prompt_len - (n - prompt_len)] if n > prompt_len else text
        rows.append(json.dumps({"prompt": text}))
    path.write_text("\n".join(rows) + "\n")


def run_config(args: argparse.Namespace, model_dir: Path, data: Path, out: Path) -> dict[str, Any]:
    cuda = args.device == "cuda"
    if args.layout == "split":  # trainers on the first half of the devices, the rollout on the rest
        pools = {"train": {"nodes": 1, "devices_per_node": args.gpus // 2},
                 "gen": {"nodes": 1, "devices_per_node": args.gpus - args.gpus // 2}}
        train_pool, gen_pool = "train", "gen"
    else:
        pools, train_pool, gen_pool = {"main": {"nodes": 1, "devices_per_node": args.gpus}}, "main", "main"
    rollout: dict[str, Any] = {"pool": gen_pool, "backend": args.backend, "max_new_tokens": args.new_tokens,
                               "min_new_tokens": args.new_tokens, "ignore_eos": True, "temperature": 1.0,
                               "log_probs": args.rollout_log_probs, "bucket_mb": args.bucket_mb, "options": {}}
    if args.backend in ("vllm", "sglang"):
        rollout["options"]["gpu_memory_utilization"] = args.gpu_memory_utilization
    return {
        "model": {"path": str(model_dir), "dtype": "bfloat16" if cuda else "float32"},
        "data": {"train": str(data), "max_prompt_len": args.prompt_len, "prompts_per_step": args.prompts,
                 "shuffle": False},
        "algorithm": {"name": "grpo", "n_samples": args.samples,
                      "kl": {"coef": STANDARD["kl_coef"], "estimator": "k3", "as": "loss"}},
        "pools": pools,
        "roles": {"actor": {"pool": train_pool, "backend": "fsdp", "lr": 1e-6, "micro_batch": args.micro_batch,
                            "options": {"gradient_checkpointing": args.gradient_checkpointing}},
                  "ref": {"pool": train_pool, "backend": "fsdp", "options": {"micro_batch": args.ref_micro_batch}},
                  "rollout": rollout,
                  "reward": {"fn": "bench_reward:digit_share"}},
        "trainer": {"steps": args.steps, "out": str(out), "trackers": ["jsonl"], "progress": False, "log_samples": 0},
        "cluster": {"device": args.device},
    }


def summarise(rows: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """Median over the steps after the first ``skip`` (first-use kernel builds, CUDA graphs, allocator growth)."""
    later = rows[skip:] or rows
    prefixes = ("timing/", "perf/", "compute/", "reshard/", "sync_check/", "rollout/", "moe/")
    keys = sorted({k for r in later for k in r if k.startswith(prefixes)})
    median = {k: statistics.median(r[k] for r in later if k in r) for k in keys}
    return {"steps_in_median": len(later), "median": median,
            "step_seconds": [r.get("timing/step") for r in rows]}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="grpo-step-"))
    model_dir = workdir / f"model-{args.shape}"
    t0 = time.perf_counter()
    if not (model_dir / "config.json").exists():
        build_model(args.shape, "bfloat16" if args.device == "cuda" else "float32", model_dir)
    build_s = time.perf_counter() - t0
    data = workdir / "prompts.jsonl"
    write_prompts(data, args.prompts * max(args.steps, 1), args.prompt_len)
    run_dir = workdir / f"run-{args.backend}-{args.layout}{args.gpus}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a new run each time (train refuses a folder holding an old one)
    cfg = run_config(args, model_dir, data, run_dir)
    cfg_path = workdir / f"grpo-{args.backend}.json"  # YAML is a superset of JSON
    cfg_path.write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(cfg_path), *args.override],
                              capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
        code, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:  # keep the steps that finished
        code, log = -1, f"timed out after {args.timeout}s\n{exc.stdout or ''}{exc.stderr or ''}"
    wall = time.perf_counter() - start
    if args.log:
        Path(args.log).write_text(str(log)[-400_000:])
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    result: dict[str, Any] = {"backend": args.backend, "shape": args.shape, "device": args.device,
                              "layout": args.layout, "gpus": args.gpus,
                              "workload": {"prompts": args.prompts, "samples": args.samples,
                                           "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                                           "standard": args.shape == "qwen0.5b" and args.gpus == 1 and all(
                                               getattr(args, k) == v for k, v in STANDARD.items() if k != "kl_coef")},
                              "settings": {"micro_batch": args.micro_batch, "ref_micro_batch": args.ref_micro_batch,
                                           "gradient_checkpointing": args.gradient_checkpointing,
                                           "gpu_memory_utilization": args.gpu_memory_utilization,
                                           "rollout_log_probs": args.rollout_log_probs, "bucket_mb": args.bucket_mb,
                                           "overrides": args.override},
                              "ok": code == 0, "returncode": code, "wall_s": wall, "model_build_s": build_s,
                              "steps": len(rows), "per_step": rows}
    if rows:
        result.update(summarise(rows, args.skip))
    if code != 0:
        result["log_tail"] = str(log)[-5000:]
    return result


def phase_table(results: dict[str, dict[str, Any]]) -> str:
    """Median seconds per phase, one column per backend."""
    names = list(results)
    lines = ["| phase | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    rows = [f"timing/{p}" for p in PHASES] + ["perf/gen_tokens_per_s", "perf/train_tokens_per_s", "perf/mfu",
                                              "perf/peak_mem_mb"]
    for key in rows:
        cells = []
        for name in names:
            value = results[name].get("median", {}).get(key)
            cells.append("-" if value is None else (f"{value:.3f}" if abs(value) < 100 else f"{value:,.0f}"))
        if any(c != "-" for c in cells):
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="vllm", help="rollout backend: vllm, sglang, hf")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen0.5b")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--layout", choices=["colocated", "split"], default="colocated")
    parser.add_argument("--gpus", type=int, default=1, help="devices of the run (split: half train, half rollout)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--skip", type=int, default=1, help="first steps left out of the median")
    parser.add_argument("--prompts", type=int, default=STANDARD["prompts"])
    parser.add_argument("--samples", type=int, default=STANDARD["samples"])
    parser.add_argument("--prompt-len", type=int, default=STANDARD["prompt_len"])
    parser.add_argument("--new-tokens", type=int, default=STANDARD["new_tokens"])
    parser.add_argument("--micro-batch", type=int, default=32, help="actor sequences per forward/backward")
    parser.add_argument("--ref-micro-batch", type=int, default=64)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    parser.add_argument("--rollout-log-probs", action="store_true",
                        help="ask the engine for the sampled tokens' log-probs (off: verl's default, the actor's "
                             "log-probs are the ones trained on)")
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--timeout", type=float, default=540.0)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--log", default=None, help="write the run's output there")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/grpo_step_<backend>.json")
    parser.add_argument("--compare", action="store_true", help="print the result files side by side and exit")
    parser.add_argument("override", nargs="*", help="extra hybridrl config overrides (key=value)")
    args = parser.parse_args()

    if args.compare:
        found = {p.stem.removeprefix("grpo_step_"): json.loads(p.read_text())
                 for p in sorted(RESULTS.glob("grpo_step_*.json"))}
        print(phase_table(found))
        return
    result = bench(args)
    name = args.backend if (args.layout, args.gpus) == ("colocated", 1) else f"{args.backend}_{args.layout}{args.gpus}"
    out = Path(args.out or RESULTS / f"grpo_step_{name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("per_step",)}, indent=2)[:8000])
    print(phase_table({args.backend: result}))


if __name__ == "__main__":
    main()
