"""The FSDP engine calls of one quick-start step on CPU, in this process, without Ray: where a one-rank step's
time goes inside the engine, and what a setting saves.

Builds the quick start's actor and reference (``examples/quickstart.yaml``'s tiny model) in a one-rank gloo
group, makes a batch shaped like one of its steps (16 prompts x 16 samples of the reverse task, 2-3 response
tokens ending in EOS), and times ``ref.compute_log_probs`` + ``actor.update`` (the step's train-side work)
for each variant, the variants taken in turns so that a drifting machine load hits them alike. Reports wall and
process CPU seconds (median over the repeats; the CPU seconds are what a loaded machine disturbs least) and
writes JSON. ``--profile`` prints cProfile's top functions of the first variant instead.

    python benchmarks/cpu_engine_step.py [--repeats 15] [--threads 1] [--variants default,fsdp_on_one_rank,...]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hybridrl.algorithms.objective import PolicyObjective
from hybridrl.config import load_config
from hybridrl.engines.batch import (
    ADVANTAGES,
    PROMPT_IDS,
    PROMPT_MASK,
    REF_LOG_PROBS,
    RESPONSE_IDS,
    RESPONSE_MASK,
    Batch,
)
from hybridrl.model.tiny import build_tiny_model, tiny_tokenizer
from hybridrl.plugins.discovery import get_registry
from hybridrl.testing.backends import build_engine

ROOT = Path(__file__).resolve().parents[1]

#: variant name -> (option overrides of both roles, engine-module functions replaced while its engines are built).
#: The replacements put back what an optimisation took away, to show what it saves in the same run.
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Callable[..., Any]]]] = {
    "default": ({}, {}),
    "unshared_prompts": ({"share_prompts": False}, {}),
    "padded": ({"packing": False}, {}),
    "plain_head": ({"fused_lm_head": False}, {}),
    "padded_plain_head": ({"packing": False, "fused_lm_head": False}, {}),
    "fsdp_on_one_rank": ({}, {"uses_fsdp": lambda world_size, device: True}),
    "adamw_unfused": ({}, {"fused_adamw": lambda params: None}),
}


def step_batch(cfg: Any, seed: int = 0) -> Batch:
    """A batch like the quick start's: its prompts, ``n_samples`` responses each of 2-3 tokens ending in EOS."""
    tok = tiny_tokenizer(cfg.model.tiny)
    lines = (ROOT / cfg.data.train).read_text().splitlines()
    prompts = [json.loads(line)[cfg.data.prompt_key] for line in lines[:cfg.data.prompts_per_step]]
    encoded = [tok(p, add_special_tokens=True)["input_ids"] for p in prompts]
    width = max(map(len, encoded))
    rows = cfg.data.prompts_per_step * cfg.algorithm.n_samples
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.full((rows, width), tok.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width, dtype=torch.long)
    for r in range(rows):
        ids = encoded[r // cfg.algorithm.n_samples]
        prompt_ids[r, width - len(ids):] = torch.tensor(ids)
        prompt_mask[r, width - len(ids):] = 1
    new = cfg.roles.rollout.max_new_tokens
    response_ids = torch.randint(3, len(tok), (rows, new), generator=g)
    lengths = torch.randint(new - 1, new + 1, (rows,), generator=g)
    response_mask = (torch.arange(new)[None, :] < lengths[:, None]).long()
    response_ids[torch.arange(rows), lengths - 1] = tok.eos_token_id
    response_ids = response_ids.masked_fill(response_mask == 0, tok.pad_token_id)
    return Batch.from_tensors({PROMPT_IDS: prompt_ids, PROMPT_MASK: prompt_mask, RESPONSE_IDS: response_ids,
                               RESPONSE_MASK: response_mask,
                               ADVANTAGES: torch.randn(rows, 1, generator=g).expand(rows, new).contiguous()})


def engines(model_dir: Path, cfg: Any, variant: str) -> tuple[Any, Any]:
    import hybridrl_fsdp.engine as engine_module

    overrides, replaced = VARIANTS[variant]
    saved = {name: getattr(engine_module, name) for name in replaced}
    try:
        for name, fn in replaced.items():
            setattr(engine_module, name, fn)
        return _engines(model_dir, cfg, overrides)
    finally:
        for name, fn in saved.items():
            setattr(engine_module, name, fn)


def _engines(model_dir: Path, cfg: Any, overrides: dict[str, Any]) -> tuple[Any, Any]:
    actor_cfg = cfg.roles.actor
    actor = build_engine("train", "fsdp", str(model_dir), "cpu", role="actor",
                         options={"lr": actor_cfg.lr, "grad_clip": actor_cfg.grad_clip,
                                  "micro_batch": actor_cfg.micro_batch, **overrides})
    ref = build_engine("train", "fsdp", str(model_dir), "cpu", role="ref",
                       options={"micro_batch": actor_cfg.micro_batch, **overrides})
    return actor, ref


def train_side(actor: Any, ref: Any, batch: Batch, objective: PolicyObjective) -> Callable[[], None]:
    def run() -> None:
        ref_lp = ref.compute_log_probs(batch)
        step = batch.select(PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK, ADVANTAGES)
        step.set(REF_LOG_PROBS, ref_lp["log_probs"])
        actor.update(step, objective)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "examples" / "quickstart.yaml"))
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: least disturbed by load)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_engine_step.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [])
    model_dir = build_tiny_model(cfg.model.tiny, Path(tempfile.gettempdir()) / "hybridrl-cpu-engine-step")
    objective = PolicyObjective(cfg.algorithm, get_registry())
    batch = step_batch(cfg)
    names = args.variants.split(",")
    runs = {name: train_side(*engines(model_dir, cfg, name), batch, objective) for name in names}
    for run in runs.values():  # warm-up
        run()
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.repeats):
            runs[names[0]]()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(45)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for name in names:
            w, c = time.perf_counter(), time.process_time()
            runs[name]()
            wall[name].append(time.perf_counter() - w)
            cpu[name].append(time.process_time() - c)
    result = {"config": args.config, "threads": args.threads, "repeats": args.repeats,
              "variants": {n: {"overrides": VARIANTS[n][0], "replaced": sorted(VARIANTS[n][1]),
                               "wall_s_median": statistics.median(wall[n]),
                               "cpu_s_median": statistics.median(cpu[n]), "cpu_s": cpu[n]} for n in names}}
    base = result["variants"][names[0]]["cpu_s_median"]
    for n in names:
        v = result["variants"][n]
        print(f"{n:<12} wall {v['wall_s_median']:.4f}s  cpu {v['cpu_s_median']:.4f}s  "
              f"({100 * (v['cpu_s_median'] / base - 1):+.1f}% cpu vs {names[0]})")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
