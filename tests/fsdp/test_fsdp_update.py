"""``update``: descent, lr=0, warmup, frozen engines, non-finite steps, configuration errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _fsdp_helpers import NaNObjective, PolicyGradient, context, local_tensor, make_batch

import hybridrl_fsdp.engine as engine_module
from hybridrl.engines.batch import ADVANTAGES, LOG_PROBS, RESPONSE_MASK
from hybridrl.engines.train_kit import raise_if_counts_differ
from hybridrl_fsdp.engine import FSDPEngine


def objective_value(engine: FSDPEngine, batch) -> float:
    """The policy-gradient loss of the whole batch, from ``compute_log_probs``."""
    lp = engine.compute_log_probs(batch)[LOG_PROBS]
    mask = batch[RESPONSE_MASK].float()
    return float(-(lp * batch[ADVANTAGES] * mask).sum() / mask.sum())


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0, msg=name)


def test_update_lowers_objective(process_group, tiny_model: Path) -> None:
    engine = FSDPEngine(context(tiny_model, lr=1e-3, micro_batch=2))
    batch = make_batch(6, seed=4)
    before = objective_value(engine, batch)
    metrics = engine.update(batch, PolicyGradient())
    after = objective_value(engine, batch)
    assert after < before
    assert metrics["loss"] == pytest.approx(before, abs=1e-5)  # the engine's loss is the exact batch loss
    assert metrics["lr"] == pytest.approx(1e-3)
    assert metrics["skipped_step"] == 0.0 and metrics["grad_norm"] > 0
    assert "mean_log_prob" in metrics


def test_zero_lr_keeps_weights(process_group, tiny_model: Path) -> None:
    engine = FSDPEngine(context(tiny_model, lr=0.0))
    before = engine.full_state_dict()
    metrics = engine.update(make_batch(4, seed=6), PolicyGradient())
    assert metrics["grad_norm"] > 0
    assert_same_weights(engine.full_state_dict(), before)


def test_linear_warmup(process_group, tiny_model: Path) -> None:
    engine = FSDPEngine(context(tiny_model, lr=1e-3, warmup_steps=4))
    batch = make_batch(2, seed=7)
    lrs = [engine.update(batch, PolicyGradient())["lr"] for _ in range(5)]
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])


def test_frozen_engine_refuses_update(process_group, tiny_model: Path) -> None:
    engine = FSDPEngine(context(tiny_model, trainable=False))
    assert engine.optimizer is None
    assert not any(p.requires_grad for p in engine.model.parameters())
    batch = make_batch(3, seed=8)
    assert engine.compute_log_probs(batch)[LOG_PROBS].shape == batch[RESPONSE_MASK].shape
    with pytest.raises(RuntimeError, match="frozen"):
        engine.update(batch, PolicyGradient())


def test_nan_loss_skips_step(process_group, tiny_model: Path) -> None:
    engine = FSDPEngine(context(tiny_model, lr=1e-2, micro_batch=2))
    batch = make_batch(4, seed=9)
    before = engine.full_state_dict()
    metrics = engine.update(batch, NaNObjective())
    assert metrics["skipped_step"] == 1.0
    assert not torch.isfinite(torch.tensor(metrics["grad_norm"]))
    assert_same_weights(engine.full_state_dict(), before)
    assert all(p.grad is None for p in engine.model.parameters())
    states = list(engine.optimizer.state.values())  # created at start (the KV sizing needs them resident)
    assert states and all(float(s["step"]) == 0 and not local_tensor(s["exp_avg"]).any()
                          and not local_tensor(s["exp_avg_sq"]).any() for s in states), \
        "a skipped step must not touch the AdamW moments"
    recovered = engine.update(batch, PolicyGradient())  # the next good step runs normally
    assert recovered["skipped_step"] == 0.0 and recovered["lr"] == pytest.approx(1e-2)
    assert any(not torch.equal(t, before[n]) for n, t in engine.full_state_dict().items())


def test_gradient_checkpointing_gives_same_step(process_group, tiny_model: Path) -> None:
    batch = make_batch(4, seed=10)
    plain, checkpointed = (FSDPEngine(context(tiny_model, lr=1e-2, gradient_checkpointing=flag))
                           for flag in (False, True))
    assert checkpointed.model.is_gradient_checkpointing
    m1, m2 = plain.update(batch, PolicyGradient()), checkpointed.update(batch, PolicyGradient())
    assert m1["grad_norm"] == pytest.approx(m2["grad_norm"], rel=1e-5)
    a, b = plain.full_state_dict(), checkpointed.full_state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)


def test_values_objective_is_rejected(process_group, tiny_model: Path) -> None:
    class ValueLoss(PolicyGradient):
        needs = ("values",)

    engine = FSDPEngine(context(tiny_model))
    with pytest.raises(ValueError, match="values"):
        engine.update(make_batch(2, seed=0), ValueLoss())


def test_needs_a_process_group(monkeypatch, tiny_model: Path) -> None:
    monkeypatch.setattr(engine_module.dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="init_process_group"):
        FSDPEngine(context(tiny_model))


def test_unequal_micro_batch_counts_raise() -> None:
    raise_if_counts_differ(n_sum=6.0, n_sq_sum=18.0, world_size=2)  # 3 and 3
    with pytest.raises(RuntimeError, match="micro-batches"):
        raise_if_counts_differ(n_sum=6.0, n_sq_sum=20.0, world_size=2)  # 2 and 4


def test_offload_is_a_noop_on_cpu(process_group, tiny_model: Path) -> None:
    engine = FSDPEngine(context(tiny_model))
    before = engine.full_state_dict()
    engine.offload()
    engine.onload()
    assert_same_weights(engine.full_state_dict(), before)


def test_one_cpu_rank_keeps_a_plain_module_with_fused_adamw(process_group, tiny_model: Path) -> None:
    """FSDP2 wraps the model only with ranks to shard over or a GPU's mixed precision; on one CPU rank the engine
    trains the plain module with AdamW's fused CPU kernel (the numbers against a hand-written AdamW are checked
    by test_fsdp_data_parallel, one and two ranks)."""
    from torch.distributed.tensor import DTensor

    assert not engine_module.uses_fsdp(1, torch.device("cpu"))
    assert engine_module.uses_fsdp(2, torch.device("cpu")) and engine_module.uses_fsdp(1, torch.device("cuda"))
    engine = FSDPEngine(context(tiny_model))
    assert not engine.sharded
    assert not any(isinstance(p, DTensor) for p in engine.model.parameters())
    assert all(group["fused"] for group in engine.optimizer.param_groups)
    batch = make_batch(6, seed=3)
    before = objective_value(engine, batch)
    for _ in range(3):
        engine.update(batch, PolicyGradient())
    assert objective_value(engine, batch) < before


def test_fused_and_foreach_adamw_take_the_same_steps(process_group, tiny_model: Path) -> None:
    """``optimizer_implementation`` picks how AdamW runs, never what it computes: three updates under the fused
    kernel (auto's choice on one device) and under foreach leave the same weights (fp32, CPU)."""
    fused = FSDPEngine(context(tiny_model, lr=1e-3))
    foreach = FSDPEngine(context(tiny_model, lr=1e-3, optimizer_implementation="foreach"))
    assert all(g["fused"] for g in fused.optimizer.param_groups)
    assert not any(g["fused"] for g in foreach.optimizer.param_groups)
    assert all(g["foreach"] for g in foreach.optimizer.param_groups)
    batch = make_batch(6, seed=5)
    for _ in range(3):
        fused.update(batch, PolicyGradient())
        foreach.update(batch, PolicyGradient())
    a, b = fused.full_state_dict(), foreach.full_state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5, msg=name)


def test_kept_head_logits_take_the_same_steps(process_group, tiny_model: Path) -> None:
    """``head_logits: keep`` changes where the fused head's backward finds its logits, never the step: three
    updates with them kept and made again leave the same weights (fp32, CPU, packed micro-batches)."""
    kept = FSDPEngine(context(tiny_model, lr=1e-3, head_logits="keep", max_tokens_per_micro_batch=48))
    again = FSDPEngine(context(tiny_model, lr=1e-3, head_logits="recompute", max_tokens_per_micro_batch=48))
    assert kept._log_prob_head.kept_logits is not None and again._log_prob_head.kept_logits is None
    batch = make_batch(6, seed=5)
    for _ in range(3):
        a_metrics = kept.update(batch, PolicyGradient())
        b_metrics = again.update(batch, PolicyGradient())
    assert a_metrics["loss"] == pytest.approx(b_metrics["loss"], abs=1e-6)
    assert kept._log_prob_head.kept_logits.bytes == 0  # freed when the update ends, for the other roles
    a, b = kept.full_state_dict(), again.full_state_dict()
    changed = FSDPEngine(context(tiny_model)).full_state_dict()
    assert any(not torch.equal(a[n], changed[n]) for n in a), "the updates moved nothing: the test checks nothing"
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5, msg=name)
    # a frozen role never keeps them (its forwards have no backward)
    assert FSDPEngine(context(tiny_model, trainable=False, head_logits="keep"))._log_prob_head.kept_logits is None


def test_head_logits_is_checked_before_start() -> None:
    from hybridrl_fsdp.settings import option_problems

    (problem,) = option_problems("actor", {"head_logits": "always"})
    assert problem[0] == "head_logits" and "auto, keep, recompute" in problem[1]


def test_optimizer_implementation_is_checked_before_start() -> None:
    from hybridrl_fsdp.settings import option_problems

    (problem,) = option_problems("actor", {"optimizer_implementation": "apex"})
    assert problem[0] == "optimizer_implementation" and "auto, fused, foreach" in problem[1]
    with pytest.raises(ValueError, match="needs every parameter on one CPU or CUDA device"):
        engine_module.fused_adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))], "fused")
    assert engine_module.fused_adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))]) is None
