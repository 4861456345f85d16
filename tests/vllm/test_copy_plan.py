"""The direct-copy plan (``hybridrl_vllm.copy_plan``) on a module laid out like vLLM's Qwen2 (packed q/k/v and
gate/up along dim 0), against an independent packing with ``torch.cat``. Engine-free."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridrl_vllm.copy_plan import CopyPlan, GraphedCopies, checksum, copy_key

H, Q, KV, INTER = 8, 8, 4, 12


class PackedToy(nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, kv_rows: int = KV) -> None:
        super().__init__()
        self.qkv_w = nn.Parameter(torch.zeros(Q + 2 * kv_rows, H, dtype=torch.bfloat16))
        self.qkv_b = nn.Parameter(torch.zeros(Q + 2 * kv_rows, dtype=torch.bfloat16))
        self.gate_up = nn.Parameter(torch.zeros(2 * INTER, H, dtype=torch.bfloat16))
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
            p + "mlp.gate_proj.weight": torch.randn(INTER, H, generator=g),
            p + "mlp.up_proj.weight": torch.randn(INTER, H, generator=g),
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


def _recorded_graphs(monkeypatch, captured: list) -> GraphedCopies:
    def capture(self, dsts, srcs):
        self.stats["captured"] += 1
        captured.append(_RecordedCopy(dsts, srcs))
        return captured[-1]

    monkeypatch.setattr(GraphedCopies, "_capture", capture)
    return GraphedCopies()


def test_a_bucket_seen_at_the_previous_update_is_recorded_then_replayed(monkeypatch):
    captured: list = []
    graphs = _recorded_graphs(monkeypatch, captured)
    dst, src = [torch.zeros(3)], [torch.arange(3.0)]
    graphs.copy("k", dst, src)
    graphs.copy("k", dst, src)  # twice in one update: still eager (recorded only across updates)
    assert graphs.stats == {"eager": 2, "captured": 0, "replayed": 0, "failed": 0} and torch.equal(dst[0], src[0])
    graphs.end_update()
    src[0].add_(1)  # a trainer updating in place: the recorded copy must read the new values
    graphs.copy("k", dst, src)
    assert graphs.stats["captured"] == 1 and graphs.stats["replayed"] == 1 and torch.equal(dst[0], src[0])
    graphs.end_update()
    src[0].add_(1)
    graphs.copy("k", dst, src)
    assert graphs.stats["captured"] == 1 and captured[0].replays == 2 and torch.equal(dst[0], src[0])
    graphs.copy(None, dst, [torch.full((3,), 9.0)])  # no key (not all on one CUDA device): always eager
    assert graphs.stats["eager"] == 3 and dst[0].eq(9).all()


def test_only_the_last_updates_buckets_are_kept(monkeypatch):
    """A bucket that did not come at the last update (its addresses moved: another key) is dropped with its
    graph, so what is held never grows past one update's buckets."""
    captured: list = []
    graphs = _recorded_graphs(monkeypatch, captured)
    dst, src = [torch.zeros(2)], [torch.ones(2)]
    for key in ("a", "a", "a"):
        graphs.copy(key, dst, src)
        graphs.end_update()
    assert graphs.stats["captured"] == 1
    graphs.copy("b", dst, src)  # "a" moved: a new key, eager
    graphs.end_update()
    graphs.copy("a", dst, src)  # "a" back: not seen at the last update, so eager again and not replayed
    assert (graphs.stats["eager"], graphs.stats["captured"], captured[0].replays) == (3, 1, 2)
    assert set(graphs._current) == {"a"} and set(graphs._previous) == {"b"}


def test_graphed_copies_fall_back_for_good_when_capture_fails(monkeypatch):
    import torch.cuda

    class Failing:
        def __init__(self):
            raise RuntimeError("capture not supported")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Failing)
    graphs = GraphedCopies()
    dst, src = [torch.zeros(2)], [torch.ones(2)]
    for _ in range(3):
        graphs.copy("k", dst, src)
        graphs.end_update()
    assert (graphs.stats["eager"], graphs.stats["captured"], graphs.stats["failed"]) == (3, 0, 1)
    assert not graphs.enabled
    assert dst[0].eq(1).all()


def test_copy_key_only_for_one_cuda_device_and_changes_with_addresses():
    a, b = torch.zeros(2), torch.zeros(2)
    assert copy_key(("x",), [a], [b]) is None  # host tensors: a graph cannot read them
    if torch.cuda.is_available():
        c, d, e = (torch.zeros(2, device="cuda") for _ in range(3))
        assert copy_key(("x",), [c], [d]) == copy_key(("x",), [c], [d])
        assert copy_key(("x",), [c], [d]) != copy_key(("x",), [c], [e])
        assert copy_key(("x",), [c], [a]) is None  # a source on the host


def test_plan_copy_through_graphs_writes_the_same_values():
    model, hf = PackedToy(), hf_tensors(3)
    plan = CopyPlan.build(model, {n: tuple(t.shape) for n, t in hf.items()})
    graphs = GraphedCopies()
    assert plan.copy(list(hf.items()), graphs) == []
    assert graphs.stats["eager"] == 1  # on CPU no key, so eager: same result as without graphs
    assert torch.equal(model.norm, hf["model.norm.weight"].to(torch.bfloat16))


def test_each_update_copies_its_own_tensors():
    """A second update of the same names copies its own values, a name the plan cannot place comes back as
    this update's tensor, and a bucket of the same names with other shapes is not forced into the model."""
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
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: records and replays CUDA graphs")
def test_recorded_copies_read_each_updates_values_through_the_plan():
    model = PackedToy().cuda()
    hf = {n: t.cuda() for n, t in hf_tensors(4).items()}
    plan = CopyPlan.build(model, {n: tuple(t.shape) for n, t in hf.items()})
    graphs, bucket = GraphedCopies(), list(hf.items())
    p = "model.layers.0."
    for step in range(4):  # eager, recorded, replayed, replayed
        for t in hf.values():
            t.add_(1.0)
        assert plan.copy(bucket, graphs) == []
        graphs.end_update()
        torch.cuda.synchronize()
        assert torch.equal(model.norm, hf["model.norm.weight"].to(torch.bfloat16)), step
        qkv = torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).to(torch.bfloat16)
        assert torch.equal(model.qkv_w.data, qkv), step
    assert graphs.stats == {"eager": 1, "captured": 1, "replayed": 3, "failed": 0}
