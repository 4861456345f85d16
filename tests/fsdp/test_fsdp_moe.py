"""FSDP on a mixture-of-experts model (a tiny Qwen3-MoE): the router's load-balancing loss is the one transformers
computes, it is weighted by ``options.moe_aux_loss_coef`` and moves the routers; every forward path (fused head or
not, packed or padded, shared prompts) gives the same log-probs; the export sends the experts per expert, as the
checkpoint stores them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _fsdp_helpers import PolicyGradient, context, grouped, make_batch

from hybridrl.config.schema import TinyModelConfig
from hybridrl.engines.batch import ADVANTAGES, LOG_PROBS, Batch, sequence_tensors
from hybridrl.model.tiny import build_tiny_model
from hybridrl_fsdp.engine import FSDPEngine
from hybridrl_fsdp.settings import option_problems

TINY_MOE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                           num_experts=8, experts_per_token=2, init_std=0.2)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(TINY_MOE, tmp_path_factory.mktemp("tiny-moe") / "model")


def _hf_aux_loss(model_path: Path, batch: Batch) -> float:
    """transformers' own load-balancing loss of the padded rows (padding masked out)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids, mask, pos = sequence_tensors(batch)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, output_router_logits=True)
    return float(out.aux_loss)


@pytest.mark.parametrize("options", [{"packing": False}, {"packing": True, "share_prompts": False}])
def test_aux_loss_is_transformers(process_group, moe_model: Path, options: dict) -> None:
    batch = make_batch(6, seed=3)
    engine = FSDPEngine(context(moe_model, lr=1e-3, micro_batch=6, **options))
    metrics = engine.update(batch, PolicyGradient())
    expected = _hf_aux_loss(moe_model, batch)
    assert expected > 1.0  # random routing is not perfectly balanced
    assert metrics["moe/aux_loss"] == pytest.approx(expected, rel=1e-5)


def test_aux_loss_coefficient_moves_the_routers(process_group, moe_model: Path) -> None:
    """Zero advantages leave the policy loss without gradient: only the router loss can move the weights, and
    only the routers (and what feeds them) move."""
    batch = make_batch(4, seed=4)
    batch = Batch.from_tensors({**batch.tensors, ADVANTAGES: torch.zeros_like(batch[ADVANTAGES])})
    moved = {}
    for coef in (0.0, 1.0):
        engine = FSDPEngine(context(moe_model, lr=1e-2, micro_batch=4, moe_aux_loss_coef=coef))
        before = engine.full_state_dict()
        metrics = engine.update(batch, PolicyGradient())
        after = engine.full_state_dict()
        moved[coef] = {n: float((after[n] - before[n]).abs().max()) for n in before}
        assert metrics["moe/aux_loss"] > 0
    assert max(moved[0.0].values()) == 0.0
    routers = [n for n in moved[1.0] if n.endswith("mlp.gate.weight")]
    assert routers and all(moved[1.0][n] > 0 for n in routers)


def test_default_coefficient_is_the_model_config(process_group, moe_model: Path) -> None:
    engine = FSDPEngine(context(moe_model))
    assert engine.router_loss is not None and engine.router_loss.aux_coef == pytest.approx(0.001)
    assert engine.router_loss.z_coef == 0.0


def test_forward_paths_agree(process_group, moe_model: Path) -> None:
    """The fused head, packing and shared prompts give the plain padded forward's log-probs on an MoE model."""
    batch = grouped()
    reference = FSDPEngine(context(moe_model, micro_batch=4, packing=False, fused_lm_head=False,
                                   trainable=False)).compute_log_probs(batch)[LOG_PROBS]
    for options in ({"packing": False}, {"share_prompts": False}, {}, {"fused_lm_head": False}):
        engine = FSDPEngine(context(moe_model, micro_batch=4, trainable=False, **options))
        torch.testing.assert_close(engine.compute_log_probs(batch)[LOG_PROBS], reference, atol=1e-5, rtol=0,
                                   msg=str(options))


def test_update_learns_on_every_path(process_group, moe_model: Path) -> None:
    batch = grouped()
    for options in ({}, {"packing": False}, {"fused_lm_head": False}, {"gradient_checkpointing": True}):
        engine = FSDPEngine(context(moe_model, lr=1e-2, micro_batch=4, **options))
        first = engine.update(batch, PolicyGradient())
        for _ in range(3):
            last = engine.update(batch, PolicyGradient())
        assert last["mean_log_prob"] != first["mean_log_prob"], options
        assert last["loss"] < first["loss"], options


def test_export_is_the_checkpoint_layout(process_group, moe_model: Path) -> None:
    from safetensors.torch import load_file

    saved = load_file(str(moe_model / "model.safetensors"))
    engine = FSDPEngine(context(moe_model))
    for transient in (False, True):
        buckets = engine.export_weights_transient(4096) if transient else engine.export_weights(4096)
        exported = {n: t.clone() for bucket in buckets for n, t in bucket}
        assert set(exported) == set(saved)
        assert "model.layers.0.mlp.experts.7.up_proj.weight" in exported
        for name, tensor in saved.items():
            torch.testing.assert_close(exported[name], tensor, atol=0, rtol=0, msg=name)


def test_moe_options_are_checked() -> None:
    assert option_problems("actor", {"moe_aux_loss_coef": 0.01}) == []
    problems = dict(option_problems("actor", {"moe_aux_loss_coef": -1, "moe_z_loss_coef": "x"}))
    assert "moe_aux_loss_coef" in problems and "moe_z_loss_coef" in problems


def test_coefficient_on_a_dense_model_is_refused(process_group, tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="moe_aux_loss_coef"):
        FSDPEngine(context(tiny_model, moe_aux_loss_coef=0.01))


def test_padding_is_not_routed(process_group, moe_model: Path) -> None:
    """Padding rows do not count: the loss of a batch equals that of the same rows padded wider."""
    from hybridrl_fsdp.moe import RouterLoss

    batch = make_batch(3, seed=6)
    engine = FSDPEngine(context(moe_model, trainable=False, packing=False))
    recorder = RouterLoss(engine.model, 1.0, 0.0)
    ids, mask, pos = sequence_tensors(batch)
    values = []
    for extra in (0, 5):
        wide_ids = torch.cat([torch.zeros(3, extra, dtype=ids.dtype), ids], dim=1)
        wide_mask = torch.cat([torch.zeros(3, extra, dtype=mask.dtype), mask], dim=1)
        wide_pos = torch.cat([torch.zeros(3, extra, dtype=pos.dtype), pos], dim=1)
        with torch.no_grad(), recorder.recording():
            engine.model(input_ids=wide_ids, attention_mask=wide_mask, position_ids=wide_pos)
        losses = recorder.losses(wide_mask)
        assert losses.tokens == int(mask.sum())
        values.append(float(losses.aux))
    assert values[0] == pytest.approx(values[1], rel=1e-5)
