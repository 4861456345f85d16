"""Rows balanced over data-parallel ranks by tokens (``balanced_order``, ``token_balanced_order``), and the
worker group's scatter/gather keeping the caller's row order around it (real Ray, a tiny echo actor)."""

from __future__ import annotations

import random

import pytest
import torch

from hybridrl.engines.batch import (
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    Batch,
    balanced_order,
    token_balanced_order,
)


def chunk_loads(lengths: list[int], order: list[int], parts: int) -> list[int]:
    size = len(order) // parts
    return [sum(lengths[i] for i in order[p * size:(p + 1) * size]) for p in range(parts)]


def test_balanced_order_gives_equal_rows_and_near_equal_tokens():
    rng = random.Random(0)
    lengths = sorted((rng.randint(16, 1024) for _ in range(64)), reverse=True)  # the long rows first: worst case
    for parts in (2, 4, 8):
        order = balanced_order(lengths, parts)
        assert sorted(order) == list(range(64))
        balanced, naive = chunk_loads(lengths, order, parts), chunk_loads(lengths, list(range(64)), parts)
        assert max(balanced) - min(balanced) <= max(lengths), balanced
        assert max(balanced) < max(naive) - max(lengths), (balanced, naive)  # the naive split is far off
        for p in range(parts):  # each chunk keeps its rows in their original order
            chunk = order[p * 64 // parts:(p + 1) * 64 // parts]
            assert chunk == sorted(chunk)


def test_nothing_to_balance():
    assert balanced_order([3, 1, 2], 1) == [0, 1, 2]
    assert balanced_order([3, 1, 2], 2) == [0, 1, 2]  # does not divide: left as is
    prompts = Batch.from_tensors({PROMPT_IDS: torch.ones(4, 3, dtype=torch.long),
                                  PROMPT_MASK: torch.ones(4, 3, dtype=torch.long)})
    assert token_balanced_order(prompts, 2) is None  # a generation batch: no responses yet


def _sequences(lengths: list[int]) -> Batch:
    width = max(lengths)
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    return Batch.from_tensors({PROMPT_IDS: torch.ones(len(lengths), 1, dtype=torch.long),
                               PROMPT_MASK: torch.ones(len(lengths), 1, dtype=torch.long),
                               RESPONSE_IDS: torch.arange(len(lengths))[:, None].repeat(1, width),
                               RESPONSE_MASK: mask})


def test_worker_group_scatters_by_tokens_and_gathers_in_the_callers_order():
    """Two ranks; rows longest first (an even split would give rank 0 all the long rows). Each rank reports
    its tokens; the gathered rows come back in the caller's order, the padding row stripped."""
    ray = pytest.importorskip("ray")
    from hybridrl.engines import DataParallelInfo
    from hybridrl.runtime.group import WorkerGroup
    from hybridrl.runtime.local_ray import start_local_ray, stop_local_ray

    @ray.remote(num_cpus=0)
    class Echo:
        def call(self, role, method, batch):
            tokens = int(batch[PROMPT_MASK].sum() + batch[RESPONSE_MASK].sum())
            return Batch.from_tensors({"row": batch[RESPONSE_IDS][:, 0],
                                       "tokens": torch.full((len(batch),), tokens)}), 0.0

    owned = not ray.is_initialized()  # else the Ray of an earlier test in this process (pytest-xdist): kept up
    if owned:
        start_local_ray(2, {})
    try:
        group = WorkerGroup(plan=None, workers=[Echo.remote(), Echo.remote()])
        group.dp["actor"] = [DataParallelInfo(0, 2), DataParallelInfo(1, 2)]
        lengths = [90, 80, 70, 60, 5, 4, 3]  # 7 rows: one padding row makes 8
        out = group.call("actor", "compute", _sequences(lengths), zero_pad_keys=(RESPONSE_MASK,)).value
        assert out["row"].tolist() == list(range(7))
        per_rank = sorted(set(out["tokens"].tolist()))
        assert len(per_rank) == 2 and per_rank[1] - per_rank[0] <= max(lengths), per_rank
    finally:
        if owned:
            stop_local_ray()
