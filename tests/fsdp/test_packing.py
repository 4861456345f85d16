"""Padding-free (packed) micro-batches against padded ones on ragged batches, fp32 to 1e-5: log-probs, entropies,
the loss and every parameter's gradient; values and reward scores; gradient checkpointing. And the pieces:
``pack_rows``' layout, the plain varlen attention path against per-row attention, the kernel choice."""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _fsdp_helpers import context, make_batch
from torch.distributed.tensor import DTensor

from hybridrl.engines.batch import (
    ADVANTAGES,
    ENTROPY,
    LOG_PROBS,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    Batch,
)
from hybridrl_fsdp.settings import PACKED_ATTENTION

ATOL = 1e-5


def ragged(size: int = 9, seed: int = 31) -> Batch:
    """Rows of very different lengths: some cut to one prompt and one response token."""
    batch = make_batch(size, seed=seed, max_prompt=9, max_response=8)
    for i in range(1, size, 3):
        batch[PROMPT_MASK][i, :-1] = 0
        batch[RESPONSE_MASK][i, 1:] = 0
    batch.set(ADVANTAGES, batch[ADVANTAGES] * batch[RESPONSE_MASK])
    return batch


# --- the layout ---------------------------------------------------------------------------------------------
def test_pack_rows_lays_real_tokens_end_to_end_with_positions_restarting():
    from hybridrl_fsdp.packing import pack_rows

    batch = ragged(5, seed=2)
    packed = pack_rows(batch)
    lengths = (batch[PROMPT_MASK].sum(1) + batch[RESPONSE_MASK].sum(1)).tolist()
    assert packed.tokens == sum(lengths) and packed.max_len == max(lengths)
    assert packed.cu_seqlens.tolist() == [0] + torch.tensor(lengths).cumsum(0).tolist()
    assert packed.cu_seqlens.dtype == torch.int32
    for row, (start, end) in enumerate(zip(packed.cu_seqlens[:-1].tolist(), packed.cu_seqlens[1:].tolist())):
        real = torch.cat([batch[PROMPT_IDS][row][batch[PROMPT_MASK][row].bool()],
                          batch[RESPONSE_IDS][row][batch[RESPONSE_MASK][row].bool()]])
        assert packed.input_ids[0, start:end].tolist() == real.tolist()
        assert packed.position_ids[0, start:end].tolist() == list(range(end - start))
        assert int(packed.last_index[row]) == end - 1
    # each response token is predicted by the token just before it, in its own row
    assert torch.equal(packed.input_ids[0, packed.predict_index + 1], packed.labels)
    values = torch.arange(1.0, len(packed.labels) + 1)
    back = packed.scatter(values)
    assert back.shape == batch[RESPONSE_MASK].shape and torch.equal(back[batch[RESPONSE_MASK].bool()], values)
    assert (back[~batch[RESPONSE_MASK].bool()] == 0).all()


def test_a_response_without_prompt_is_refused():
    from hybridrl_fsdp.packing import pack_rows

    batch = ragged(3)
    batch[PROMPT_MASK][0] = 0
    with pytest.raises(ValueError, match="no prompt token"):
        pack_rows(batch)


# --- attention --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("lengths", [[5, 1, 9, 3], [4, 4, 4]])  # ragged rows; rows of one length (a view)
def test_plain_varlen_attention_equals_attention_row_by_row(lengths):
    """The sdpa path over a right-padded layout against causal attention of each row alone, with grouped
    query heads; values and gradients."""
    from hybridrl_fsdp.varlen_attention import _padded_sdpa

    gen = torch.Generator().manual_seed(0)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(lengths), 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(sum(lengths), 2, 8, generator=gen, requires_grad=True)
    v = torch.randn(sum(lengths), 2, 8, generator=gen, requires_grad=True)
    w = torch.randn(sum(lengths), 4, 8, generator=gen)
    out = _padded_sdpa(q, k, v, cu, max(lengths), 0.3)
    grads = torch.autograd.grad((out * w).sum(), [q, k, v])
    rows = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
        qi, ki, vi = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))
        rows.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=0.3,
                                                   enable_gqa=True)[0].transpose(0, 1))
    ref = torch.cat(rows)
    ref_grads = torch.autograd.grad((ref * w).sum(), [q, k, v])
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_kernel_choice_on_cpu_and_refusals(process_group, tiny_model: Path):
    from hybridrl_fsdp.engine import FSDPEngine, FSDPSettings
    from hybridrl_fsdp.varlen_attention import choose_kernel

    q = torch.zeros(4, 2, 8)
    assert choose_kernel("auto", q) == "sdpa" and choose_kernel("sdpa", q) == "sdpa"
    with pytest.raises(RuntimeError, match="torch_flash"):
        choose_kernel("torch_flash", q)
    with pytest.raises(ValueError, match="packed_attention"):
        FSDPSettings.from_options({"packed_attention": "magic"})
    with pytest.raises(ValueError, match="cannot keep packed rows apart"):
        FSDPSettings.from_options({"attn_implementation": "eager"})
    FSDPSettings.from_options({"attn_implementation": "eager", "packing": False})  # the padded path takes any
    engine = FSDPEngine(context(tiny_model, trainable=False))
    assert engine.model.config._attn_implementation == "hybridrl_varlen"


@pytest.mark.parametrize("kernel", PACKED_ATTENTION)
def test_every_kernel_name_loads_a_model(kernel: str):
    """transformers takes an attn_implementation holding "flash" for a package or hub kernel to import, so
    ``packed_attention: torch_flash`` failed at load before the registered names left the word out."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from hybridrl_fsdp import varlen_attention

    varlen_attention.register()
    name = varlen_attention.implementation_name(kernel)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=name)
    assert model.config._attn_implementation == name


# --- packed == padded -------------------------------------------------------------------------------------
def _outputs_and_grads(engine, batch: Batch, temperature: float | None):
    """Per-micro-batch forward + backward of a loss of the log-probs and entropies, as ``update`` runs them;
    the (B, R) outputs, the summed loss and each parameter's full gradient."""
    engine.model.train()
    engine.optimizer.zero_grad(set_to_none=True)
    lp_parts, ent_parts, total = [], [], 0.0
    for micro in engine._on_device(engine._plan(batch, check_counts=False)):
        out = engine._response_outputs(micro, temperature, with_entropy=True)
        mask = micro.batch[RESPONSE_MASK].float()
        loss = -(out[LOG_PROBS] * micro.batch[ADVANTAGES] * mask).sum() - 0.05 * (out[ENTROPY] * mask).sum()
        loss.backward()
        total += float(loss.detach())
        lp_parts.append((micro.index, out[LOG_PROBS].detach()))
        ent_parts.append((micro.index, out[ENTROPY].detach()))
    from hybridrl_fsdp.micro_batching import scatter_rows

    width = batch[RESPONSE_MASK].shape[1]
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
             for n, p in engine.model.named_parameters()}
    return scatter_rows(lp_parts, len(batch), width), scatter_rows(ent_parts, len(batch), width), total, grads


@pytest.mark.parametrize("temperature,budget", [(None, None), (0.7, 30)])
def test_packed_and_padded_give_the_same_log_probs_loss_and_gradients(process_group, tiny_model: Path,
                                                                       temperature, budget):
    from hybridrl_fsdp.engine import FSDPEngine

    batch = ragged()
    options = {"micro_batch": 4, "max_tokens_per_micro_batch": budget}
    padded = FSDPEngine(context(tiny_model, packing=False, **options))
    packed = FSDPEngine(context(tiny_model, packing=True, **options))
    assert all(m.packed is not None for m in packed._plan(batch))
    lp_a, ent_a, loss_a, grads_a = _outputs_and_grads(padded, batch, temperature)
    lp_b, ent_b, loss_b, grads_b = _outputs_and_grads(packed, batch, temperature)
    mask = batch[RESPONSE_MASK].bool()
    assert float(lp_a[mask].abs().min()) > 0
    torch.testing.assert_close(lp_b, lp_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=ATOL, rtol=0)
    assert abs(loss_a - loss_b) < ATOL
    for name, grad in grads_a.items():  # bins differ, so do the sums' orders: fp32 rounding relative to the size
        assert float(grad.abs().max()) > 0, name
        torch.testing.assert_close(grads_b[name], grad, atol=ATOL, rtol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_packed_update_with_gradient_checkpointing_equals_without(process_group, tiny_model: Path):
    from _fsdp_helpers import PolicyGradient

    from hybridrl_fsdp.engine import FSDPEngine

    batch = ragged(seed=7)
    plain = FSDPEngine(context(tiny_model, lr=1e-2, micro_batch=3))
    ckpt = FSDPEngine(context(tiny_model, lr=1e-2, micro_batch=3, gradient_checkpointing=True))
    m1, m2 = plain.update(batch, PolicyGradient()), ckpt.update(batch, PolicyGradient())
    assert abs(m1["grad_norm"] - m2["grad_norm"]) < 1e-5 * m1["grad_norm"]
    a, b = plain.full_state_dict(), ckpt.full_state_dict()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)


def test_packed_reward_scores_equal_padded(process_group, tmp_path: Path):
    from _fsdp_helpers import reward_context, save_tiny_reward_model

    from hybridrl.engines.batch import SCORES
    from hybridrl_fsdp.engine import FSDPEngine

    model = save_tiny_reward_model(tmp_path / "rm")
    batch = ragged()
    a, b = (FSDPEngine(reward_context(model, micro_batch=4, packing=packing)).compute_scores(batch)[SCORES]
            for packing in (False, True))
    assert float(a.abs().max()) > 0
    torch.testing.assert_close(b, a, atol=ATOL, rtol=0)


def test_multi_turn_rows_attend_to_their_observations_packed_as_padded(process_group, tiny_model: Path):
    """Rows whose responses interleave trained tokens with observations (``response_attention_mask`` 1 there,
    ``response_mask`` 0): packed, the observations stay in the sequence as context and get no log-prob."""
    from hybridrl.engines.batch import RESPONSE_ATTENTION_MASK
    from hybridrl_fsdp.engine import FSDPEngine
    from hybridrl_fsdp.packing import pack_rows

    batch = make_batch(6, seed=41, max_prompt=5, max_response=8)
    attended = batch[RESPONSE_MASK].clone()
    trained = attended.clone()
    trained[:, 2:4] = 0  # columns 2-3 are an observation where the row is that long
    batch.set(RESPONSE_ATTENTION_MASK, attended)
    batch.set(RESPONSE_MASK, trained)
    batch.set(ADVANTAGES, batch[ADVANTAGES] * trained)
    packed_rows = pack_rows(batch)
    assert packed_rows.tokens == int(batch[PROMPT_MASK].sum() + attended.sum())
    assert len(packed_rows.labels) == int(trained.sum())
    padded = FSDPEngine(context(tiny_model, packing=False, micro_batch=3))
    packed = FSDPEngine(context(tiny_model, micro_batch=3))
    lp_a, _, loss_a, grads_a = _outputs_and_grads(padded, batch, None)
    lp_b, _, loss_b, grads_b = _outputs_and_grads(packed, batch, None)
    assert (lp_b[~trained.bool()] == 0).all() and float(lp_a[trained.bool()].abs().min()) > 0
    torch.testing.assert_close(lp_b, lp_a, atol=ATOL, rtol=0)
    assert abs(loss_a - loss_b) < ATOL
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, atol=ATOL, rtol=ATOL)


def test_a_flash_attn_package_without_the_varlen_kernel_is_not_flash_attn(monkeypatch):
    """flash-attn 4 (SGLang's) owns the ``flash_attn`` name with only ``flash_attn.cute``: the trainer must not
    pick a kernel it cannot import (it did, and died in its first packed forward on the GPU)."""
    import sys
    import types

    from hybridrl_fsdp import varlen_attention

    namespace = types.ModuleType("flash_attn")
    namespace.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None, is_package=True)
    monkeypatch.setitem(sys.modules, "flash_attn", namespace)
    varlen_attention._flash_attn_installed.cache_clear()
    try:
        assert not varlen_attention._flash_attn_installed()
        namespace.flash_attn_varlen_func = lambda *a, **k: None  # type: ignore[attr-defined]
        varlen_attention._flash_attn_installed.cache_clear()
        assert varlen_attention._flash_attn_installed()
    finally:
        varlen_attention._flash_attn_installed.cache_clear()
