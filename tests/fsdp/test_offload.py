"""``options.offload``: the state really leaves the device storage and comes back bit for bit; the optimizer
state exists from the start and its param groups change no number.

On CPU the "device" storage is host memory too, but the moves are the real ones (``HostCopy`` resizes the
storages the engine's tensors view and copies the bytes through separate buffers), so the round trips and the
engine's release points are tested here; ``tests/fsdp/test_fsdp_cuda.py`` holds the CUDA case."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _fsdp_helpers import PolicyGradient, context, local_tensor, make_batch

import hybridrl_fsdp.engine as engine_module
from hybridrl.engines.batch import LOG_PROBS
from hybridrl_fsdp.engine import FSDPEngine
from hybridrl_fsdp.offload import HostCopy, OffloadPolicy, host_buffer


def storage_bytes(tensors) -> int:
    return sum((getattr(t, "_local_tensor", t)).untyped_storage().nbytes() for t in tensors)


def optimizer_tensors(engine: FSDPEngine) -> list[torch.Tensor]:
    return [v for s in engine.optimizer.state.values() for k, v in s.items() if k != "step"]


def weights_of(engine: FSDPEngine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.full_state_dict().items()}


def moments_of(engine: FSDPEngine) -> list[torch.Tensor]:
    engine.offload_policy.ensure_optimizer()
    out = [local_tensor(t).clone() for t in optimizer_tensors(engine)]
    if engine.offload_policy.optimizer:
        engine.offload_policy.release_optimizer()
    return out


def assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_host_copy_round_trip_keeps_values_views_and_objects() -> None:
    base = torch.randn(8, 16)
    view = base[2:5]  # shares base's storage: moved once
    other = torch.arange(10.0)
    expected = [base.clone(), view.clone(), other.clone()]
    copy = HostCopy([base, view, other])
    assert copy.nbytes == base.numel() * 4 + other.numel() * 4
    copy.offload()
    assert base.untyped_storage().nbytes() == 0 and other.untyped_storage().nbytes() == 0
    copy.offload()  # a second offload is a no-op
    copy.onload()
    for tensor, want in zip((base, view, other), expected):
        assert torch.equal(tensor, want)
    base.add_(1.0)  # the objects are live again: the view sees writes to its base
    assert torch.equal(view, expected[1] + 1.0)


def test_host_buffers_are_exactly_the_size_asked() -> None:
    sizes = [272 << 20, (1 << 20) + 1, 0]  # not powers of two: the pinned allocator would round them up
    for size in sizes:
        buffer = host_buffer(size, pin=False)
        assert buffer.dtype == torch.uint8 and buffer.untyped_storage().nbytes() == size


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_host_buffers_are_page_locked_at_their_own_size_and_round_trip() -> None:
    size = (3 << 20) + 7
    buffer = host_buffer(size, pin=True)
    assert buffer.is_pinned() and buffer.untyped_storage().nbytes() == size
    weights = torch.randn(size // 4 + 1, device="cuda")
    expected = weights.clone()
    copy = HostCopy([weights])
    copy.offload()
    assert weights.untyped_storage().nbytes() == 0 and copy._host[0].is_pinned()
    copy.onload()
    assert torch.equal(weights, expected)


def test_frozen_role_with_offload_all_keeps_its_weights_on_the_host_between_forwards(process_group, tiny_model: Path):
    batch = make_batch(6, seed=21)
    plain = FSDPEngine(context(tiny_model, trainable=False))
    offloaded = FSDPEngine(context(tiny_model, trainable=False, offload="all"))
    params = list(offloaded.model.parameters())
    assert storage_bytes(params) == 0, "weights start on the host"
    assert torch.equal(offloaded.compute_log_probs(batch)[LOG_PROBS], plain.compute_log_probs(batch)[LOG_PROBS])
    assert storage_bytes(params) == 0, "and go back after the forward"
    assert_equal(weights_of(offloaded), weights_of(plain))


def test_actor_offload_optimizer_and_all_train_bit_for_bit_like_no_offload(process_group, tiny_model: Path):
    batch = make_batch(8, seed=22)
    engines = {mode: FSDPEngine(context(tiny_model, lr=1e-2, micro_batch=3, offload=mode))
               for mode in ("none", "optimizer", "all")}
    assert storage_bytes(optimizer_tensors(engines["optimizer"])) == 0  # the moments start on the host
    assert storage_bytes(engines["optimizer"].model.parameters()) > 0  # the weights stay
    for _step in range(2):
        metrics = {mode: e.update(batch, PolicyGradient()) for mode, e in engines.items()}
        assert metrics["optimizer"]["loss"] == metrics["none"]["loss"] == metrics["all"]["loss"]
        for mode in ("optimizer", "all"):
            assert storage_bytes(optimizer_tensors(engines[mode])) == 0, f"{mode}: moments back on the host"
        # the actor's weights under offload=all stay until the export that follows its update ...
        assert storage_bytes(engines["all"].model.parameters()) > 0
        exported = [(n, t.clone()) for bucket in engines["all"].export_weights_transient(1 << 20) for n, t in bucket]
        assert exported and storage_bytes(engines["all"].model.parameters()) == 0  # ... and leave after it
    reference = weights_of(engines["none"])
    for mode in ("optimizer", "all"):
        assert_equal(weights_of(engines[mode]), reference)
        for a, b in zip(moments_of(engines[mode]), moments_of(engines["none"])):
            assert torch.equal(a, b)


def test_param_groups_change_no_number(process_group, tiny_model: Path, monkeypatch):
    batch = make_batch(6, seed=23)
    one = FSDPEngine(context(tiny_model, lr=1e-2))
    monkeypatch.setattr(engine_module, "OPTIMIZER_GROUP_BYTES", 4096)  # a few parameters per group
    many = FSDPEngine(context(tiny_model, lr=1e-2, offload="optimizer"))
    assert len(one.optimizer.param_groups) == 1 and len(many.optimizer.param_groups) > 3
    for _ in range(2):
        assert one.update(batch, PolicyGradient())["loss"] == many.update(batch, PolicyGradient())["loss"]
    assert_equal(weights_of(one), weights_of(many))


def test_optimizer_state_exists_from_the_start(process_group, tiny_model: Path):
    engine = FSDPEngine(context(tiny_model))
    params = [p for p in engine.model.parameters() if p.requires_grad]
    assert set(map(id, engine.optimizer.state)) == set(map(id, params))
    for p in params:
        state = engine.optimizer.state[p]
        assert float(state["step"]) == 0 and state["step"].device.type == "cpu"
        assert state["exp_avg"].shape == p.shape and not local_tensor(state["exp_avg"]).any()


def test_checkpoint_round_trip_with_the_optimizer_offloaded(process_group, tiny_model: Path, tmp_path: Path):
    batch = make_batch(6, seed=24)
    saved = FSDPEngine(context(tiny_model, lr=1e-2, offload="optimizer"))
    saved.update(batch, PolicyGradient())
    saved.save_checkpoint(str(tmp_path / "ckpt"))
    assert storage_bytes(optimizer_tensors(saved)) == 0  # back on the host after the save
    loaded = FSDPEngine(context(tiny_model, lr=1e-2, offload="optimizer"))
    loaded.load_checkpoint(str(tmp_path / "ckpt"))
    assert storage_bytes(optimizer_tensors(loaded)) == 0
    assert saved.update(batch, PolicyGradient())["loss"] == loaded.update(batch, PolicyGradient())["loss"]
    assert_equal(weights_of(saved), weights_of(loaded))


def test_offload_option_is_checked() -> None:
    with pytest.raises(ValueError, match="offload: must be one of"):
        engine_module.FSDPSettings.from_options({"offload": "weights"})
    assert engine_module.FSDPSettings.from_options({"offload": "auto", "gradient_checkpointing": "auto"}) \
        == engine_module.FSDPSettings()  # an unresolved auto is off
    with pytest.raises(ValueError, match="offload must be one of"):
        OffloadPolicy.build("half", [], None)
