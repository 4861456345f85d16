"""Packs that hold each distinct prompt once (``share_prompts``) against packs that repeat it per row, fp32 to
1e-5: the layout, the end-aligned attention path against attention segment by segment, and through the engine
the log-probs, entropies, loss and every gradient (fixed rows and a token budget that cuts a group), critic
values, reward scores and multi-turn rows; the group-keeping micro-batch bins."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _fsdp_helpers import context, grouped, make_batch
from test_packing import ATOL, _outputs_and_grads

from hybridrl.engines.batch import (
    ADVANTAGES,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_ATTENTION_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    SCORES,
    VALUES,
)


def test_shared_pack_holds_each_prompt_once_and_every_row_sees_its_own_sequence():
    from hybridrl_fsdp.packing import pack_rows

    batch = grouped()
    plain, shared = pack_rows(batch), pack_rows(batch, share_prompts=True)
    assert plain.shared is None and shared.shared is not None
    layout = shared.shared
    distinct = {tuple(batch[PROMPT_IDS][r][batch[PROMPT_MASK][r].bool()].tolist()) for r in range(len(batch))}
    assert layout.prompt_tokens == sum(map(len, distinct))
    assert shared.tokens == layout.prompt_tokens + int(batch[RESPONSE_MASK].sum())
    # each response segment's keys are its row's prompt then its response, at positions 0, 1, ...
    rows_with_response = [r for r in range(len(batch)) if batch[RESPONSE_MASK][r].any()]
    cu_k = layout.response_cu_k.tolist()
    for a, row in enumerate(rows_with_response):
        keys = layout.kv_index[cu_k[a]:cu_k[a + 1]]
        real = torch.cat([batch[PROMPT_IDS][row][batch[PROMPT_MASK][row].bool()],
                          batch[RESPONSE_IDS][row][batch[RESPONSE_MASK][row].bool()]])
        assert shared.input_ids[0, keys].tolist() == real.tolist()
        assert shared.position_ids[0, keys].tolist() == list(range(len(real)))
        # the last key is the row's last token; the response tokens are predicted from the key before each
        assert int(shared.last_index[row]) == int(keys[-1])
    assert torch.equal(shared.labels, plain.labels)
    assert torch.equal(shared.input_ids[0, shared.predict_index], plain.input_ids[0, plain.predict_index])
    assert torch.equal(shared.position_ids[0, shared.predict_index], plain.position_ids[0, plain.predict_index])


def test_rows_with_distinct_prompts_keep_the_plain_layout():
    from hybridrl_fsdp.packing import pack_rows

    batch = make_batch(5, seed=3)
    assert pack_rows(batch, share_prompts=True).shared is None


@pytest.mark.parametrize("lengths", [[(2, 7), (1, 4), (3, 3), (1, 9)], [(4, 4), (4, 4)]])
def test_end_aligned_attention_equals_attention_segment_by_segment(lengths):
    """Query segments shorter than their key segments (a response over its prompt and itself): each against
    sdpa with a lower-right causal mask on that segment alone, grouped query heads; values and gradients."""
    from hybridrl_fsdp.varlen_attention import _padded_sdpa_end_aligned

    gen = torch.Generator().manual_seed(1)
    q_lens, k_lens = [q for q, _ in lengths], [k for _, k in lengths]
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(sum(q_lens), 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(sum(k_lens), 2, 8, generator=gen, requires_grad=True)
    v = torch.randn(sum(k_lens), 2, 8, generator=gen, requires_grad=True)
    w = torch.randn(sum(q_lens), 4, 8, generator=gen)
    out = _padded_sdpa_end_aligned(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), 0.3)
    grads = torch.autograd.grad((out * w).sum(), [q, k, v])
    parts = []
    for a, (ql, kl) in enumerate(lengths):
        qi = q[cu_q[a]:cu_q[a + 1]].transpose(0, 1)[None]
        ki, vi = (t[cu_k[a]:cu_k[a + 1]].transpose(0, 1)[None] for t in (k, v))
        mask = torch.ones(ql, kl, dtype=torch.bool).tril(diagonal=kl - ql)
        parts.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=0.3,
                                                    enable_gqa=True)[0].transpose(0, 1))
    ref = torch.cat(parts)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    for got, want in zip(grads, torch.autograd.grad((ref * w).sum(), [q, k, v])):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("options", [{"micro_batch": 5}, {"micro_batch": 16, "max_tokens_per_micro_batch": 20},
                                     {"micro_batch": 16, "gradient_checkpointing": True}])
def test_shared_and_repeated_prompts_give_the_same_log_probs_loss_and_gradients(process_group, tiny_model: Path,
                                                                                options):
    from hybridrl_fsdp.engine import FSDPEngine

    batch = grouped()
    repeated = FSDPEngine(context(tiny_model, share_prompts=False, **options))
    shared = FSDPEngine(context(tiny_model, share_prompts=True, **options))
    assert shared.share_prompts and not repeated.share_prompts
    plan = shared._plan(batch, check_counts=False)
    assert any(m.packed.shared is not None for m in plan)
    assert sum(m.packed.tokens for m in plan) < sum(m.packed.tokens for m in repeated._plan(batch, False))
    lp_a, ent_a, loss_a, grads_a = _outputs_and_grads(repeated, batch, 0.8)
    lp_b, ent_b, loss_b, grads_b = _outputs_and_grads(shared, batch, 0.8)
    assert float(lp_a[batch[RESPONSE_MASK].bool()].abs().min()) > 0
    torch.testing.assert_close(lp_b, lp_a, atol=ATOL, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=ATOL, rtol=0)
    assert abs(loss_a - loss_b) < ATOL
    for name, grad in grads_a.items():
        assert float(grad.abs().max()) > 0, name
        torch.testing.assert_close(grads_b[name], grad, atol=ATOL, rtol=ATOL,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_auto_shares_prompts_and_the_option_is_checked(process_group, tiny_model: Path):
    from hybridrl_fsdp.engine import FSDPEngine, FSDPSettings

    assert FSDPEngine(context(tiny_model, trainable=False)).share_prompts
    assert not FSDPEngine(context(tiny_model, trainable=False, packing=False)).share_prompts
    with pytest.raises(ValueError, match="share_prompts"):
        FSDPSettings.from_options({"share_prompts": "sometimes"})
    with pytest.raises(ValueError, match="needs packing"):
        FSDPSettings.from_options({"share_prompts": True, "packing": False})
    with pytest.raises(ValueError, match="varlen attention"):
        FSDPSettings.from_options({"share_prompts": True, "attn_implementation": "flash_attention_2"})
    assert FSDPSettings().shares_prompts() and FSDPSettings(share_prompts=True).shares_prompts()
    assert not FSDPSettings(share_prompts=False).shares_prompts()
    # transformers' own flash-attention path reads only the rows' boundaries: auto leaves the prompts repeated
    assert not FSDPSettings(attn_implementation="flash_attention_2").shares_prompts()


def test_multi_turn_rows_share_prompts_and_keep_their_observations(process_group, tiny_model: Path):
    from hybridrl_fsdp.engine import FSDPEngine

    batch = grouped(seed=9)
    attended = batch[RESPONSE_MASK].clone()
    trained = attended.clone()
    trained[:, 2:4] = 0  # an observation where the row is that long
    batch.set(RESPONSE_ATTENTION_MASK, attended)
    batch.set(RESPONSE_MASK, trained)
    batch.set(ADVANTAGES, batch[ADVANTAGES] * trained)
    lp_a, _, loss_a, grads_a = _outputs_and_grads(FSDPEngine(context(tiny_model, share_prompts=False,
                                                                     micro_batch=6)), batch, None)
    lp_b, _, loss_b, grads_b = _outputs_and_grads(FSDPEngine(context(tiny_model, share_prompts=True,
                                                                     micro_batch=6)), batch, None)
    torch.testing.assert_close(lp_b, lp_a, atol=ATOL, rtol=0)
    assert abs(loss_a - loss_b) < ATOL
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, atol=ATOL, rtol=ATOL)


def test_critic_values_and_reward_scores_equal_with_shared_prompts(process_group, tiny_model: Path,
                                                                   tmp_path: Path):
    from _fsdp_helpers import reward_context, save_tiny_reward_model

    from hybridrl_fsdp.engine import FSDPEngine

    batch = grouped(seed=13)

    def critic(share: bool) -> FSDPEngine:
        ctx = context(tiny_model, share_prompts=share, micro_batch=4)
        return FSDPEngine(type(ctx)(**{**ctx.__dict__, "role": "critic"}))

    a, b = critic(False).compute_values(batch)[VALUES], critic(True).compute_values(batch)[VALUES]
    assert float(a.abs().max()) > 1e-4
    torch.testing.assert_close(b, a, atol=ATOL, rtol=0)

    model = save_tiny_reward_model(tmp_path / "rm")
    a, b = (FSDPEngine(reward_context(model, micro_batch=4, share_prompts=share)).compute_scores(batch)[SCORES]
            for share in (False, True))
    assert float(a.abs().max()) > 0
    torch.testing.assert_close(b, a, atol=ATOL, rtol=0)


def test_bins_keep_a_prompts_rows_together_and_cut_a_group_over_the_budget():
    from hybridrl_fsdp.micro_batching import pack_groups_first_fit, shared_cost

    groups = [0, 1, 0, 2, 1, 0, 0]
    prompt_lens = [5, 3, 5, 4, 3, 5, 5]
    response_lens = [2, 6, 3, 1, 2, 4, 4]
    bins = pack_groups_first_fit(groups, prompt_lens, response_lens, budget=12)
    assert sorted(i for b in bins for i in b) == list(range(7))
    cost = shared_cost(groups)
    assert all(cost(b, prompt_lens, response_lens) <= 12 for b in bins)
    # group 0 (prompt 5 + responses 13) is over the budget and is cut; group 1 (3 + 8) stays whole
    assert any(set(b) >= {1, 4} for b in bins)
    assert sum(1 for b in bins if any(groups[i] == 0 for i in b)) == 2
