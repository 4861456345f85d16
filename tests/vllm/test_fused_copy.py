"""The fused copy kernel (``hybridrl_vllm.fused_copy``): its block tables on plain addresses (anywhere), the
kernel itself under Triton's interpreter where Triton is installed (the vLLM CPU venv has it), and on a CUDA
device against ``Tensor.copy_``, alone and recorded in a graph."""

from __future__ import annotations

import gc
import importlib.util

import pytest
import torch

from hybridrl_vllm import copy_plan, fused_copy
from hybridrl_vllm.copy_plan import GraphedCopies, copy_key, distinct_layouts
from hybridrl_vllm.fused_copy import FusedCopy, plan_blocks

needs_cuda_triton = pytest.mark.skipif(not fused_copy.available(), reason="needs a CUDA device and Triton")


def test_blocks_cover_every_value_once_and_offsets_count_elements_from_the_first_pair():
    # sources fp32 (4 bytes), destinations bf16 (2 bytes); the third source lies before the first
    plan = plan_blocks([1024, 1024 + 4 * 100, 1024 - 4 * 64], [4096, 4096 + 2 * 10, 4096 + 2 * 30], [10, 1, 9], 4, 2,
                       block=4)
    assert plan.src_offsets == (0, 100, -64) and plan.dst_offsets == (0, 10, 30)
    assert plan.block_tensor == (0, 0, 0, 1, 2, 2, 2) and plan.first_block == (0, 3, 4)
    covered = [(t, (p - plan.first_block[t]) * 4) for p, t in enumerate(plan.block_tensor)]
    for t, n in enumerate(plan.numels):  # each tensor's blocks start at 0, 4, 8 ... and reach its end
        starts = [s for tt, s in covered if tt == t]
        assert starts == list(range(0, n, 4))
    # from given bases (the fused copy's own one-value tensors) instead of the first pair
    based = plan_blocks([1024, 1424], [4096, 4116], [10, 1], 4, 2, block=4, src_base=1024 + 4 * 8, dst_base=96)
    assert based.src_offsets == (-8, 92) and based.dst_offsets == ((4096 - 96) // 2, (4116 - 96) // 2)


def test_alignment_is_the_largest_vector_every_offset_allows():
    assert plan_blocks([0, 64], [0, 32], [1, 1], 4, 2).src_align == 4  # 16 bytes of fp32
    assert plan_blocks([0, 64], [0, 32], [1, 1], 4, 2).dst_align == 8  # 16 bytes of bf16
    assert plan_blocks([0, 8], [0, 2], [1, 1], 4, 2).src_align == 2  # one pair 8 bytes off
    assert plan_blocks([0, 8], [0, 2], [1, 1], 4, 2).dst_align == 1  # a view one element in
    assert plan_blocks([0, -48], [0, 6], [1, 1], 4, 2).src_align == 4  # before the base: still 16 bytes off


def test_empty_tensors_get_no_block_and_bad_input_is_refused():
    plan = plan_blocks([0, 16, 32], [0, 8, 16], [3, 0, 2], 4, 2, block=2)
    assert plan.block_tensor == (0, 0, 2) and plan.first_block == (0, 2, 2)
    with pytest.raises(ValueError, match="whole number of 4-byte elements"):
        plan_blocks([0, 6], [0, 2], [1, 1], 4, 2)
    with pytest.raises(ValueError, match="one source address"):
        plan_blocks([0], [0, 2], [1, 1], 4, 2)


def test_fits_only_contiguous_float_pairs_of_equal_size():
    a, b = torch.zeros(4, 4), torch.zeros(4, 4, dtype=torch.bfloat16)
    assert fused_copy.fits([b], [a])
    assert not fused_copy.fits([b.t()], [a])  # a transposed destination
    assert not fused_copy.fits([b], [a[:, :2]])  # other size, not contiguous
    assert not fused_copy.fits([torch.zeros(16, dtype=torch.int32)], [a.reshape(-1)])
    assert not fused_copy.fits([], [])
    assert not fused_copy.supports([b], [a])  # host tensors: never offered to the copy plan
    assert "fused" not in distinct_layouts([a], [b])


def _pairs(device: str, dtype_pairs: list[tuple[torch.dtype, torch.dtype]], exact: bool) -> tuple[list, list, list]:
    """Sources and destinations of odd sizes, destinations as views into one buffer per dtype at odd element
    offsets (not vector-aligned), covering whole blocks, partial blocks and tensors of one value.
    ``exact``: source values that every dtype here holds exactly (the interpreter truncates when narrowing)."""
    g = torch.Generator().manual_seed(0)
    sizes = [5, 4096, 4097, 10000, 1, 9000]
    srcs, dsts, buffers = [], [], {}
    for i, n in enumerate(sizes):
        src_dtype, dst_dtype = dtype_pairs[i % len(dtype_pairs)]
        values = torch.randn(n, generator=g)
        if exact:
            values = values.to(torch.bfloat16).to(torch.float16).float()
        srcs.append(values.to(src_dtype).to(device))
        buf = buffers.setdefault(dst_dtype, [torch.zeros(sum(sizes) + 8, dtype=dst_dtype, device=device), 1])
        dsts.append(buf[0][buf[1]:buf[1] + n])
        buf[1] += n + 1
    return dsts, srcs, [b for b, _ in buffers.values()]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (for its interpreter)")
def test_the_kernel_under_triton_interpreter_writes_every_value_where_it_belongs(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fused_copy._kernel.cache_clear()  # defined again, interpreted
    try:
        pairs = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
        dsts, srcs, buffers = _pairs("cpu", pairs, exact=True)
        before = [b.clone() for b in buffers]
        copy = FusedCopy(dsts, srcs, block=1024)
        assert copy.launches == 3  # one per (source, destination) dtype pair
        copy()
        assert all(torch.equal(d, s.to(d.dtype)) for d, s in zip(dsts, srcs))
        written = sum(int((b != o).sum()) for b, o in zip(buffers, before))
        assert written <= sum(d.numel() for d in dsts)  # nothing outside the views
        for buf in buffers:  # the gaps between the views (and the ends) are untouched
            assert buf[0] == 0 and buf[-1] == 0
    finally:
        fused_copy._kernel.cache_clear()


@pytest.mark.gpu
@needs_cuda_triton
def test_the_kernel_on_cuda_writes_what_copy_writes_bit_for_bit():
    pairs = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16),
             (torch.bfloat16, torch.float32)]
    dsts, srcs, buffers = _pairs("cuda", pairs, exact=False)
    want = [torch.empty_like(d).copy_(s) for d, s in zip(dsts, srcs)]  # rounds to nearest even
    FusedCopy(dsts, srcs)()
    torch.cuda.synchronize()
    assert all(torch.equal(d, w) for d, w in zip(dsts, want))
    for buf in buffers:
        assert buf[0] == 0 and buf[-1] == 0


@pytest.mark.gpu
@needs_cuda_triton
def test_a_recorded_fused_copy_reads_each_updates_values_after_its_builder_is_gone(monkeypatch):
    """The graph keeps the kernel's tables alive: replays after the capture's locals are freed still write the
    sources' new values (a freed table would be read as garbage addresses)."""
    monkeypatch.setattr(copy_plan, "fastest", lambda graphs, rounds: "fused")
    srcs = [torch.randn(n, device="cuda") for n in (1 << 18, 300, 7)]
    dsts = [torch.zeros(s.numel(), dtype=torch.bfloat16, device="cuda") for s in srcs]
    graphs = GraphedCopies()
    key = copy_key(("a", "b", "c"), dsts, srcs)
    for step in range(4):  # eager, recorded (fused kept), replayed twice
        for s in srcs:
            s.add_(1.0)
        graphs.copy(key, dsts, srcs)
        gc.collect()
        torch.cuda.empty_cache()
        torch.empty(1 << 20, dtype=torch.int64, device="cuda").fill_(-1)  # would overwrite freed tables
        torch.cuda.synchronize()
        assert all(torch.equal(d, s.to(torch.bfloat16)) for d, s in zip(dsts, srcs)), step
    assert graphs.stats["layout_fused"] == 1 and graphs.stats["replayed"] == 2


def test_a_fused_copy_keeps_no_reference_to_the_tensors_it_copies():
    """Graphs hold their fused copy for as long as they may replay; the tables must not keep an exporter's
    tensors (or the engine's) alive with them, or a trainer that moves its weights would leave the old ones
    allocated."""
    import weakref

    srcs = [torch.randn(10), torch.randn(3)]
    dsts = [torch.zeros(10, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16)]
    refs = [weakref.ref(t) for t in srcs + dsts]
    copy = FusedCopy(dsts, srcs)  # built anywhere; only its call needs the kernel
    del srcs, dsts
    gc.collect()
    assert copy.launches == 1 and all(ref() is None for ref in refs)
