"""The critic (value head) and reward-model heads of the FSDP engine, against plain Hugging Face forwards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _fsdp_helpers import context, make_batch

from hybridrl.algorithms.losses import token_mean
from hybridrl.algorithms.objective import ValueObjective
from hybridrl.config import TinyModelConfig
from hybridrl.engines.batch import PROMPT_IDS, RESPONSE_IDS, RESPONSE_MASK, RETURNS, SCORES, VALUES, sequence_tensors
from hybridrl.rewards.scorer import build_tiny_reward_model
from hybridrl_fsdp.engine import FSDPEngine
from hybridrl_fsdp.value_model import VALUE_HEAD_FILE, ValueModel


def critic_context(model_path: Path, **options):
    ctx = context(model_path, **options)
    return type(ctx)(**{**ctx.__dict__, "role": "critic"})


def plain_values(model_path: Path, head: dict[str, torch.Tensor], batch) -> torch.Tensor:
    """Backbone hidden states of the unsharded model at positions P-1 .. P+R-2, through the head."""
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(model_path, dtype=torch.float32).eval()
    ids, mask, positions = sequence_tensors(batch)
    with torch.no_grad():
        hidden = backbone(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
    p, r = batch[PROMPT_IDS].shape[1], batch[RESPONSE_IDS].shape[1]
    values = hidden[:, p - 1: p + r - 1] @ head["value_head.weight"][0] + head["value_head.bias"][0]
    return values * batch[RESPONSE_MASK]


def test_values_match_plain_backbone_and_head(process_group, tiny_model: Path) -> None:
    engine = FSDPEngine(critic_context(tiny_model, micro_batch=3))
    assert engine.head == "value"
    batch = make_batch(7, seed=11)
    values = engine.compute_values(batch)[VALUES]
    state = engine.full_state_dict()
    expected = plain_values(tiny_model, state, batch)
    assert values.shape == batch[RESPONSE_MASK].shape and values.dtype == torch.float32
    assert float(values.abs().max()) > 1e-3, "a zero head would make the comparison empty"
    torch.testing.assert_close(values, expected, atol=1e-5, rtol=0)
    assert (values[~batch[RESPONSE_MASK].bool()] == 0).all()
    with pytest.raises(RuntimeError, match="'lm' head"):
        engine.compute_log_probs(batch)


def test_critic_update_fits_the_returns(process_group, tiny_model: Path) -> None:
    engine = FSDPEngine(critic_context(tiny_model, lr=3e-3, micro_batch=2))
    batch = make_batch(6, seed=12)
    targets = torch.linspace(-1.0, 1.0, 6)[:, None].expand_as(batch[RESPONSE_MASK]) * batch[RESPONSE_MASK]
    batch.set(RETURNS, targets.clone())
    objective = ValueObjective(cliprange_value=None, aggregate=token_mean)
    mask = batch[RESPONSE_MASK].float()

    def loss_of(values: torch.Tensor) -> float:
        return float((0.5 * (values - targets) ** 2 * mask).sum() / mask.sum())

    losses = []
    for _ in range(15):
        batch.set(VALUES, engine.compute_values(batch)[VALUES])
        losses.append(loss_of(batch[VALUES]))
        metrics = engine.update(batch, objective)
        assert metrics["loss"] == pytest.approx(losses[-1], rel=1e-4)  # the engine's loss is the batch's value loss
    final_loss = loss_of(engine.compute_values(batch)[VALUES])
    assert final_loss < 0.25 * losses[0], (losses, final_loss)
    assert metrics["grad_norm"] > 0 and metrics["skipped_step"] == 0.0


def test_value_clipping_stops_the_gradient_outside_the_range(process_group, tiny_model: Path) -> None:
    """After one step towards far-away returns the values have left a tiny clip range around the old values:
    on the next pass the clipped branch is the larger everywhere and carries no gradient."""
    batch = make_batch(4, seed=13)
    mask = batch[RESPONSE_MASK].float()
    engines = {clip: FSDPEngine(critic_context(tiny_model, lr=1e-2)) for clip in (1e-4, None)}
    old = engines[None].compute_values(batch)[VALUES]
    batch.set(VALUES, old)
    batch.set(RETURNS, (old + 5.0) * mask)
    for clip, engine in engines.items():
        objective = ValueObjective(cliprange_value=clip, aggregate=token_mean)
        first = engine.update(batch, objective)
        assert first["critic/vf_clipfrac"] == 0.0 and first["grad_norm"] > 0  # values == old values: no clip yet
        moved = float(((engine.compute_values(batch)[VALUES] - old).abs() * mask).max())
        assert moved > 1e-3
        second = engine.update(batch, objective)
        if clip is None:
            assert second["grad_norm"] > 0 and second["critic/vf_clipfrac"] == 0.0
        else:
            assert second["critic/vf_clipfrac"] == pytest.approx(1.0) and second["grad_norm"] == 0.0


def test_value_model_save_and_load_round_trip(process_group, tiny_model: Path, tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = ValueModel.from_pretrained(tiny_model)
    batch = make_batch(3, seed=14)
    ids, mask, pos = sequence_tensors(batch)
    with torch.no_grad():
        before = model(ids, mask, pos)
    model.save_pretrained(tmp_path / "critic")
    assert (tmp_path / "critic" / VALUE_HEAD_FILE).is_file()
    torch.manual_seed(99)  # a fresh head would differ: the saved one must be loaded
    with torch.no_grad():
        after = ValueModel.from_pretrained(tmp_path / "critic")(ids, mask, pos)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)
    engine = FSDPEngine(critic_context(tmp_path / "critic"))
    torch.testing.assert_close(engine.full_state_dict()["value_head.weight"], model.value_head.weight.detach())


def test_reward_model_scores_match_hf_sequence_classification(process_group, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification

    path = build_tiny_reward_model(TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                                   intermediate_size=64, seed=1), tmp_path / "rm")
    ctx = context(path, trainable=False, micro_batch=2)
    engine = FSDPEngine(type(ctx)(**{**ctx.__dict__, "role": "reward"}))
    batch = make_batch(5, seed=15)  # token ids >= 1: the pad id 0 only pads, so HF's pad-based pooling applies
    scores = engine.compute_scores(batch)[SCORES]
    hf = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    ids, mask, pos = sequence_tensors(batch)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, 0]
    assert scores.shape == (5,) and float(scores.std()) > 0
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert build_tiny_reward_model(TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                                   intermediate_size=64, seed=1), tmp_path / "rm") == path  # reused
