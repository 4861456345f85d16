"""A rollout backend (vLLM, or SGLang with ``--backend sglang``) against the same engine alone: generation
speed, resharding, sleep/wake, memory, and a GRPO run.

Two parts, each in its own process (each starts its own engine), results merged into one JSON:

* ``micro``: an FSDP actor and the rollout engine (``VLLMRollout`` / ``SGLangRollout``) colocated in this
  process, as one worker hosts them. Generation tokens/s through the engine's ``generate`` against the same
  engine called directly (``LLM.generate`` / ``Engine.generate``) on the same prompts, interleaved repeats,
  with per-repeat paired ratios; the in-process reshard (``sync_in_process``: export, import, finish) awake and
  asleep, cycle by cycle with where its time went (``import_stats``), against one flat device copy of the same
  bytes; for vLLM the same with the weights kept resident (``sleep_level: kv_cache``); ``sleep``/``wake``
  seconds and the memory they free; peak device memory; the rollout's log-probs against the actor's after
  the syncs.
* ``grpo``: ``hybridrl train`` (Ray, FSDP actor + reference + the rollout colocated on one device) for a few
  steps; per-step phase times from its ``metrics.jsonl``.

The model is built from a config on the spot (random weights): ``--shape qwen0.5b`` is Qwen2.5-0.5B's shape
(hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, tied embeddings) in bf16 with
the bundled character tokenizer (the vocab is padded; the tokenizer only decodes rewards); ``--shape tiny`` is
a smoke test for CPU.

    python benchmarks/vllm_rollout.py [--backend vllm|sglang] [--shape qwen0.5b] [--parts micro,grpo] [--out FILE]
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {
    "qwen0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                     intermediate_size=4864, vocab_size=151936, max_position_embeddings=4096, rope_theta=1e6),
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=512, max_position_embeddings=512, rope_theta=1e4),
}


def build_model(shape: str, dtype: str, out: Path) -> Path:
    """A random Qwen2 of ``shape`` saved with the bundled character tokenizer (ids past its vocab decode to
    nothing)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from hybridrl.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = Qwen2Config(**SHAPES[shape], tie_word_embeddings=True, use_sliding_window=False,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def prompt_rows(prompts_per_step: int, n_samples: int) -> tuple[list[list[int]], list[str]]:
    """The GRPO run's first prompts (the reverse task, character tokens), each repeated ``n_samples`` times."""
    from hybridrl.model.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    lines = (ROOT / "examples" / "data" / "reverse2.jsonl").read_text().splitlines()[:prompts_per_step]
    texts = [json.loads(line)["prompt"] for line in lines]
    ids = [tok.encode(t) for t in texts]
    return [p for p in ids for _ in range(n_samples)], texts


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str) -> tuple[float, Any]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


class GCTime:
    """Seconds the Python garbage collector ran (and full collections) between ``start`` and ``read``: a
    collection of the oldest generation over a large heap can stall a CPU-bound engine loop for a while."""

    def __init__(self) -> None:
        import gc

        self.seconds, self.full, self._t0 = 0.0, 0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.full += int(info.get("generation") == 2)

    def start(self) -> None:
        self.seconds, self.full = 0.0, 0

    def read(self) -> dict[str, float]:
        return {"gc_s": self.seconds, "gc_full": self.full}


class Memory:
    """Device memory in use (all allocators, vLLM's cumem pool included) at named points, and the peak."""

    def __init__(self, device: str) -> None:
        self.device, self.points, self.peak = device, {}, 0.0

    def mark(self, name: str) -> float:
        if self.device != "cuda":
            return 0.0
        import torch

        free, total = torch.cuda.mem_get_info()
        used = (total - free) / 2**30
        self.points[name] = round(used, 3)
        self.peak = max(self.peak, used)
        return used


def _make_rollout(backend: str, options: dict[str, Any], common: dict[str, Any]) -> Any:
    from hybridrl.engines import EngineContext

    ctx = EngineContext(role="rollout", backend=backend, trainable=False, options=options, **common)
    if backend == "sglang":
        from hybridrl_sglang.engine import SGLangRollout

        return SGLangRollout(ctx)
    from hybridrl_vllm.engine import VLLMRollout

    return VLLMRollout(ctx)


def _engine_alone(backend: str, rollout: Any, prompts: list[list[int]], new_tokens: int
                  ) -> dict[str, Callable[[], int]]:
    """The engine called directly, as a user of it would, on the same prompts: tokens generated per call."""
    if backend == "sglang":
        engine = rollout.engine

        def sglang(logprobs: bool) -> Callable[[], int]:
            def run() -> int:
                sp = {"temperature": 1.0, "max_new_tokens": new_tokens, "ignore_eos": True}
                outs = engine.generate(input_ids=prompts, sampling_params=[dict(sp) for _ in prompts],
                                       return_logprob=logprobs)
                return sum(len(o["output_ids"]) for o in outs)
            return run
        return {"engine_alone": sglang(False), "engine_alone_logprobs": sglang(True)}

    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt

    vprompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm = rollout.llm

    def vllm(logprobs: int | None, seeded: bool) -> Callable[[], int]:
        def run() -> int:
            if seeded:
                sp: Any = [VSP(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, logprobs=logprobs,
                               detokenize=False, seed=1000 + i) for i in range(len(vprompts))]
            else:
                sp = VSP(temperature=1.0, max_tokens=new_tokens, ignore_eos=True, logprobs=logprobs, detokenize=False)
            outs = llm.generate(vprompts, sp, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)
        return run
    return {"engine_alone": vllm(None, False), "engine_alone_logprobs": vllm(0, False),
            "engine_alone_logprobs_seeded": vllm(0, True)}


def _paired_ratio(samples: dict[str, list[float]], num: str, den: str) -> dict[str, float]:
    """``num``/``den`` tokens/s: the ratio of medians, and the median of the per-repeat ratios (each repeat
    runs both back to back, so a drift of the host hits both alike)."""
    pairs = [a / b for a, b in zip(samples[num], samples[den])]
    return {"ratio_of_medians": statistics.median(samples[num]) / statistics.median(samples[den]),
            "median_of_paired_ratios": statistics.median(pairs), "paired_ratios": pairs}


def _cycles(rollout: Any, actor: Any, mem: Memory, device: str, bucket: int, small: Any, short: Any, count: int,
            label: str, large: bool = True, flat_copy: Callable[[], Any] | None = None,
            train: Callable[[], Any] | None = None) -> dict[str, Any]:
    """``count`` cycles in the trainer's order: wake, generate a little, sleep, ``train`` (an actor update:
    what runs between the sleep and the sync in the loop; None: the sync right after the sleep, on a device
    left idle through the sleep's host work), sync, wake. ``large``: the bridge's default (views copied in
    place go in buckets of at least ``VIEW_BUCKET_BYTES``); False keeps ``bucket`` bytes per bucket.
    ``flat_copy``: timed right after each sync, in the same asleep window (after the sync the device is at
    least as warm as the sync found it, so the ratio to it does not flatter the sync)."""
    from hybridrl.weights.bridges import sync_in_process

    out: dict[str, Any] = {}
    for k in range(count):
        rollout.wake()
        rollout.generate(small, short)
        before = mem.mark(f"{label}_before_sleep_{k}")
        t_sleep, _ = timed(rollout.sleep, device)
        after = mem.mark(f"{label}_asleep_{k}")
        t_train = timed(train, device)[0] if train is not None else None
        t_sync, stats = timed(lambda: sync_in_process(actor, rollout, bucket, views_in_large_buckets=large), device)
        t_flat = timed(flat_copy, device)[0] if flat_copy is not None else None
        mem.mark(f"{label}_synced_{k}")
        t_wake, _ = timed(rollout.wake, device)
        mem.mark(f"{label}_awake_{k}")
        out[f"cycle{k}"] = {"sleep_level": getattr(rollout, "last_sleep_level", None), "sleep_s": t_sleep,
                            "freed_gib": round(before - after, 3), "reshard_asleep_s": t_sync, "wake_s": t_wake,
                            # the sync without mapping discarded weights back (a wake stage, level 2 only)
                            "reshard_without_weight_wake_s": t_sync - float(stats.get("wake_weights_s", 0.0)),
                            "import_parts": {k2: v for k2, v in stats.items() if k2 not in ("bytes", "buckets")}}
        if t_train is not None:
            out[f"cycle{k}"]["train_s"] = t_train
        if t_flat is not None:
            out[f"cycle{k}"]["flat_copy_after_sync_s"] = t_flat
    return out


def _small_update(actor: Any, rollout: Any, small: Any, short: Any) -> Callable[[], Any]:
    """An actor update (GRPO objective, random advantages) on a few generated rows: the device work that
    precedes a sync in the training loop."""
    import torch

    from hybridrl.algorithms.objective import PolicyObjective
    from hybridrl.config import AlgorithmConfig
    from hybridrl.engines.batch import ADVANTAGES, OLD_LOG_PROBS, PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK
    from hybridrl.plugins.discovery import get_registry

    rollout.wake()
    rows = rollout.generate(small, short)
    rows.update(small)
    seq = rows.select(PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK)
    seq.info["temperature"] = 1.0
    seq.set(OLD_LOG_PROBS, actor.compute_log_probs(seq)["log_probs"])
    seq.set(ADVANTAGES, torch.randn(seq[RESPONSE_MASK].shape, generator=torch.Generator().manual_seed(0)))
    objective = PolicyObjective(AlgorithmConfig(name="grpo", kl=None), get_registry())
    return lambda: actor.update(seq, objective)


def _steady(cycles: dict[str, Any], count: int, flat: float, cast_copy: float) -> dict[str, float]:
    """Medians over the steady cycles (from the third on: the second records the copies' CUDA graphs), and
    against the flat and cast copies of the same bytes."""
    steady = [cycles[f"cycle{k}"] for k in range(2, count)] or [cycles["cycle0"]]
    sync = statistics.median(c["reshard_asleep_s"] for c in steady)
    out = {"reshard_steady_s": sync, "reshard_vs_flat_copy": sync / flat, "reshard_vs_cast_copy": sync / cast_copy,
           "reshard_without_weight_wake_steady_s": statistics.median(c["reshard_without_weight_wake_s"]
                                                                     for c in steady)}
    if all("flat_copy_after_sync_s" in c for c in steady):  # each sync against the flat copy of its own cycle
        out["reshard_vs_flat_copy_same_cycle"] = statistics.median(
            c["reshard_asleep_s"] / c["flat_copy_after_sync_s"] for c in steady)
    return out


def _cast_copy_seconds(numel: int, dtype: Any, dev: Any, device: str) -> float:
    """The best of five fp32 -> ``dtype`` copies of ``numel`` values (the least a sync from fp32 masters moves)."""
    import torch

    master = torch.empty(numel, dtype=torch.float32, device=dev)
    served = torch.empty(numel, dtype=dtype, device=dev)
    return min(timed(lambda: served.copy_(master), device)[0] for _ in range(5))


def micro(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    import torch

    from hybridrl.engines import EngineContext, SamplingParams, TrainingOptions
    from hybridrl.engines.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, Batch, left_pad
    from hybridrl.runtime.distributed import free_port, init_process_group
    from hybridrl.weights.bridges import sync_in_process
    from hybridrl_fsdp.engine import FSDPEngine

    backend = args.backend
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    os.environ.setdefault("LOCAL_RANK", "0")
    init_process_group(0, 1, "127.0.0.1", free_port(), device)
    mem = Memory(device)
    mem.mark("start")
    common = dict(model_path=str(model_dir), rank=0, world_size=1, device=device, dtype=dtype, seed=0)
    actor_ctx = EngineContext(role="actor", backend="fsdp", trainable=True,
                              training=TrainingOptions(micro_batch=8, lr=1e-6), **common)
    t_actor, actor = timed(lambda: FSDPEngine(actor_ctx), device)
    mem.mark("actor_built")
    options: dict[str, Any] = {"gpu_memory_utilization": args.gpu_memory_utilization}
    if backend == "vllm":  # the variants below switch it; SGLang keeps its default (engine: request seeds turn
        options["seed_mode"] = "request"  # on its slower deterministic inference)
    t_engine, rollout = timed(lambda: _make_rollout(backend, options, common), device)
    mem.mark("engine_built")
    out: dict[str, Any] = {"backend": backend, "device": device, "dtype": dtype, "actor_build_s": t_actor,
                           "engine_build_s": t_engine}
    if backend == "vllm":
        from hybridrl_vllm import compat

        out["vllm_version"] = str(compat.version())
    else:
        import sglang

        out["sglang_version"] = sglang.__version__
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()

    # --- generation: through the rollout engine against the engine alone on the same prompts -----------------
    prompts, _ = prompt_rows(args.prompts_per_step, args.n_samples)
    ids, mask = left_pad(prompts, 0)
    batch = Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask})
    params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=1)

    def hybrid(seed_mode: str | None, logprobs: bool = True) -> Callable[[], int]:
        def run() -> int:
            from dataclasses import replace

            if seed_mode is not None:
                rollout.seed_mode = seed_mode
            return int(rollout.generate(batch, replace(params, logprobs=logprobs))[RESPONSE_MASK].sum())
        return run

    variants = _engine_alone(backend, rollout, prompts, args.new_tokens)
    if backend == "vllm":
        variants.update({"hybridrl_seed_engine": hybrid("engine"), "hybridrl_seed_request": hybrid("request"),
                         "hybridrl_no_logprobs": hybrid("engine", logprobs=False)})
    else:
        variants.update({"hybridrl": hybrid(None), "hybridrl_no_logprobs": hybrid(None, logprobs=False)})
    for fn in variants.values():  # warm-up (first-use kernels, sampler paths)
        fn()
    with_lp = "hybridrl_seed_engine" if backend == "vllm" else "hybridrl"
    # each hybridrl variant next to its engine-alone twin, the two in alternating order: a variant that
    # follows a different kind of batch (log-probs, per-row seeds) may pay for the switch, and each side
    # follows the other equally often
    pairs = [("hybridrl_no_logprobs", "engine_alone"), (with_lp, "engine_alone_logprobs")]
    if backend == "vllm":
        pairs.append(("hybridrl_seed_request", "engine_alone_logprobs_seeded"))
    samples: dict[str, list[float]] = {k: [] for k in variants}
    tokens: dict[str, int] = {}
    # the rollout's own account of each call: its preparation and packing around the engine's generate
    wrapper: dict[str, list[dict[str, float]]] = {k: [] for k in variants}
    collector: dict[str, list[dict[str, float]]] = {k: [] for k in variants}
    import gc

    gc_time = GCTime()

    # the target pair (the step benchmark's setting) runs --repeats times, the others --other-repeats times
    for repeat in range(max(args.repeats, args.other_repeats)):
        for i, (hybrid_name, alone_name) in enumerate(pairs):
            if repeat >= (args.repeats if i == 0 else args.other_repeats):
                continue
            for name in ((alone_name, hybrid_name) if repeat % 2 == 0 else (hybrid_name, alone_name)):
                gc.collect()  # no variant pays for the garbage of the one before
                gc_time.start()
                seconds, n = timed(variants[name], device)
                collector[name].append(gc_time.read())
                samples[name].append(n / seconds)
                tokens[name] = n
                timing = dict(getattr(rollout, "generate_timing", {}) or {}) if name.startswith("hybridrl") else {}
                if timing:
                    wrapper[name].append({**timing, "wall_s": seconds})
    mem.mark("after_generation")
    gen = {name: {"tokens": tokens[name], "tokens_per_s_median": statistics.median(v), "tokens_per_s": v}
           for name, v in samples.items() if v}
    for name, runs in collector.items():
        if runs:
            gen[name]["gc_s"] = [r["gc_s"] for r in runs]
            gen[name]["gc_full"] = [r["gc_full"] for r in runs]
    for name, calls in wrapper.items():
        if calls:  # the share of each call spent outside the engine's generate, in this wrapper
            shares = [(c["prepare_s"] + c["pack_s"]) / c["wall_s"] for c in calls]
            gen[name]["wrapper_share_median"] = statistics.median(shares)
            gen[name]["wrapper_seconds"] = calls
    out["generation"] = {
        "rows": len(prompts), "new_tokens": args.new_tokens, "repeats": args.repeats,
        "other_repeats": args.other_repeats, "order": "adjacent pairs, alternating",
        "variants": gen,
        # the step benchmark's setting (rollout log-probs off) against the engine alone
        "hybridrl_no_logprobs_vs_engine_alone": _paired_ratio(samples, "hybridrl_no_logprobs", "engine_alone"),
        "hybridrl_logprobs_vs_engine_alone_logprobs": _paired_ratio(samples, with_lp, "engine_alone_logprobs"),
    }
    if backend == "vllm":
        out["generation"]["hybridrl_seed_request_vs_engine_alone_logprobs_seeded"] = _paired_ratio(
            samples, "hybridrl_seed_request", "engine_alone_logprobs_seeded")
    # Move the actor away from the checkpoint both engines started from, so the agreement check at the end
    # fails if a reshard leaves any tensor behind.
    with torch.no_grad():
        gen_noise = torch.Generator(device=device).manual_seed(7)
        for p in actor.model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(torch.randn(local.shape, generator=gen_noise, device=local.device, dtype=local.dtype) * 0.02)

    # --- reshard, sleep and wake in the trainer's order ---------------------------------------------------
    bucket = int(args.bucket_mb * 2**20)
    small = batch.index(list(range(min(8, len(batch)))))
    short = SamplingParams(temperature=1.0, max_new_tokens=8, seed=2)
    cycle: dict[str, Any] = {}
    t, stats = timed(lambda: sync_in_process(actor, rollout, bucket), device)
    cycle["reshard_awake_s"] = t
    # the bytes the engine holds (its dtype), whatever dtype the export travelled in
    element_size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    nbytes = sum(p.numel() for p in actor.model.parameters()) * element_size
    cycle["exported_bytes"] = int(stats["bytes"])
    # the same bytes in one flat device-to-device copy (the floor any reshard is measured against): the best
    # of five back to back, and once in each cycle right after its sync
    dev = torch.device(device)
    flat_buffers = [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2)]  # source, destination

    def flat_copy() -> None:
        flat_buffers[1].copy_(flat_buffers[0])

    # the default level (auto: 1 while fresh, then 2); steady state from the third cycle on (the second
    # records the copies' CUDA graphs)
    train = _small_update(actor, rollout, small, short)
    cycle.update(_cycles(rollout, actor, mem, device, bucket, small, short, args.cycles, "default",
                         flat_copy=flat_copy, train=train))
    flat = min(timed(flat_copy, device)[0] for _ in range(5))
    # and the least any sync from fp32 master weights must move: one cast-copy of as many values into the
    # engine's dtype (read 4 bytes, write 2 per value)
    numel = sum(p.numel() for p in actor.model.parameters())
    cast_copy = _cast_copy_seconds(numel, getattr(torch, dtype), dev, device)
    cycle.update({"bytes": nbytes, "buckets": stats["buckets"], "flat_copy_s": flat, "cast_copy_s": cast_copy,
                  **_steady(cycle, args.cycles, flat, cast_copy)})
    # vLLM only: the KV cache alone released, weights resident (``sleep_level: kv_cache``)
    if backend == "vllm" and device == "cuda":
        try:
            rollout.wake()
            rollout.state.level = "kv_cache"
            kv = _cycles(rollout, actor, mem, device, bucket, small, short, args.cycles, "kv_only",
                         flat_copy=flat_copy, train=train)
            cycle["kv_only"] = {**kv, **_steady(kv, args.cycles, flat, cast_copy)}
            # the same with the configured bucket size, whatever the engines allow
            kv_b = _cycles(rollout, actor, mem, device, bucket, small, short, args.cycles, "kv_only_buckets",
                           large=False, flat_copy=flat_copy, train=train)
            cycle["kv_only_buckets"] = {**kv_b, **_steady(kv_b, args.cycles, flat, cast_copy)}
            # every tensor in one bucket: the host's per-bucket work once, the copies in one go
            kv_1 = _cycles(rollout, actor, mem, device, max(bucket, int(stats["bytes"])), small, short, args.cycles,
                           "kv_only_one_bucket", large=False, flat_copy=flat_copy, train=train)
            cycle["kv_only_one_bucket"] = {**kv_1, **_steady(kv_1, args.cycles, flat, cast_copy)}
            # the sync straight after the sleep (no update between): a device idle through the sleep's host work
            kv_c = _cycles(rollout, actor, mem, device, bucket, small, short, args.cycles, "kv_only_after_sleep",
                           flat_copy=flat_copy)
            cycle["kv_only_after_sleep"] = {**kv_c, **_steady(kv_c, args.cycles, flat, cast_copy)}
        except Exception as exc:  # noqa: BLE001 - keep the rest of the figures
            cycle["kv_only"] = {"error": repr(exc)[:2000]}
    flat_buffers.clear()
    out["reshard_sleep_wake"] = cycle
    # agreement: rollout log-probs against the actor's on the same tokens (same weights after the sync)
    rollout.wake()
    check = rollout.generate(small, SamplingParams(temperature=1.0, max_new_tokens=16, seed=3))
    check.update(small)
    lp = actor.compute_log_probs(check.select("prompt_ids", "prompt_mask", "response_ids", "response_mask"))
    m = check["response_mask"].bool()
    out["logprob_abs_diff_mean"] = float((lp["log_probs"] - check["rollout_log_probs"]).abs()[m].mean())
    if backend == "vllm":
        out["copy_plan"] = {"state": getattr(rollout, "copy_plan", None),
                            "placed": rollout.copy_plan_report.get("placed"),
                            "unplaced": len(rollout.copy_plan_report.get("unplaced", []))}
    if args.inprocess_steps:
        out["grpo_in_process"] = grpo_in_process(args, actor, rollout, mem, device)
    mem.mark("end")
    out["memory_gib"] = {"points": mem.points, "peak_device_used": round(mem.peak, 3)}
    if device == "cuda":
        out["memory_gib"]["torch_max_allocated"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    return out


def grpo_in_process(args: argparse.Namespace, actor: Any, rollout: Any, mem: Memory, device: str) -> dict[str, Any]:
    """GRPO steps with the actor and the rollout colocated in this process, in the trainer's phase order (wake,
    generate, sleep, reward, old log-probs, advantages, update, reshard), without Ray or a reference model:
    where Ray is not installed (the GPU host) this is the colocated loop one worker runs."""
    import torch

    from hybridrl.algorithms.advantages import AdvantageInputs
    from hybridrl.algorithms.objective import PolicyObjective, resolve_algorithm
    from hybridrl.config import AlgorithmConfig
    from hybridrl.engines import SamplingParams
    from hybridrl.engines.batch import (
        ADVANTAGES,
        OLD_LOG_PROBS,
        PROMPT_IDS,
        PROMPT_MASK,
        RESPONSE_IDS,
        RESPONSE_MASK,
        Batch,
        left_pad,
    )
    from hybridrl.model.tokenizer import build_char_tokenizer
    from hybridrl.plugins.discovery import get_registry
    from hybridrl.weights.bridges import sync_in_process

    registry = get_registry()
    algo_cfg = AlgorithmConfig(name="grpo", n_samples=args.n_samples, kl=None)
    algo = resolve_algorithm(algo_cfg, registry)
    objective = PolicyObjective(algo_cfg, registry)
    advantage_fn = registry.get("advantage", algo.advantage)
    reward_fn = registry.get("reward", "reverse")
    tok = build_char_tokenizer()
    lines = [json.loads(x) for x in (ROOT / "examples" / "data" / "reverse2.jsonl").read_text().splitlines() if x]
    bucket = int(args.bucket_mb * 2**20)
    steps = []
    for step in range(args.inprocess_steps):
        rows = [lines[(step * args.prompts_per_step + i) % len(lines)] for i in range(args.prompts_per_step)]
        ids, mask = left_pad([tok.encode(r["prompt"]) for r in rows], tok.pad_token_id)
        batch = Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask}).repeat_interleave(args.n_samples)
        batch.info["temperature"] = 1.0
        group = torch.arange(len(rows)).repeat_interleave(args.n_samples)
        t: dict[str, float] = {}
        t["wake"], _ = timed(rollout.wake, device)
        params = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=100 + step)
        t["gen"], gen = timed(lambda b=batch, p=params: rollout.generate(b, p), device)
        batch.update(gen)
        t["sleep"], _ = timed(rollout.sleep, device)
        mem.mark(f"grpo_step{step}_asleep")
        lengths = batch[RESPONSE_MASK].sum(1)
        scores = torch.tensor([float(reward_fn(rows[i // args.n_samples]["prompt"],
                                               tok.decode(batch[RESPONSE_IDS][i, :int(lengths[i])].tolist(),
                                                          skip_special_tokens=True),
                                               **{k: v for k, v in rows[i // args.n_samples].items() if k != "prompt"}))
                               for i in range(len(batch))])
        token_rewards = torch.zeros(batch[RESPONSE_MASK].shape)
        token_rewards[torch.arange(len(batch)), (lengths - 1).clamp(min=0)] = scores
        seq = batch.select(PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK)
        seq.info["temperature"] = 1.0
        t["old_log_prob"], old = timed(lambda s=seq: actor.compute_log_probs(s), device)
        adv, _ = advantage_fn(AdvantageInputs(token_rewards=token_rewards * batch[RESPONSE_MASK],
                                              response_mask=batch[RESPONSE_MASK], group_index=group))
        seq.set(OLD_LOG_PROBS, old["log_probs"])
        seq.set(ADVANTAGES, adv)
        t["update_actor"], update = timed(lambda s=seq: actor.update(s, objective), device)
        t["reshard"], stats = timed(lambda: sync_in_process(actor, rollout, bucket), device)
        mem.mark(f"grpo_step{step}_end")
        tokens = float(batch[RESPONSE_MASK].sum())
        steps.append({**{f"timing/{k}": v for k, v in t.items()}, "timing/step": sum(t.values()),
                      "perf/gen_tokens_per_s": tokens / t["gen"], "reward/mean": float(scores.mean()),
                      "actor/loss": float(update.get("loss", float("nan"))),
                      "sleep_level": getattr(rollout, "last_sleep_level", None), "reshard/bytes": stats["bytes"]})
    later = steps[1:] or steps
    keys = [k for k in steps[0] if k.startswith(("timing/", "perf/"))]
    return {"steps": len(steps), "rows": len(batch), "per_step": steps,
            "median_after_step1": {k: statistics.median(s[k] for s in later) for k in keys}}


def grpo(args: argparse.Namespace, model_dir: Path, workdir: Path) -> dict[str, Any]:
    """``hybridrl train`` with the rollout (``--backend``) colocated with the FSDP actor and reference."""
    import torch

    cuda = torch.cuda.is_available()
    run_dir = workdir / "grpo"
    shutil.rmtree(run_dir, ignore_errors=True)  # a new run each time (train refuses a folder holding an old one)
    cfg = {
        "model": {"path": str(model_dir), "dtype": "bfloat16" if cuda else "float32"},
        "data": {"train": str(ROOT / "examples" / "data" / "reverse2.jsonl"), "max_prompt_len": 16,
                 "prompts_per_step": args.prompts_per_step, "shuffle": False},
        "algorithm": {"name": "grpo", "n_samples": args.n_samples,
                      "kl": {"coef": 0.001, "estimator": "k3", "as": "loss"}},
        "pools": {"main": {"nodes": 1, "devices_per_node": 1}},
        "roles": {"actor": {"pool": "main", "backend": "fsdp", "lr": 1e-6, "micro_batch": args.micro_batch},
                  "ref": {"pool": "main", "backend": "fsdp"},
                  "rollout": {"pool": "main", "backend": args.backend, "max_new_tokens": args.new_tokens,
                              "temperature": 1.0, "ignore_eos": True,
                              "options": {"gpu_memory_utilization": args.gpu_memory_utilization}},
                  "reward": {"fn": "reverse"}},
        "trainer": {"steps": args.steps, "out": str(run_dir), "trackers": ["jsonl"], "progress": False},
    }
    cfg_path = workdir / "grpo.json"  # YAML is a superset of JSON
    cfg_path.write_text(json.dumps(cfg))
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(cfg_path)], capture_output=True,
                              text=True, timeout=args.grpo_timeout)
        code, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:  # keep the steps that finished
        code, log = -1, f"timed out after {args.grpo_timeout}s\n{exc.stdout or ''}"
    wall = time.perf_counter() - start
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    if code != 0 and not rows:
        return {"ok": False, "returncode": code, "wall_s": wall, "log_tail": str(log)[-3000:]}
    keys = ["timing/step", "timing/gen", "timing/wake", "timing/sleep", "timing/reshard", "timing/update_actor",
            "timing/ref", "timing/old_log_prob", "perf/gen_tokens_per_s", "rollout/logp_diff", "reward/mean",
            "reshard/bytes", "perf/peak_mem_mb"]
    per_step = [{k: r[k] for k in keys if k in r} for r in rows]
    later = per_step[1:] or per_step  # step 1 pays first-use costs
    summary = {k: statistics.median(s[k] for s in later) for k in keys if later and all(k in s for s in later)}
    return {"ok": code == 0, "returncode": code, "steps": len(rows), "wall_s": wall, "median_after_step1": summary,
            "per_step": per_step, "config": cfg}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["vllm", "sglang"], default="vllm")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen0.5b")
    parser.add_argument("--parts", default="micro,grpo")
    parser.add_argument("--cycles", type=int, default=9,
                        help="sleep/reshard/wake cycles per sleep level (the median is over the third on)")
    parser.add_argument("--prompts-per-step", type=int, default=32)
    parser.add_argument("--n-samples", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="pairs of the target variant (no log-probs)")
    parser.add_argument("--other-repeats", type=int, default=3, help="pairs of each other variant")
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=5, help="steps of the hybridrl train run (part grpo)")
    parser.add_argument("--inprocess-steps", type=int, default=5, help="colocated GRPO steps in the micro part")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--grpo-timeout", type=float, default=420.0)
    parser.add_argument("--part-timeout", type=float, default=480.0)
    parser.add_argument("--log-dir", default=None, help="write each part's log there")
    parser.add_argument("--workdir", default=None, help="where the model and the run go (default: a temp dir)")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/<backend>_rollout.json")
    parser.add_argument("--part-out", default=None, help=argparse.SUPPRESS)  # one part, run in a child process
    args = parser.parse_args()
    args.out = args.out or str(ROOT / "benchmarks" / "results" / f"{args.backend}_rollout.json")

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="vllm-bench-"))
    model_dir = workdir / f"model-{args.shape}"
    if args.part_out:
        result = micro(args, model_dir) if args.parts == "micro" else grpo(args, model_dir, workdir)
        Path(args.part_out).write_text(json.dumps(result, indent=2))
        return

    import torch

    t, _ = timed(lambda: build_model(args.shape, "bfloat16" if torch.cuda.is_available() else "float32", model_dir),
                 "cpu")
    result: dict[str, Any] = {"shape": args.shape, "model_build_s": t,
                              "settings": {k: v for k, v in vars(args).items() if k not in ("part_out",)}}
    for part in [p for p in args.parts.split(",") if p]:
        part_file = workdir / f"{part}.json"
        cmd = [sys.executable, __file__, *sys.argv[1:], "--parts", part, "--part-out", str(part_file),
               "--workdir", str(workdir)]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.part_timeout)
            code, log = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            code, log = -1, f"timed out after {args.part_timeout}s\n" + str(exc.stdout or "")[-3000:]
        entry: dict[str, Any] = {"wall_s": time.perf_counter() - start, "returncode": code}
        if code == 0 and part_file.exists():
            entry.update(json.loads(part_file.read_text()))
        else:
            entry["log_tail"] = log[-4000:]
        if args.log_dir:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            Path(args.log_dir, f"{part}.log").write_text(log[-200_000:])
        result[part] = entry
        print(f"{part}: returncode {code} in {entry['wall_s']:.0f}s", flush=True)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))  # after every part: a cut-off run keeps the rest
    print(json.dumps(result, indent=2)[:6000])


if __name__ == "__main__":
    main()
