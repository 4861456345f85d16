"""The alpha-beta figures of gloo between two CPU slots of one node: two local processes (torch threads as
``hybridrl.runtime.launch`` gives two slots: the cores halved) all-gather a shard over and over, at a few sizes,
two ways: ``c10d`` (``dist.all_gather_into_tensor``) and ``dtensor`` (``DTensor.full_tensor`` of a sharded
tensor: how the FSDP engine's weight export gathers, through the functional collectives FSDP2 uses too). A line
``seconds = alpha + bytes / beta`` through the means of the engine's path gives the per-collective latency
(alpha: ``profile.LINK_LATENCY["tcp"]``) and the bandwidth (beta). Means, not medians: a step pays every
collective, the slow ones too. ``--rounds`` repeats the whole measurement (a shared machine drifts): the figures
are the rounds' medians, ``alpha_rounds_s`` each round's. Prints and writes JSON.

    python benchmarks/gloo_latency.py [--iters 300] [--rounds 3] [--out benchmarks/results/gloo_latency.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
#: bytes each rank holds (its shard): a scalar, and the shards of small to mid-sized parameters
SIZES = (4, 8 << 10, 64 << 10, 512 << 10)
PATHS = ("c10d", "dtensor")
#: the path whose line gives alpha and beta: the one the engine's collectives take
ENGINE_PATH = "dtensor"


def _gather(path: str, numel: int, world: int) -> Callable[[], Any]:
    """One all-gather of a ``numel``-element shard per rank, by ``path``."""
    import torch
    import torch.distributed as dist

    if path == "c10d":
        shard, full = torch.ones(numel), torch.zeros(numel * world)
        return lambda: dist.all_gather_into_tensor(full, shard)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    sharded = distribute_tensor(torch.ones(numel * world), mesh, [Shard(0)])
    return lambda: sharded.full_tensor()


def _worker(rank: int, world: int, init: str, iters: int, threads: int, out: str) -> None:
    """One rank: every (path, size) ``iters`` times after a warm-up; rank 0 writes the mean and median."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    rows = []
    for path in PATHS:
        for size in SIZES:
            run = _gather(path, max(1, size // 4), world)
            for _ in range(10):
                run()
            dist.barrier()
            times = []
            for _ in range(iters):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            rows.append({"path": path, "shard_bytes": max(1, size // 4) * 4, "mean_s": statistics.fmean(times),
                         "median_s": statistics.median(times), "p90_s": sorted(times)[int(0.9 * len(times))]})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()  # no rank leaves while the other still talks to it
    dist.destroy_process_group()


def fit(rows: list[dict[str, Any]], world: int) -> dict[str, float]:
    """Least squares ``mean = alpha + received / beta`` over the engine path's sizes (``received``: the
    ``world - 1`` shards a rank takes in)."""
    own = [r for r in rows if r["path"] == ENGINE_PATH]
    xs = [r["shard_bytes"] * (world - 1) for r in own]
    ys = [r["mean_s"] for r in own]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    alpha = my - slope * mx
    return {"alpha_s": alpha, "beta_bytes_per_s": 1 / slope if slope > 0 else float("inf")}


def measure(ranks: int, iters: int, threads: int) -> list[dict[str, Any]]:
    """One round: ``ranks`` fresh processes time every path and size (rank 0's rows)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init, raw = f"file://{tmp}/rendezvous", f"{tmp}/rows.json"
        mp.spawn(_worker, args=(ranks, init, iters, threads, raw), nprocs=ranks, join=True)
        rows: list[dict[str, Any]] = json.loads(Path(raw).read_text())
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    parser.add_argument("--out", default=str(HERE / "results" / "gloo_latency.json"))
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    threads = args.threads or max(1, cores // args.ranks)
    rounds = [measure(args.ranks, args.iters, threads) for _ in range(args.rounds)]
    fits = [fit(rows, args.ranks) for rows in rounds]
    result = {"benchmark": "gloo_latency", "device": f"cpu {cores} cores ({platform.machine()})",
              "ranks": args.ranks, "threads_per_rank": threads, "iters": args.iters, "engine_path": ENGINE_PATH,
              "command": " ".join(["python", "benchmarks/gloo_latency.py", *sys.argv[1:]]),
              "alpha_s": statistics.median(f["alpha_s"] for f in fits),
              "beta_bytes_per_s": statistics.median(f["beta_bytes_per_s"] for f in fits),
              "alpha_rounds_s": [f["alpha_s"] for f in fits], "rounds": rounds}
    for n, rows in enumerate(rounds, 1):
        for r in rows:
            print(f"round {n} {r['path']:8s} {r['shard_bytes']:>8d} B  mean {r['mean_s'] * 1e3:6.3f} ms  median "
                  f"{r['median_s'] * 1e3:6.3f} ms  p90 {r['p90_s'] * 1e3:6.3f} ms")
    print(f"{ENGINE_PATH}: alpha {result['alpha_s'] * 1e3:.3f} ms (rounds "
          f"{', '.join(f'{a * 1e3:.3f}' for a in result['alpha_rounds_s'])}), "
          f"beta {result['beta_bytes_per_s'] / 1e9:.2f} GB/s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
