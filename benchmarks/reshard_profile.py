"""Where a colocated reshard's time goes: FSDP actor and vLLM in this process (weights resident, KV cache
released: ``sleep_level: kv_cache``), a few syncs, then the parts timed one by one and one sync under
``torch.profiler`` (host-side self time per op, device time of the copy kernels). Prints and writes JSON.

    python benchmarks/reshard_profile.py [--shape qwen0.5b] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_rollout import build_model  # noqa: E402


def _median_ms(fn, n: int = 20) -> float:
    import torch

    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="qwen0.5b")
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    parser.add_argument("--out", default="reshard_profile.json")
    args = parser.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hybridrl.engines import EngineContext, TrainingOptions
    from hybridrl.runtime.distributed import free_port, init_process_group
    from hybridrl.weights.bridges import sync_in_process
    from hybridrl_fsdp.engine import FSDPEngine
    from hybridrl_vllm.engine import VLLMRollout

    model_dir = build_model(args.shape, "bfloat16", Path(tempfile.mkdtemp()) / "model")
    os.environ.setdefault("LOCAL_RANK", "0")
    init_process_group(0, 1, "127.0.0.1", free_port(), "cuda")
    common = dict(model_path=str(model_dir), rank=0, world_size=1, device="cuda", dtype="bfloat16", seed=0)
    actor = FSDPEngine(EngineContext(role="actor", backend="fsdp", trainable=True,
                                     training=TrainingOptions(micro_batch=8), **common))
    rollout = VLLMRollout(EngineContext(role="rollout", backend="vllm", trainable=False, options={
        "gpu_memory_utilization": 0.3, "sleep_level": "kv_cache", "engine_kwargs": {"enforce_eager": True}}, **common))
    bucket = int(args.bucket_mb * 2**20)
    result: dict = {"shape": args.shape, "bucket_mb": args.bucket_mb}
    rollout.sleep()
    for _ in range(4):  # learn the plan, copy eagerly, record the graphs, replay
        sync_in_process(actor, rollout, bucket)
    result["sync_ms"] = _median_ms(lambda: sync_in_process(actor, rollout, bucket))
    result["import_stats_last"] = rollout.import_stats()
    result["export_only_ms"] = _median_ms(lambda: [b for b in actor.export_weights_transient(bucket)])
    buckets = [list(b) for b in actor.export_weights_transient(bucket)]
    result["buckets"] = len(buckets)

    def imports() -> None:
        for b in buckets:
            rollout.import_weights(b)
        rollout.finish_weight_import()

    result["import_only_ms"] = _median_ms(imports)
    from hybridrl_vllm import compat
    from hybridrl_vllm import copy_plan as cp

    graphs = compat.run_on_workers(rollout.llm, lambda w: w._hybridrl_copy_graphs)[0]
    kept = [g for g in graphs._previous.values() if g is not None]  # the last update's recorded copies

    def replay() -> None:
        for g in kept:
            g.replay()

    result["graph_replay_only_ms"] = _median_ms(replay)
    result["graphs"] = len(kept)
    plan = compat.run_on_workers(rollout.llm, lambda w: w._hybridrl_copy_plan)[0]
    dsts, srcs = [], []
    for b in buckets:
        split = plan.split(b)
        dsts += split.dsts
        srcs += split.srcs
    result["foreach_copy_eager_ms"] = _median_ms(lambda: torch._foreach_copy_(dsts, srcs))
    # the whole model's copies recorded in one graph: what the per-bucket graphs are held against
    whole = torch.cuda.CUDAGraph()
    with torch.cuda.graph(whole):
        torch._foreach_copy_(dsts, srcs)
    result["foreach_copy_one_graph_ms"] = _median_ms(whole.replay)
    # the same values as one flat tensor each side, back to back: the floor the layouts are held against
    numel = sum(p.numel() for p in actor.model.parameters())
    master = torch.empty(numel, dtype=torch.float32, device="cuda")
    served, served_again = (torch.empty(numel, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    result["flat_copy_ms"] = _median_ms(lambda: served_again.copy_(served))
    result["cast_copy_ms"] = _median_ms(lambda: served.copy_(master))
    result["rpc_noop_ms"] = _median_ms(lambda: compat.run_on_workers(rollout.llm, lambda w: None), 50)
    # the trainer's order: generate a little, release the KV cache, sync; with a timeline of the sync's calls
    from hybridrl.engines import SamplingParams
    from hybridrl.engines.batch import PROMPT_IDS, PROMPT_MASK, Batch, left_pad

    ids, mask = left_pad([[5, 6, 7, 8]] * 8, 0)
    small = Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask})
    marks: list[tuple[str, float]] = []
    real_import, real_export = rollout.import_weights, actor.export_weights_transient

    def import_marked(b):
        marks.append(("import_in", time.perf_counter()))
        real_import(b)
        marks.append(("import_out", time.perf_counter()))

    def export_marked(n):
        marks.append(("export_call", time.perf_counter()))
        return real_export(n)

    # finer marks inside the import: entry/exit of the layers a bucket goes through
    def wrap(owner, attr, label):
        real = getattr(owner, attr)

        def marked(*a, **kw):
            marks.append((label + "_in", time.perf_counter()))
            try:
                return real(*a, **kw)
            finally:
                marks.append((label + "_out", time.perf_counter()))
        return real, marked

    fine = [(cp.CopyPlan, "split", "split"), (cp.GraphedCopies, "copy", "graphs"), (compat, "run_on_workers", "rpc"),
            (torch.cuda.CUDAGraph, "replay", "replay"), (cp, "copy_key", "key")]
    originals = []
    for owner, attr, label in fine:
        real, marked = wrap(owner, attr, label)
        originals.append((owner, attr, real))
        setattr(owner, attr, marked)
    cycles = []
    for k in range(12):
        rollout.wake()
        rollout.generate(small, SamplingParams(temperature=1.0, max_new_tokens=8, seed=k))
        rollout.sleep()
        torch.cuda.synchronize()
        if k % 2:  # a cast copy of the same values right after the sleep: is the device slower then?
            t = time.perf_counter()
            served.copy_(master)
            torch.cuda.synchronize()
            cycles.append({"cast_copy_after_sleep_ms": (time.perf_counter() - t) * 1e3})
            continue
        marks.clear()
        rollout.import_weights, actor.export_weights_transient = import_marked, export_marked
        large = k < 6  # the bridge's default (views in large buckets) first, then the configured buckets
        # (in two blocks: the copy graphs are per bucket, a switch of size records them again)
        t0 = time.perf_counter()
        sync_in_process(actor, rollout, bucket, views_in_large_buckets=large)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        rollout.import_weights, actor.export_weights_transient = real_import, real_export
        cycles.append({"large_view_buckets": large, "sync_ms": (t1 - t0) * 1e3,
                       "timeline_ms": [(n, round((t - t0) * 1e3, 3)) for n, t in marks],
                       "import_stats": rollout.import_stats()})
    result["trainer_order_cycles"] = cycles
    for owner, attr, real in originals:
        setattr(owner, attr, real)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        sync_in_process(actor, rollout, bucket)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    gpu = prof.key_averages().table(sort_by="self_device_time_total", row_limit=10)
    result["profile_cpu"] = table
    result["profile_gpu"] = gpu
    print(json.dumps({k: v for k, v in result.items() if not k.startswith("profile")}, indent=2, default=str))
    print(table)
    print(gpu)
    Path(args.out).write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
