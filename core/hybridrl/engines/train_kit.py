"""Pieces every train engine needs whatever its backend (torch only, no backend import): checking the
process group the host made, the engine's device, the sampling temperature to undo, the micro-batch count
agreement that keeps collectives from hanging, and metric averaging over micro-batches."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from hybridrl.engines.batch import Batch
from hybridrl.engines.contracts import EngineContext
from hybridrl.runtime.distributed import all_reduce_sum


def require_process_group(ctx: EngineContext, engine: str) -> None:
    """The host owns the process group; an engine that created its own would hide a launch bug."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{engine} needs the default torch.distributed process group: call "
                           "hybridrl.runtime.distributed.init_process_group(rank, world_size, ...) before building it")
    if dist.get_world_size() != ctx.world_size or dist.get_rank() != ctx.rank:
        raise RuntimeError(f"process group is rank {dist.get_rank()} of {dist.get_world_size()} but the engine "
                           f"context says rank {ctx.rank} of {ctx.world_size}")


def engine_device(ctx: EngineContext) -> torch.device:
    if ctx.device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("EngineContext.device is 'cuda' but CUDA is not available")
        return torch.device("cuda", torch.cuda.current_device())
    if ctx.device != "cpu":
        raise ValueError(f"unknown device '{ctx.device}' (expected 'cpu' or 'cuda')")
    return torch.device("cpu")


def release_cached_device_memory(collect: bool = False) -> None:
    """Give the CUDA caching allocator's free blocks back to the device: a colocated rollout calls it before it
    maps its weights and KV cache back, since the trainers of the same process leave the activations and
    logits of their phases cached there. ``collect`` first runs the garbage collector, for tensors only a
    reference cycle still holds (a traceback, a closure). Nothing happens without an initialised CUDA."""
    if collect:
        import gc

        gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        from hybridrl.observe.memory import release_cache_metered

        release_cache_metered()


def sampling_temperature(batch: Batch) -> float | None:
    """The rollout's sampling temperature, if it rescaled the logits (None/0 = greedy or unscaled)."""
    value = batch.info.get("temperature")
    return float(value) if value is not None and float(value) > 0 and float(value) != 1.0 else None


def raise_if_counts_differ(n_sum: float, n_sq_sum: float, world_size: int) -> None:
    """Every micro-batch is a collective (all-gathers, all-reduces, pipeline sends), so unequal micro-batch
    counts would hang. ``world * sum(n^2) == sum(n)^2`` holds exactly when all ``n`` are equal
    (Cauchy-Schwarz)."""
    if world_size * n_sq_sum != n_sum * n_sum:
        raise RuntimeError("data-parallel ranks got local batches with different numbers of micro-batches; "
                           "give every rank the same batch size (see Batch.pad_to_multiple)")


def check_same_count(n_micro: int, device: str) -> None:
    """``raise_if_counts_differ`` over the default group (one all-reduce; nothing with a single rank)."""
    if dist.get_world_size() == 1:
        return
    n_sum, n_sq_sum = all_reduce_sum([float(n_micro), float(n_micro * n_micro)], device)
    raise_if_counts_differ(n_sum, n_sq_sum, dist.get_world_size())


class WeightedMean:
    """Per-key mean of an objective's metrics, each micro-batch weighted (by its number of real rows)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.weights: dict[str, float] = defaultdict(float)

    def add(self, metrics: Mapping[str, Any], weight: float) -> None:
        for key, value in metrics.items():
            self.sums[key] += float(value) * weight
            self.weights[key] += weight

    def result(self) -> dict[str, float]:
        return {key: self.sums[key] / self.weights[key] for key in self.sums if self.weights[key] > 0}
