"""``compute_log_probs`` against a plain Hugging Face forward, and the fp32 log-prob helpers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _fsdp_helpers import context, make_batch

from hybridrl.engines.batch import ENTROPY, LOG_PROBS, PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK
from hybridrl_fsdp.engine import FSDPEngine
from hybridrl_fsdp.logprobs import entropy_from_logits, token_log_probs


def hf_reference(model_path: Path, batch, temperature: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Full logits of the unsharded model over prompt+response, ``log_softmax`` and gather."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    ids = torch.cat([batch[PROMPT_IDS], batch[RESPONSE_IDS]], 1)
    mask = torch.cat([batch[PROMPT_MASK], batch[RESPONSE_MASK]], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    p, r = batch[PROMPT_IDS].shape[1], batch[RESPONSE_IDS].shape[1]
    logits = logits[:, p - 1: p + r - 1].float() / (temperature or 1.0)
    logp = torch.log_softmax(logits, -1)
    token = logp.gather(-1, batch[RESPONSE_IDS][..., None]).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token, entropy


@pytest.mark.parametrize("temperature", [None, 0.7])
def test_matches_plain_forward(process_group, tiny_model: Path, temperature: float | None) -> None:
    engine = FSDPEngine(context(tiny_model, trainable=False, micro_batch=3))  # 7 rows: micro-batches 3, 3, 1
    assert engine._supports_logits_to_keep
    batch = make_batch(7, seed=3)
    if temperature is not None:
        batch.info["temperature"] = temperature
    out = engine.compute_log_probs(batch, with_entropy=True)
    ref_lp, ref_ent = hf_reference(tiny_model, batch, temperature)

    mask = batch[RESPONSE_MASK].bool()
    assert out[LOG_PROBS].shape == out[ENTROPY].shape == mask.shape
    assert out[LOG_PROBS].dtype == torch.float32
    torch.testing.assert_close(out[LOG_PROBS][mask], ref_lp[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(out[ENTROPY][mask], ref_ent[mask], atol=1e-5, rtol=0)
    assert (out[LOG_PROBS][~mask] == 0).all() and (out[ENTROPY][~mask] == 0).all()
    assert set(engine.compute_log_probs(batch).tensors.keys()) == {LOG_PROBS}


def test_temperature_changes_log_probs(process_group, tiny_model: Path) -> None:
    engine = FSDPEngine(context(tiny_model, trainable=False))
    batch = make_batch(4, seed=5)
    plain = engine.compute_log_probs(batch)[LOG_PROBS]
    batch.info["temperature"] = 0.5
    hot = engine.compute_log_probs(batch)[LOG_PROBS]
    assert not torch.allclose(plain, hot)


def test_helpers_match_log_softmax() -> None:
    logits = torch.randn(3, 4, 11, dtype=torch.bfloat16) * 5
    labels = torch.randint(0, 11, (3, 4))
    logp = torch.log_softmax(logits.float(), -1)
    torch.testing.assert_close(token_log_probs(logits, labels), logp.gather(-1, labels[..., None]).squeeze(-1))
    torch.testing.assert_close(entropy_from_logits(logits), -(logp.exp() * logp).sum(-1))
    assert token_log_probs(logits, labels).dtype == torch.float32


@pytest.mark.parametrize("temperature,with_entropy", [(None, True), (0.7, True), (1.3, False)])
def test_chunked_log_probs_match_log_softmax_values_and_gradients(monkeypatch, temperature, with_entropy):
    """The chunked fp32 path (no full fp32 copy of the logits) against ``log_softmax`` on fp64 logits, values
    and gradients of a loss mixing both outputs; chunks forced small so rows straddle them."""
    from hybridrl_fsdp import logprobs

    monkeypatch.setattr(logprobs, "CHUNK_BYTES", 3 * 7 * 4 * 2)  # two rows of (7, V=...) per chunk
    torch.manual_seed(0)
    logits = torch.randn(5, 7, 13, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (5, 7))
    w_lp, w_ent = torch.randn(5, 7, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64)
    lp, ent = logprobs.chunked_log_probs(logits, labels, temperature, with_entropy)
    loss = (lp * w_lp).sum() + ((ent * w_ent).sum() if with_entropy else 0.0)
    (grad,) = torch.autograd.grad(loss, logits)

    z = logits / (temperature or 1.0)
    ref_logp = torch.log_softmax(z, -1)
    ref_lp = ref_logp.gather(-1, labels[..., None]).squeeze(-1)
    ref_loss = (ref_lp * w_lp).sum()
    if with_entropy:
        ref_ent = -(ref_logp.exp() * ref_logp).sum(-1)
        torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=1e-5)
        ref_loss = ref_loss + (ref_ent * w_ent).sum()
    else:
        assert ent is None
    (ref_grad,) = torch.autograd.grad(ref_loss, logits)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, ref_grad, atol=1e-5, rtol=1e-5)


def test_chunked_log_probs_keep_bf16_gradients_in_bf16():
    from hybridrl_fsdp.logprobs import chunked_log_probs

    logits = torch.randn(2, 3, 11).to(torch.bfloat16).requires_grad_(True)
    lp, _ = chunked_log_probs(logits, torch.zeros(2, 3, dtype=torch.long))
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16 and torch.isfinite(logits.grad.float()).all()


def test_greedy_margins_match_the_full_logits(process_group, tiny_model: Path) -> None:
    """``compute_greedy_margins``: max logit minus the token's, from the unsharded model's logits; 0 where the
    response token is the argmax (here: the argmax itself is put in as the response), 0 at padding."""
    from transformers import AutoModelForCausalLM

    from hybridrl.weights.sync_check import GREEDY_MARGIN

    engine = FSDPEngine(context(tiny_model, trainable=False, micro_batch=3))
    batch = make_batch(5, seed=4)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.cat([batch[PROMPT_IDS], batch[RESPONSE_IDS]], 1)
    mask = torch.cat([batch[PROMPT_MASK], batch[RESPONSE_MASK]], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    p, r = batch[PROMPT_IDS].shape[1], batch[RESPONSE_IDS].shape[1]
    logits = logits[:, p - 1: p + r - 1]
    expected = logits.max(-1).values - logits.gather(-1, batch[RESPONSE_IDS][..., None]).squeeze(-1)
    resp = batch[RESPONSE_MASK].bool()
    out = engine.compute_greedy_margins(batch)[GREEDY_MARGIN]
    torch.testing.assert_close(out[resp], expected[resp], atol=1e-4, rtol=0)
    assert (out[~resp] == 0).all() and (out[resp] > 0).any()
    # a response that is the model's own greedy continuation: every token is the argmax of its position
    width = 4
    prompts = batch.select(PROMPT_IDS, PROMPT_MASK)
    seq, seq_mask = prompts[PROMPT_IDS], prompts[PROMPT_MASK]
    with torch.no_grad():
        for _ in range(width):
            step = model(input_ids=seq, attention_mask=seq_mask,
                         position_ids=(seq_mask.cumsum(1) - 1).clamp(min=0)).logits[:, -1].argmax(-1, keepdim=True)
            seq, seq_mask = torch.cat([seq, step], 1), torch.cat([seq_mask, torch.ones_like(step)], 1)
    prompts.set(RESPONSE_IDS, seq[:, -width:])
    prompts.set(RESPONSE_MASK, torch.ones(len(prompts), width, dtype=torch.long))
    assert (engine.compute_greedy_margins(prompts)[GREEDY_MARGIN] < 1e-5).all()
