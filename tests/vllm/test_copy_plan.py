"""The direct-copy plan (``hybridrl_vllm.copy_plan``) on a module laid out like vLLM's Qwen2 (packed q/k/v and
gate/up along dim 0), against an independent packing with ``torch.cat``. Engine-free."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from hybridrl.weights.buckets import ReusedBucket
from hybridrl_vllm import copy_plan
from hybridrl_vllm.copy_plan import COPY_LAYOUTS, CopyPlan, GraphedCopies, checksum, copy_key, copy_tensors, distinct_layouts

H, Q, KV, I = 8, 8, 4, 12


class PackedToy(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, kv_rows: int = KV) -> None:
        super().__init__()
        self.qkv_w = nn.Parameter(torch.zeros(Q + 2 * kv_rows, H, dtype=torch.bfloat16))
        self.qkv_b = nn.Parameter(torch.zeros(Q + 2 * kv_rows, dtype=torch.bfloat16))
        self.gate_up = nn.Parameter(torch.zeros(2 * I, H, dtype=torch.bfloat16))
        self.norm = nn.Parameter(torch.zeros(H, dtype=torch.bfloat16))

    def named_parameters(self, *args, **kwargs):  # vLLM's names
        yield "model.layers.0.self_attn.qkv_proj.weight", self.qkv_w
        yield "model.layers.0.self_attn.qkv_proj.bias", self.qkv_b
        yield "model.layers.0.mlp.gate_up_proj.weight", self.gate_up
        yield "model.norm.weight", self.norm


def hf_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = "model.layers.0."
    return {p + "self_attn.q_proj.weight": torch.randn(Q, H, generator=g),
            p + "self_attn.k_proj.weight": torch.randn(KV, H, generator=g),
            p + "self_attn.v_proj.weight": torch.randn(KV, H, generator=g),
            p + "self_attn.q_proj.bias": torch.randn(Q, generator=g),
            p + "self_attn.k_proj.bias": torch.randn(KV, generator=g),
            p + "self_attn.v_proj.bias": torch.randn(KV, generator=g),
            p + "mlp.gate_proj.weight": torch.randn(I, H, generator=g),
            p + "mlp.up_proj.weight": torch.randn(I, H, generator=g),
            "model.norm.weight": torch.randn(H, generator=g)}


def test_plan_places_packed_members_like_concatenation():
    model, hf = PackedToy(), hf_tensors(0)
    plan = CopyPlan.build(model, {n: tuple(t.shape) for n, t in hf.items()})
    assert plan.unplaced == [] and len(plan.views) == len(hf)
    rest = plan.copy(list(hf.items()))
    assert rest == []
    p = "model.layers.0."
    expected_qkv = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).to(torch.bfloat16)
    expected_bias = torch.cat([hf[p + f"self_attn.{x}_proj.bias"] for x in "qkv"]).to(torch.bfloat16)
    expected_gate_up = torch.cat([hf[p + "mlp.gate_proj.weight"], hf[p + "mlp.up_proj.weight"]]).to(torch.bfloat16)
    assert torch.equal(model.qkv_w.data, expected_qkv)
    assert torch.equal(model.qkv_b.data, expected_bias)
    assert torch.equal(model.gate_up.data, expected_gate_up)
    assert torch.equal(model.norm.data, hf["model.norm.weight"].to(torch.bfloat16))


def test_plan_verification_accepts_what_load_weights_wrote_and_catches_a_wrong_layout():
    model, hf = PackedToy(), hf_tensors(1)
    plan = CopyPlan.build(model, {n: tuple(t.shape) for n, t in hf.items()})
    # what a loader wrote: v before k (a layout the plan does not assume)
    p = "model.layers.0."
    wrote = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qvk"]).to(torch.bfloat16)
    model.qkv_w.data.copy_(wrote)
    plan_expect = {n: checksum(t.to(torch.bfloat16)) for n, t in hf.items()}
    wrong = plan.verify(plan_expect)
    assert p + "self_attn.k_proj.weight" in wrong and p + "self_attn.v_proj.weight" in wrong
    assert p + "self_attn.q_proj.weight" not in wrong
    plan.copy(list(hf.items()))
    assert plan.verify(plan_expect) == []


def test_sharded_or_mismatched_parameters_stay_with_load_weights():
    model = PackedToy(kv_rows=KV // 2)  # as if k/v were split over tensor-parallel ranks
    hf = hf_tensors(2)
    plan = CopyPlan.build(model, {n: tuple(t.shape) for n, t in hf.items()})
    assert sorted(n for n in plan.unplaced if "self_attn" in n) == sorted(n for n in hf if "self_attn" in n)
    rest = plan.copy(list(hf.items()))
    assert {n for n, _ in rest} == set(plan.unplaced)
    assert torch.equal(model.norm.data, hf["model.norm.weight"].to(torch.bfloat16))


class _RecordedCopy:
    """Stands in for a captured CUDA graph on CPU: replaying it runs the copies it was made for."""

    def __init__(self, dsts, srcs):
        self.dsts, self.srcs, self.replays = dsts, srcs, 0

    def replay(self):
        self.replays += 1
        torch._foreach_copy_(self.dsts, self.srcs)


def test_graphed_copies_capture_on_the_second_sighting_and_replay_after(monkeypatch):
    captured = []
    monkeypatch.setattr(GraphedCopies, "_capture", staticmethod(
        lambda d, s: ("large_alone", captured.append(_RecordedCopy(d, s)) or captured[-1])))
    graphs = GraphedCopies()
    dst, src = [torch.zeros(3)], [torch.arange(3.0)]
    graphs.copy("k", dst, src)
    assert (graphs.stats["eager"], graphs.stats["captured"], graphs.stats["replayed"]) == (1, 0, 0) and captured == []
    assert torch.equal(dst[0], src[0])
    src[0].add_(1)  # a trainer updating in place: the recorded copy must read the new values
    graphs.copy("k", dst, src)
    assert graphs.stats["captured"] == 1 and torch.equal(dst[0], src[0])
    assert graphs.stats["layout_large_alone"] == 1 and graphs.stats["layout_multi_tensor"] == 0
    src[0].add_(1)
    graphs.copy("k", dst, src)
    assert graphs.stats["replayed"] == 1 and captured[0].replays == 2 and torch.equal(dst[0], src[0])
    graphs.copy(None, dst, [torch.full((3,), 9.0)])  # no key (not all on one CUDA device): always eager
    assert graphs.stats["eager"] == 2 and dst[0].eq(9).all()


def _recorded_graphs(monkeypatch) -> GraphedCopies:
    monkeypatch.setattr(GraphedCopies, "_capture", staticmethod(lambda d, s: ("multi_tensor", _RecordedCopy(d, s))))
    return GraphedCopies()


def test_a_reused_bucket_is_replayed_by_identity_while_it_holds_the_same_tensors(monkeypatch):
    graphs = _recorded_graphs(monkeypatch)
    a, b = torch.arange(3.0), torch.arange(4.0)
    bucket = ReusedBucket([("a", a), ("b", b)])
    dsts, srcs = [torch.zeros(3), torch.zeros(4)], [a, b]
    graphs.remember_reused(bucket, srcs, "k")  # no graph for the key yet: nothing to remember
    assert not graphs.replay_reused(bucket)
    graphs.copy("k", dsts, srcs)
    graphs.copy("k", dsts, srcs)  # recorded
    graphs.remember_reused(bucket, srcs, "k")
    a.add_(10)  # updated in place, as an optimiser step does
    assert graphs.replay_reused(bucket)
    assert torch.equal(dsts[0], a) and graphs.stats["reused"] == 1 and graphs.stats["replayed"] == 1
    assert not graphs.replay_reused(ReusedBucket(bucket))  # the same items in another bucket: not known
    bucket[1] = ("b", torch.arange(4.0))  # another tensor in its place: its graph would read the old one
    assert not graphs.replay_reused(bucket)
    bucket[1] = ("b", b)
    assert not graphs.replay_reused(bucket), "a bucket found changed must be forgotten, not trusted again"
    assert graphs.stats["reused"] == 1 and graphs.remembered_buckets == 0


def test_a_reused_bucket_whose_tensor_moved_is_not_replayed(monkeypatch):
    graphs = _recorded_graphs(monkeypatch)
    a = torch.arange(3.0)
    bucket = ReusedBucket([("a", a)])
    for _ in range(2):
        graphs.copy("k", [torch.zeros(3)], [a])
    graphs.remember_reused(bucket, [a], "k")
    with torch.no_grad():
        a.data = a.data.clone()  # the same tensor object given new storage (an onload)
    assert not graphs.replay_reused(bucket)


def test_only_reused_buckets_copied_from_their_own_tensors_are_remembered_and_weakly(monkeypatch):
    graphs = _recorded_graphs(monkeypatch)
    a = torch.arange(3.0)
    for _ in range(2):
        graphs.copy("k", [torch.zeros(3)], [a])
    plain = [("a", a)]
    graphs.remember_reused(plain, [a], "k")  # a plain list is made afresh per update: never known by identity
    moved = ReusedBucket([("a", a)])
    graphs.remember_reused(moved, [a.clone()], "k")  # the graph reads a copy of the bucket's tensor, not it
    part = ReusedBucket([("a", a), ("rotary.inv_freq", torch.ones(2))])
    graphs.remember_reused(part, [a], "k")  # a tensor left to load_weights: the graph alone is not the import
    assert graphs.remembered_buckets == 0
    held = ReusedBucket([("a", a)])
    graphs.remember_reused(held, [a], "k")
    assert graphs.remembered_buckets == 1
    del held
    gc.collect()
    assert graphs.remembered_buckets == 0  # the exporter let it go: so does the importer


def test_graphed_copies_fall_back_for_good_when_capture_fails(monkeypatch):
    def fail(d, s):
        raise RuntimeError("capture not supported")

    monkeypatch.setattr(GraphedCopies, "_capture", staticmethod(fail))
    graphs = GraphedCopies()
    dst, src = [torch.zeros(2)], [torch.ones(2)]
    for _ in range(3):
        graphs.copy("k", dst, src)
    assert (graphs.stats["eager"], graphs.stats["captured"], graphs.stats["failed"]) == (3, 0, 1)
    assert not graphs.enabled
    assert dst[0].eq(1).all()


def test_every_copy_layout_writes_the_same_values(monkeypatch):
    """Large and small tensors, packed slices and a cast: each layout's kernels write exactly what
    ``_foreach_copy_`` writes (the layout is chosen for speed only)."""
    monkeypatch.setattr(copy_plan, "LARGE_COPY_NUMEL", 64)
    packed = torch.zeros(24, 8, dtype=torch.bfloat16)
    srcs = [torch.randn(16, 8), torch.randn(8, 8), torch.randn(5), torch.randn(100)]
    results = {}
    for layout in (name for name in COPY_LAYOUTS if name != "fused"):  # fused: CUDA only (test_fused_copy.py)
        packed.zero_()
        dsts = [packed.narrow(0, 0, 16), packed.narrow(0, 16, 8), torch.zeros(5, dtype=torch.bfloat16),
                torch.zeros(100, dtype=torch.bfloat16)]
        copy_tensors(dsts, srcs, layout)
        results[layout] = [packed.clone(), dsts[2], dsts[3]]
    want = [torch.cat([srcs[0], srcs[1]]).to(torch.bfloat16), srcs[2].to(torch.bfloat16), srcs[3].to(torch.bfloat16)]
    for layout, got in results.items():
        assert all(torch.equal(g, w) for g, w in zip(got, want)), layout
    with pytest.raises(ValueError, match="unknown copy layout 'diagonal'"):
        copy_tensors(dsts, srcs, "diagonal")


def test_only_layouts_that_launch_different_kernels_are_tried(monkeypatch):
    monkeypatch.setattr(copy_plan, "LARGE_COPY_NUMEL", 64)
    big, small = torch.zeros(64), torch.zeros(8)
    assert distinct_layouts([big]) == ("multi_tensor", "per_tensor")  # chunked over kernels, or one plain copy
    assert distinct_layouts([small]) == ("multi_tensor", "per_tensor")
    assert distinct_layouts([]) == ("multi_tensor",)
    assert distinct_layouts([small, small]) == ("multi_tensor", "per_tensor")  # large_alone is multi_tensor
    assert distinct_layouts([big, big]) == ("multi_tensor", "per_tensor")  # large_alone is per_tensor
    assert distinct_layouts([big, small]) == ("multi_tensor", "large_alone", "per_tensor")
    assert distinct_layouts([big], [big]) == ("multi_tensor", "per_tensor")  # host tensors: no fused kernel


def test_copy_key_only_for_one_cuda_device_and_changes_with_addresses():
    a, b = torch.zeros(2), torch.zeros(2)
    assert copy_key(("x",), [a], [b]) is None  # host tensors: a graph cannot read them
    if torch.cuda.is_available():
        c, d, e = (torch.zeros(2, device="cuda") for _ in range(3))
        assert copy_key(("x",), [c], [d]) == copy_key(("x",), [c], [d])
        assert copy_key(("x",), [c], [d]) != copy_key(("x",), [c], [e])


def test_plan_copy_through_graphs_writes_the_same_values():
    model, hf = PackedToy(), hf_tensors(3)
    plan = CopyPlan.build(model, {n: tuple(t.shape) for n, t in hf.items()})
    graphs = GraphedCopies()
    assert plan.copy(list(hf.items()), graphs) == []
    assert graphs.stats["eager"] == 1  # on CPU no key, so eager: same result as without graphs
    assert torch.equal(model.norm, hf["model.norm.weight"].to(torch.bfloat16))


def test_a_kept_bucket_layout_takes_each_updates_own_tensors():
    """The second update of the same bucket layout reuses where each name goes, never the first update's
    tensors: new values land, a name the plan cannot place comes back as this update's tensor, and a bucket of
    the same names with other shapes is not forced into the kept layout."""
    model, first = PackedToy(), hf_tensors(0)
    plan = CopyPlan.build(model, {n: tuple(t.shape) for n, t in first.items()})
    extra = ("rotary.inv_freq", torch.ones(3))
    assert plan.copy([*first.items(), extra]) == [extra]
    second = hf_tensors(1)
    extra2 = ("rotary.inv_freq", torch.zeros(3))
    rest = plan.copy([*second.items(), extra2])
    assert len(rest) == 1 and rest[0][1] is extra2[1]
    assert torch.equal(model.norm, second["model.norm.weight"].to(torch.bfloat16))
    odd = [(n, torch.randn(*t.shape[:-1], t.shape[-1] + 1) if t.dim() == 2 else t) for n, t in second.items()]
    rest = plan.copy(odd)  # every matrix one column wider: nothing of it may be copied into the model
    assert sorted(n for n, _ in rest) == sorted(n for n, t in second.items() if t.dim() == 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: records and times CUDA graphs")
def test_recorded_copies_keep_the_fastest_layout_and_read_each_update(monkeypatch):
    monkeypatch.setattr(copy_plan, "LARGE_COPY_NUMEL", 1 << 16)
    srcs = [torch.randn(1 << 18, device="cuda"), torch.randn(300, device="cuda"), torch.randn(7, device="cuda")]
    dsts = [torch.zeros(s.numel(), dtype=torch.bfloat16, device="cuda") for s in srcs]
    graphs = GraphedCopies()
    key = copy_key(("a", "b", "c"), dsts, srcs)
    for step in range(3):  # eager, recorded, replayed
        for s in srcs:
            s.add_(1.0)
        graphs.copy(key, dsts, srcs)
        torch.cuda.synchronize()
        assert all(torch.equal(d, s.to(torch.bfloat16)) for d, s in zip(dsts, srcs)), step
    assert (graphs.stats["eager"], graphs.stats["captured"], graphs.stats["replayed"]) == (1, 1, 1)
    assert sum(graphs.stats[f"layout_{name}"] for name in COPY_LAYOUTS) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: records and replays CUDA graphs")
def test_a_reused_bucket_through_the_plan_is_replayed_by_identity_with_each_updates_values():
    model = PackedToy().cuda()
    hf = {n: t.cuda() for n, t in hf_tensors(4).items()}
    plan = CopyPlan.build(model, {n: tuple(t.shape) for n, t in hf.items()})
    graphs, bucket = GraphedCopies(), ReusedBucket(hf.items())
    for step in range(4):  # eager, recorded, then known by identity
        for t in hf.values():
            t.add_(1.0)
        assert plan.copy(bucket, graphs) == []
        torch.cuda.synchronize()
        assert torch.equal(model.norm, hf["model.norm.weight"].to(torch.bfloat16)), step
    assert (graphs.stats["eager"], graphs.stats["captured"], graphs.stats["reused"]) == (1, 1, 2)

