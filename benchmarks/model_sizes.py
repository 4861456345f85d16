"""The issue-20 workload at four model sizes on one GPU, through ``hybridrl train`` with the README's defaults.

GRPO, 64 prompts x 8 samples, 128-token prompts, exactly 256 new tokens (min = max, EOS ignored), KL loss 0.001,
FSDP actor + reference + the rollout engine (``--backend``, vLLM by default) colocated on one GPU; Qwen2.5-0.5B,
1.5B, 3B and 7B shapes (``examples/configs/qwen2.5-<size>/config.json``), random bf16 weights built on the GPU
host. The run config holds ``model.path`` and the workload's keys only: everything else is the default, so
every ``auto`` is resolved by the plan (the chosen values and the planned memory of each phase are read back
from the run's ``config.json``).

For each size and variant it writes ``<out-dir>/model_sizes_<size>[_<variant>].json``: the fields
``grpo_step.py`` writes (``shape``, ``ok``, ``median``, ``settings``) with ``settings.defaults: true`` when
nothing beyond the workload was set, ``planned_peak_mb`` / ``measured_peak_mb`` (the device's memory in use,
``memory/device_peak_mb``) and their per-phase figures, the auto choices, tokens/s and MFU. ``--variant tuned``
runs the hand-tuned settings of ``TUNED`` instead, ``--variant lora`` the defaults plus the ``roles.actor.lora`` key
of ``LORA`` (issue 27; its JSON adds ``step_s``, ``reshard_s`` and ``reshard_bytes``, medians after the first step);
``--override`` adds keys to any of them; ``--compare`` prints every result side by side.

    python benchmarks/model_sizes.py --sizes 0.5b,1.5b                 # on the GPU host (see benchmarks/gpu)
    python benchmarks/model_sizes.py --sizes 3b --variant tuned
    python benchmarks/model_sizes.py --sizes 7b --variant lora         # LoRA (+ roles.actor.lora.sync=adapter)
    python benchmarks/model_sizes.py --sizes tiny --device cpu --backend hf --steps 2   # smoke test
    python benchmarks/model_sizes.py --compare
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
CONFIGS = ROOT / "examples" / "configs"
sys.path.insert(0, str(HERE))

from grpo_step import STANDARD, summarise, write_prompts  # noqa: E402  (benchmarks/ is not a package)

SIZES = ("0.5b", "1.5b", "3b", "7b")
#: each size's config folder under ``examples/configs`` (``moe``: a Qwen3-MoE shape, 2.25B parameters of which 0.74B
#: are active per token: 48 experts, top-8, 24 layers of width 1024; not a released model)
SHAPES = {**{size: f"qwen2.5-{size}" for size in SIZES}, "moe": "qwen3-moe-2b-a0.7b"}
#: a CPU smoke-test shape (not a Qwen2.5 size).
TINY = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
        "max_position_embeddings": 1024, "rope_theta": 10000.0, "tie_word_embeddings": True}
#: the same for a Qwen3-MoE (8 experts, top-2): the MoE arms' smoke test.
TINY_MOE = {**TINY, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 16,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}
#: hand-tuned settings per size, to run beside the defaults (``--variant tuned``): what was found by hand
#: before the auto choices existed (issue 20: 0.5B at micro-batch 64 with a 128-row reference micro-batch, no
#: rollout log-probs and 0.4 of the GPU for vLLM; 1.5B only with gradient checkpointing and 0.3), and the same
#: kind of settings for the larger shapes.
TUNED = {
    "0.5b": ["roles.actor.micro_batch=64", "roles.ref.micro_batch=128", "roles.rollout.log_probs=false",
             "roles.rollout.options.gpu_memory_utilization=0.4"],
    "1.5b": ["roles.actor.micro_batch=64", "roles.actor.options.gradient_checkpointing=true",
             "roles.ref.micro_batch=128", "roles.rollout.log_probs=false",
             "roles.rollout.options.gpu_memory_utilization=0.3"],
    "3b": ["roles.actor.micro_batch=32", "roles.actor.options.gradient_checkpointing=false",
           "roles.ref.micro_batch=128",
           "roles.rollout.log_probs=false", "roles.rollout.options.gpu_memory_utilization=0.25"],
    "7b": ["roles.actor.micro_batch=16", "roles.actor.options.gradient_checkpointing=true",
           "roles.actor.options.offload=optimizer", "roles.ref.micro_batch=64", "roles.rollout.log_probs=false",
           "roles.rollout.options.gpu_memory_utilization=0.3"],
    "tiny": ["roles.actor.micro_batch=8"],
}
#: the one key the LoRA variant adds to the defaults (issue 27): rank 32 on every linear layer, alpha 64; the sync
#: mode stays ``auto`` (merged when the actor and the rollout share a process) unless an override sets it.
LORA = ["roles.actor.lora={rank: 32, alpha: 64}"]
PHASES = ["wake", "gen", "sleep", "reward", "ref", "old_log_prob", "adv", "update_actor", "reshard", "step"]


# --- the model ------------------------------------------------------------------------------------------------
def model_config(size: str) -> dict[str, Any]:
    if size in ("tiny", "tiny-moe"):
        return dict(TINY if size == "tiny" else TINY_MOE)
    if size not in SHAPES:
        raise SystemExit(f"model_sizes: unknown size '{size}' (known: {', '.join(SHAPES)}, tiny, tiny-moe)")
    return json.loads((CONFIGS / SHAPES[size] / "config.json").read_text())


def build_model(size: str, dtype: str, out: Path) -> Path:
    """Random weights of the size's config, made on the GPU (when there is one) in ``dtype``, saved with the
    bundled character tokenizer (its ids are far below every vocabulary; other ids decode to nothing)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from hybridrl.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = model_config(size)
    model_type = cfg.pop("model_type")
    for key in ("architectures", "torch_dtype", "transformers_version", "bos_token_id", "eos_token_id",
                "pad_token_id"):
        cfg.pop(key, None)
    config = AutoConfig.for_model(model_type, **cfg, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # no fp32 copy of a 7B model on the way
    try:
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def ensure_model(size: str, dtype: str, workdir: Path) -> tuple[Path, float]:
    """The model folder, built in a process of its own (its CUDA context and memory are gone before the run)."""
    folder = workdir / f"model-{size}-{dtype}"
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder, 0.0
    start = time.perf_counter()
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--build-only", size, "--dtype", dtype,
                    "--workdir", str(workdir)], check=True, cwd=ROOT)
    return folder, time.perf_counter() - start


# --- one run --------------------------------------------------------------------------------------------------
def workload_config(args: argparse.Namespace, size: str, model_dir: Path, data: Path, out: Path) -> dict[str, Any]:
    """``model.path`` and the workload's keys, nothing else (``settings.defaults``)."""
    cuda = args.device == "cuda"
    return {
        "model": {"path": str(model_dir), "dtype": "bfloat16" if cuda else "float32"},
        "data": {"train": str(data), "max_prompt_len": args.prompt_len, "prompts_per_step": args.prompts,
                 "shuffle": False},
        "algorithm": {"name": "grpo", "n_samples": args.samples,
                      "kl": {"coef": STANDARD["kl_coef"], "estimator": "k3", "as": "loss"}},
        "roles": {"rollout": {"backend": args.backend, "max_new_tokens": args.new_tokens,
                              "min_new_tokens": args.new_tokens, "ignore_eos": True},
                  "reward": {"fn": "bench_reward:digit_share"}},
        "trainer": {"steps": args.steps, "out": str(out), "trackers": ["jsonl"], "progress": False, "log_samples": 0},
        "cluster": {"device": args.device},
    }


def variant_name(args: argparse.Namespace) -> str:
    """The variant as result files name it (``lora_adapter``: LoRA with the adapters sent alone)."""
    adapter = any(o.replace(" ", "") == "roles.actor.lora.sync=adapter" for o in args.override)
    return f"{args.variant}_adapter" if args.variant == "lora" and adapter else args.variant


def overrides_of(args: argparse.Namespace, size: str) -> list[str]:
    variant = {"tuned": TUNED.get(size, []), "lora": LORA}.get(args.variant, [])
    return [*variant, *args.override]


def run_size(args: argparse.Namespace, size: str, timeout: float) -> dict[str, Any]:
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    model_dir, build_s = ensure_model(size, dtype, workdir)
    data = workdir / "prompts.jsonl"
    write_prompts(data, args.prompts * max(args.steps, 1), args.prompt_len)
    name = f"{size}_{variant_name(args)}"
    run_dir = workdir / f"run-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)  # the benchmark's own scratch: every call measures a fresh run
    cfg = workload_config(args, size, model_dir, data, run_dir)
    cfg_path = workdir / f"config-{name}.json"
    cfg_path.write_text(json.dumps(cfg))
    overrides = overrides_of(args, size)
    code, log, wall = train_run(cfg_path, overrides, timeout)
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.log_dir) / f"model_sizes_{name}.log").write_text(log[-400_000:])
    result = result_of(args, size, overrides, run_dir, code, log, wall, build_s)
    # trainer.profile_step=N among the overrides: the workers' kernel profiles of that step travel in the JSON
    profiles = {p.stem: json.loads(p.read_text()) for p in sorted((run_dir / "profile").glob("*.json"))}
    if profiles:
        result["profiles"] = profiles
    return result


def train_run(cfg_path: Path, overrides: list[str], timeout: float) -> tuple[int, str, float]:
    """``hybridrl train CONFIG trainer.resume=never OVERRIDES`` (``benchmarks/`` importable, for the reward):
    its exit status (-1: cut at ``timeout``, the steps it finished kept), output and wall seconds."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(cfg_path), "trainer.resume=never",
                               *overrides], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        code, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:  # keep the steps that finished
        code, log = -1, f"timed out after {timeout:.0f}s\n{_text(exc.stdout)}{_text(exc.stderr)}"
    return code, log, time.perf_counter() - start


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def result_of(args: argparse.Namespace, size: str, overrides: list[str], run_dir: Path, code: int, log: str,
              wall: float, build_s: float) -> dict[str, Any]:
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.exists() else []
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
    auto = config.get("auto", {})
    memory = auto.get("memory", {})
    pool = next(iter(memory.get("pools", {}).values()), {})
    result: dict[str, Any] = {
        "benchmark": "model_sizes", "shape": SHAPES.get(size, size), "size": size, "tag": args.tag,
        "backend": args.backend, "device": args.device, "variant": args.variant, "gpus": 1, "layout": "colocated",
        "workload": {"prompts": args.prompts, "samples": args.samples, "prompt_len": args.prompt_len,
                     "new_tokens": args.new_tokens, "kl_coef": STANDARD["kl_coef"],
                     "standard": all(getattr(args, k) == v for k, v in STANDARD.items() if k != "kl_coef")},
        "settings": {"defaults": not overrides, "defaults_plus_lora": overrides == LORA or (
                         args.variant == "lora" and all(o.startswith("roles.actor.lora") for o in overrides)),
                     "overrides": overrides,
                     "auto": {k: v.get("value") for k, v in auto.get("choices", {}).items()}},
        "auto_reasons": {k: v.get("reason") for k, v in auto.get("choices", {}).items()},
        "ok": code == 0 and len(rows) == args.steps, "returncode": code, "wall_s": wall, "model_build_s": build_s,
        "steps": len(rows),
        "device_mb": memory.get("device_mb"),
        "planned_peak_mb": pool.get("peak_mb"), "planned_peak_phase": pool.get("peak_phase"),
        "planned_phases_mb": pool.get("phases_mb", {}), "planned_roles": memory.get("roles", {}),
        "plan_warnings": memory.get("warnings", []),
    }
    if rows:
        result.update(summarise(rows, args.skip))
        measured = {}
        for row in rows:
            for key, value in row.items():
                if key.startswith("memory/phase/") and key.endswith("/device_peak_mb"):
                    phase = key.removeprefix("memory/phase/").removesuffix("/device_peak_mb")
                    measured[phase] = max(measured.get(phase, 0.0), float(value))
        result["measured_phases_mb"] = measured
        result["measured_peak_mb"] = max(measured.values()) if measured else None
        result["torch_peak_allocated_mb"] = max((r.get("perf/peak_mem_mb") or 0.0) for r in rows)
        if result["measured_peak_mb"] and result["planned_peak_mb"]:
            result["planned_over_measured"] = result["planned_peak_mb"] / result["measured_peak_mb"]
        med = result.get("median", {})
        tokens = args.prompts * args.samples * (args.prompt_len + args.new_tokens)
        step = med.get("timing/step")
        result["tokens_per_s"] = {"step": tokens / step if step else None,
                                  "gen": med.get("perf/gen_tokens_per_s"), "train": med.get("perf/train_tokens_per_s")}
        result["mfu"] = med.get("perf/mfu")
        result["step_s"] = step
        result["reshard_s"] = med.get("timing/reshard")
        result["reshard_bytes"] = med.get("reshard/bytes")
        result["lora_sync"] = (config.get("roles", {}).get("actor", {}).get("lora") or {}).get("sync")
        result["per_step"] = rows
    if code != 0 or len(rows) != args.steps:
        result["log_tail"] = log[-6000:]
    return result


# --- comparison -------------------------------------------------------------------------------------------------
def compare(results: list[dict[str, Any]]) -> str:
    """Median seconds per phase, memory planned against measured, and the auto choices: one column per run."""
    names = [f"{r.get('size')} {r.get('tag') or r.get('variant')}" for r in results]
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

    def row(label: str, cells: list[str]) -> None:
        if any(c not in ("-", "") for c in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + " |")

    def num(value: Any, fmt: str = "{:.2f}") -> str:
        return "-" if value is None else fmt.format(value)

    row("ok (steps)", [f"{'yes' if r.get('ok') else 'NO'} ({r.get('steps', 0)})" for r in results])
    for phase in PHASES:
        row(f"timing/{phase}", [num(r.get("median", {}).get(f"timing/{phase}")) for r in results])
    row("gen tokens/s", [num(r.get("tokens_per_s", {}).get("gen"), "{:,.0f}") for r in results])
    row("step tokens/s", [num(r.get("tokens_per_s", {}).get("step"), "{:,.0f}") for r in results])
    row("MFU", [num(r.get("mfu"), "{:.3f}") for r in results])
    row("reshard MB", [num(r.get("reshard_bytes") and r["reshard_bytes"] / 2**20, "{:,.1f}") for r in results])
    row("planned peak GiB", [num(_gib(r.get("planned_peak_mb"))) + f" ({r.get('planned_peak_phase') or '-'})"
                             for r in results])
    row("measured peak GiB", [num(_gib(r.get("measured_peak_mb"))) for r in results])
    row("planned / measured", [num(r.get("planned_over_measured"), "{:.3f}") for r in results])
    keys = sorted({k for r in results for k in r.get("settings", {}).get("auto", {})})
    for key in keys:
        row(key.replace("roles.", ""), [str(r.get("settings", {}).get("auto", {}).get(key, "-")) for r in results])
    row("overrides", [" ".join(r.get("settings", {}).get("overrides", [])) or "(defaults)" for r in results])
    return "\n".join(lines)


def _gib(mb: Any) -> float | None:
    return None if mb is None else mb / 1024.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=",".join(SIZES),
                        help=f"comma-separated: {', '.join(SHAPES)}, tiny, tiny-moe")
    parser.add_argument("--variant", choices=["defaults", "tuned", "lora"], default="defaults")
    parser.add_argument("--tag", default=None,
                        help="name the result file model_sizes_<size>_<tag>.json (an arm run with overrides)")
    parser.add_argument("--backend", default="vllm", help="rollout backend: vllm, sglang, hf")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--skip", type=int, default=1, help="first steps left out of the median")
    parser.add_argument("--prompts", type=int, default=STANDARD["prompts"])
    parser.add_argument("--samples", type=int, default=STANDARD["samples"])
    parser.add_argument("--prompt-len", type=int, default=STANDARD["prompt_len"])
    parser.add_argument("--new-tokens", type=int, default=STANDARD["new_tokens"])
    parser.add_argument("--timeout", type=float, default=560.0, help="seconds for one size's run")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for all sizes of this call together (each run gets what is left)")
    parser.add_argument("--workdir", default="/tmp/model-sizes")
    parser.add_argument("--out-dir", default=str(RESULTS))
    parser.add_argument("--log-dir", default=None, help="write each run's output there")
    parser.add_argument("--compare", action="store_true", help="print the result files side by side and exit")
    parser.add_argument("--build-only", metavar="SIZE", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="bfloat16", help=argparse.SUPPRESS)
    parser.add_argument("override", nargs="*", help="extra hybridrl config overrides (key=value)")
    args = parser.parse_args()

    if args.build_only:
        build_model(args.build_only, args.dtype, Path(args.workdir) / f"model-{args.build_only}-{args.dtype}")
        return
    if args.compare:
        def order(path: Path) -> tuple[int, str]:
            size = path.stem.split("_")[2]
            return (SIZES.index(size) if size in SIZES else len(SIZES), path.name)

        files = sorted(Path(args.out_dir).glob("model_sizes_*.json"), key=order)
        print(compare([json.loads(p.read_text()) for p in files]))
        return
    start = time.perf_counter()
    done = []
    for size in [s.strip() for s in args.sizes.split(",") if s.strip()]:
        timeout = args.timeout
        if args.budget is not None:
            timeout = min(timeout, args.budget - (time.perf_counter() - start) - 5)
            if timeout < 60:
                print(f"model_sizes: no time left for {size} ({timeout:.0f}s of the budget)", flush=True)
                break
        result = run_size(args, size, timeout)
        suffix = args.tag or ("" if args.variant == "defaults" else variant_name(args))
        name = f"model_sizes_{size}" + (f"_{suffix}" if suffix else "")
        out = Path(args.out_dir) / f"{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        done.append(result)
        brief = {k: result.get(k) for k in ("shape", "variant", "ok", "steps", "planned_peak_mb", "measured_peak_mb",
                                            "planned_over_measured", "wall_s")}
        brief["median_step_s"] = result.get("median", {}).get("timing/step")
        print(json.dumps(brief), flush=True)
    if done:
        print(compare(done))


if __name__ == "__main__":
    main()
