"""Packed against padded micro-batches: the FSDP engine's training tokens/s and MFU, side by side in one run.

The train side of a GRPO step (the reference's log-probs, then one actor update) on one device, in this process
(one-rank process group, no Ray, no rollout engine), for each variant in turn on the same batch:

* ``shared``: rows laid end to end (``options.packing``) with each distinct prompt once per micro-batch
  (``share_prompts: true``, what ``auto`` picks; ``--samples`` consecutive rows share a prompt), at most
  ``--token-budget`` real tokens per micro-batch. Its tokens/s count every row's prompt (the batch's tokens, as
  for the others: what a user's step gets through); its MFU counts each distinct prompt once (the work done);
* ``packed``: the same with each row's own copy of its prompt (``share_prompts: false``);
* ``padded``: ``packing: false``, ``--token-budget // (prompt_len + max_response)`` rows per micro-batch (the
  same tokens per forward, padding included, so both hold about the same activations), each padded to its
  longest row;
* ``padded_sorted`` (``--variants`` only): ``packing: false`` under the same token budget (rows sorted by length
  before binning, fewer rows where they are long).
* ``<variant>_unfused`` (``--variants`` only): the variant without the fused RMSNorm/SwiGLU/rotary kernels
  (``options.fused_kernels: false``; the others take the default, ``auto``).
* ``<variant>_foreach`` (``--variants`` only): the variant with AdamW's foreach ops instead of its fused kernel
  (``options.optimizer_implementation: foreach``; the others take the default, ``auto``).
* ``<variant>_recompute`` (``--variants`` only): the variant with the fused head making its logits again in the
  backward (``options.head_logits: recompute``); the others keep them from the forward (``keep``, what the plan
  picks for these shapes on an H200).
* ``<variant>@<tokens>`` (``--variants`` only): the variant under a token budget of its own, e.g.
  ``packed@32768,packed@65536``.

``--profile``: one more reference forward and update per variant under ``torch.profiler``; the JSON keeps the
kernels that took the most device time (name, calls, milliseconds).

Workloads: ``ragged`` (the default) - response lengths drawn uniformly in ``--min-response..--max-response``
(16..1024), each response ending in EOS (the mask stops there, as a sampled response's does); ``standard`` - every
response exactly ``--max-response`` (256) tokens, issue 9's fixed-length workload. Prompts are ``--prompt-len``
tokens, 512 rows (64 prompts x 8 samples) by default.

Reports per variant: seconds (median of ``--repeats`` after one warm-up) of ``ref`` (forward) and ``update_actor``
(forward + backward + AdamW), training tokens/s (real prompt + response tokens over the update's seconds), and
``perf/mfu/<phase>`` by ``hybridrl.observe.flops`` (6 N tokens for the update, 2 N for the reference, real tokens
only). It also checks that the variants' reference log-probs agree (the largest difference is in the JSON).
Writes ``packing_step_<size>_<workload>.json``.

    python benchmarks/packing_step.py --size 0.5b                       # on one GPU (see benchmarks/gpu)
    python benchmarks/packing_step.py --size 3b --rows 256 --gradient-checkpointing
    python benchmarks/packing_step.py --size tiny --device cpu --rows 16 --max-response 64 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))

from model_sizes import ensure_model  # noqa: E402  (benchmarks/ is not a package)

from hybridrl.observe.profile import profile_call  # noqa: E402
from hybridrl_fsdp.memory import TRAIN_TOKEN_BUDGETS  # noqa: E402

VARIANTS = ("packed", "shared", "padded", "padded_sorted")


def ragged_batch(rows: int, prompt_len: int, min_response: int, max_response: int, vocab: int, eos: int, pad: int,
                 seed: int = 0, fixed: bool = False, samples: int = 1):
    """A step's batch: ``rows`` prompts of ``prompt_len`` tokens, each repeated by ``samples`` consecutive rows
    (a GRPO group), and responses of lengths drawn uniformly in ``min_response..max_response`` (``fixed``: all
    ``max_response``), each ending in ``eos``, right-padded with ``pad`` (the response mask 0 there). Token ids
    avoid the special ids."""
    from hybridrl.engines.batch import ADVANTAGES, PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK, Batch

    if not 1 <= min_response <= max_response:
        raise ValueError(f"response lengths need 1 <= min ({min_response}) <= max ({max_response})")
    g = torch.Generator().manual_seed(seed)
    special = {eos, pad}
    low = max(special) + 1 if max(special) + 1 < vocab else 0

    def tokens(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randint(low, vocab, shape, generator=g)

    lengths = (torch.full((rows,), max_response) if fixed else
               torch.randint(min_response, max_response + 1, (rows,), generator=g))
    width = int(lengths.max())
    response_mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    response_ids = tokens((rows, width)).masked_fill(response_mask == 0, pad)
    response_ids[torch.arange(rows), lengths - 1] = eos
    advantages = torch.randn(rows, 1, generator=g).expand(rows, width) * response_mask
    prompts = tokens((-(-rows // samples), prompt_len)).repeat_interleave(samples, dim=0)[:rows]
    return Batch.from_tensors({PROMPT_IDS: prompts,
                               PROMPT_MASK: torch.ones(rows, prompt_len, dtype=torch.long),
                               RESPONSE_IDS: response_ids, RESPONSE_MASK: response_mask,
                               ADVANTAGES: advantages.contiguous()})


def variant_options(variant: str, token_budget: int, rows_per_micro: int) -> dict[str, Any]:
    """The engine options of a variant (see the module docstring): ``<variant>_unfused`` is the same without the
    fused layer kernels (``options.fused_kernels: false``), ``<variant>_foreach`` with AdamW's foreach ops,
    ``<variant>_recompute`` with the head's logits made again in the backward."""
    base, extra = variant, {"head_logits": "keep"}
    for suffix, option in (("_unfused", {"fused_kernels": False}),
                           ("_foreach", {"optimizer_implementation": "foreach"}),
                           ("_recompute", {"head_logits": "recompute"})):
        if base.endswith(suffix):
            base, extra = base.removesuffix(suffix), {**extra, **option}
    if base in ("packed", "shared"):
        return {"packing": True, "share_prompts": base == "shared", "max_tokens_per_micro_batch": token_budget,
                **extra}
    if base == "padded":
        return {"packing": False, "micro_batch": rows_per_micro, **extra}
    if base == "padded_sorted":
        return {"packing": False, "max_tokens_per_micro_batch": token_budget, **extra}
    raise ValueError(f"unknown variant '{variant}' (known: {', '.join(VARIANTS)}, each also as <name>_unfused, "
                     "<name>_foreach or <name>_recompute)")


def build(role: str, model_dir: Path, device: str, dtype: str, options: dict[str, Any], seed: int = 0):
    from hybridrl.engines import EngineContext, TrainingOptions
    from hybridrl.roles import role_spec
    from hybridrl_fsdp.engine import FSDPEngine

    training, own = TrainingOptions.split({"lr": 1e-6, "grad_clip": 1.0, **options})
    ctx = EngineContext(role=role, backend="fsdp", model_path=str(model_dir), rank=0, world_size=1, device=device,
                        dtype=dtype, seed=seed, trainable=role_spec(role).trainable, options=own, training=training)
    return FSDPEngine(ctx)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(variant: str, args: argparse.Namespace, model_dir: Path, batch, objective) -> dict[str, Any]:
    """Build the variant's reference and actor, run warm-up + ``repeats`` train sides, free them."""
    from hybridrl.engines.batch import LOG_PROBS, REF_LOG_PROBS

    dtype = "bfloat16" if args.device == "cuda" else "float32"
    variant, _, budget = variant.partition("@")
    token_budget = int(budget) if budget else args.token_budget
    rows_per_micro = max(1, token_budget // (args.prompt_len + args.max_response))
    options = variant_options(variant, token_budget, rows_per_micro)
    own = {"gradient_checkpointing": args.gradient_checkpointing}
    ref = build("ref", model_dir, args.device, dtype, {k: v for k, v in options.items()})
    actor = build("actor", model_dir, args.device, dtype, {**options, **own})
    seconds: dict[str, list[float]] = {"ref": [], "update_actor": []}
    ref_log_probs = None
    peak_mb = None
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(args.repeats + 1):
        synchronize(args.device)
        t0 = time.perf_counter()
        ref_out = ref.compute_log_probs(batch)
        synchronize(args.device)
        t1 = time.perf_counter()
        step = batch.select(*batch.tensors.keys())
        step.set(REF_LOG_PROBS, ref_out[LOG_PROBS])
        metrics = actor.update(step, objective)
        synchronize(args.device)
        t2 = time.perf_counter()
        if i == 0:
            ref_log_probs = ref_out[LOG_PROBS]
            continue  # warm-up: kernel selection, allocator growth
        seconds["ref"].append(t1 - t0)
        seconds["update_actor"].append(t2 - t1)
    if args.device == "cuda":
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    profiled = {}
    if args.profile and args.device == "cuda":
        step = batch.select(*batch.tensors.keys())
        step.set(REF_LOG_PROBS, ref_log_probs)
        profiled = {"profile_ref": profile_call(ref.compute_log_probs, batch)[1]["top"],
                    "profile_update": profile_call(actor.update, step, objective)[1]["top"]}
    del ref, actor
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return {"options": {**options, **own}, "seconds": seconds,
            "median_s": {k: statistics.median(v) for k, v in seconds.items()},
            "last_update_metrics": {k: float(v) for k, v in metrics.items()},
            "peak_allocated_mb": peak_mb, "_ref_log_probs": ref_log_probs, **profiled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="0.5b", help="0.5b, 1.5b, 3b, 7b (examples/configs) or tiny")
    parser.add_argument("--workload", choices=["ragged", "standard"], default="ragged")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--rows", type=int, default=512, help="sequences per step (64 prompts x 8 samples)")
    parser.add_argument("--samples", type=int, default=8, help="consecutive rows that share a prompt")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--min-response", type=int, default=16)
    parser.add_argument("--max-response", type=int, default=None, help="default: 1024 (ragged), 256 (standard)")
    parser.add_argument("--token-budget", type=int, default=TRAIN_TOKEN_BUDGETS[0],
                        help="tokens per micro-batch (see the variants); the default is the plan's largest, what it "
                             "picks for the 0.5B shape on an H200 (roles.actor.max_tokens_per_micro_batch)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="shared,packed,padded")
    parser.add_argument("--profile", action="store_true", help="keep each variant's top kernels (torch.profiler)")
    parser.add_argument("--workdir", default="/tmp/model-sizes", help="where the random-weight models are built")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/packing_step_<size>_<workload>.json")
    args = parser.parse_args()

    from hybridrl.algorithms.objective import PolicyObjective
    from hybridrl.config.schema import AlgorithmConfig
    from hybridrl.engines.batch import PROMPT_MASK, RESPONSE_MASK
    from hybridrl.observe.flops import batch_prompt_savings, detect_device_name, forward_flops, peak_flops
    from hybridrl.placement.memory import read_hf_config, shape_from_hf_config
    from hybridrl.plugins.discovery import get_registry
    from hybridrl.runtime.distributed import free_port, init_process_group

    t_start = time.perf_counter()
    if args.max_response is None:
        args.max_response = 1024 if args.workload == "ragged" else 256
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    model_dir, build_s = ensure_model(args.size, dtype, Path(args.workdir))
    hf = read_hf_config(model_dir)
    shape = shape_from_hf_config(hf)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    batch = ragged_batch(args.rows, args.prompt_len, args.min_response, args.max_response, int(hf["vocab_size"]),
                         tok.eos_token_id, tok.pad_token_id, fixed=args.workload == "standard", samples=args.samples)
    seq_lens = (batch[PROMPT_MASK].sum(1) + batch[RESPONSE_MASK].sum(1)).tolist()
    real_tokens = float(sum(seq_lens))
    init_process_group(0, 1, "127.0.0.1", free_port(), args.device)
    objective = PolicyObjective(AlgorithmConfig.model_validate(
        {"name": "grpo", "kl": {"coef": 0.001, "estimator": "k3", "as": "loss"}}), get_registry())
    device_name = detect_device_name(args.device)
    peak = peak_flops(device_name, dtype)
    forward = forward_flops(shape, seq_lens)
    shared_forward = forward - batch_prompt_savings(shape, batch)

    results: dict[str, Any] = {}
    reference = None
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        got = measure(variant, args, model_dir, batch, objective)
        log_probs = got.pop("_ref_log_probs")
        if reference is None:
            reference = log_probs
        mask = batch[RESPONSE_MASK].bool()
        got["ref_log_probs_max_abs_diff_vs_first_variant"] = float((log_probs - reference).abs()[mask].max())
        med = got["median_s"]
        work = shared_forward if got["options"].get("share_prompts") else forward
        flops = {"ref": work, "update_actor": 3 * work}
        got["train_tokens_per_s"] = real_tokens / med["update_actor"]
        got["perf"] = {f"perf/tflops_per_device/{p}": flops[p] / med[p] / 1e12 for p in med}
        if peak:
            got["perf"].update({f"perf/mfu/{p}": flops[p] / med[p] / peak for p in med})
        results[variant] = got
        print(f"{variant:<14} ref {med['ref']:.3f}s  update {med['update_actor']:.3f}s  "
              f"train {got['train_tokens_per_s']:,.0f} tok/s  "
              + "  ".join(f"{k.removeprefix('perf/')} {v:.3f}" for k, v in got["perf"].items() if "mfu" in k),
              flush=True)
    names = list(results)
    first = "padded" if "padded" in results else names[0]
    speedups = {n: results[n]["train_tokens_per_s"] / results[first]["train_tokens_per_s"] for n in names}
    out = {
        "benchmark": "packing_step", "size": args.size, "shape": f"qwen2.5-{args.size}" if args.size != "tiny"
        else "tiny", "device": args.device, "device_name": device_name, "dtype": dtype,
        "peak_flops": peak, "workload": {"name": args.workload, "rows": args.rows, "prompt_len": args.prompt_len,
                                         "response_lengths": [args.min_response, args.max_response],
                                         "real_tokens": real_tokens,
                                         "padded_tokens": float(args.rows * (args.prompt_len + batch[RESPONSE_MASK]
                                                                             .shape[1]))},
        "token_budget": args.token_budget, "gradient_checkpointing": args.gradient_checkpointing,
        "repeats": args.repeats, "variants": results,
        "train_tokens_per_s_over_" + first: speedups,
        "model_build_s": build_s, "wall_s": time.perf_counter() - t_start,
    }
    path = Path(args.out or RESULTS / f"packing_step_{args.size}_{args.workload}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print("train tokens/s over " + first + ": " + ", ".join(f"{n} {s:.2f}x" for n, s in speedups.items()))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
