"""Multi-turn rows on the FSDP engine: observation tokens are context (attended, never trained). Log-probs equal a
plain forward over the whole conversation at the model's tokens and are 0 on observations, with row and
token-budget micro-batching, packed (the default: rows end to end) and padded; the update's loss counts the
model's tokens only, and whatever sits at the observation positions (advantages, log-probs) changes nothing."""

from __future__ import annotations

from pathlib import Path

import torch
from _fsdp_helpers import VOCAB, PolicyGradient, context

from hybridrl.engines.batch import (
    ADVANTAGES,
    LOG_PROBS,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_ATTENTION_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    Batch,
    left_pad,
    right_pad,
)


def multi_turn_batch(seed: int = 0, rows: int = 6) -> Batch:
    """Prompts, then model turn / observation / model turn (lengths vary), right-padded to 16 columns."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=gen).tolist()

    prompts, responses, trained = [], [], []
    for i in range(rows):
        lengths = [int(x) for x in torch.randint(1, 5, (3,), generator=gen)]
        turn1, obs, turn2 = tokens(lengths[0]), tokens(lengths[1] + 1), tokens(lengths[2])
        if i % 3 == 2:  # some rows are a single turn
            obs, turn2 = [], []
        prompts.append(tokens(1 + i % 4))
        responses.append(turn1 + obs + turn2)
        trained.append([1] * len(turn1) + [0] * len(obs) + [1] * len(turn2))
    prompt_ids, prompt_mask = left_pad(prompts, pad_id=0)
    response_ids, attention = right_pad(responses, pad_id=0, width=16)
    mask = torch.zeros_like(attention)
    for i, marks in enumerate(trained):
        mask[i, :len(marks)] = torch.tensor(marks)
    advantages = torch.randn(rows, 16, generator=gen) * attention  # nonzero on observations too: must not count
    return Batch.from_tensors({PROMPT_IDS: prompt_ids, PROMPT_MASK: prompt_mask, RESPONSE_IDS: response_ids,
                               RESPONSE_MASK: mask, RESPONSE_ATTENTION_MASK: attention, ADVANTAGES: advantages})


def reference_log_probs(model_path: Path, batch: Batch, attend_observations: bool = True) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    response_attention = batch[RESPONSE_ATTENTION_MASK] if attend_observations else batch[RESPONSE_MASK]
    ids = torch.cat([batch[PROMPT_IDS], batch[RESPONSE_IDS]], 1)
    mask = torch.cat([batch[PROMPT_MASK], response_attention], 1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    p, r = batch[PROMPT_IDS].shape[1], batch[RESPONSE_IDS].shape[1]
    logp = torch.log_softmax(logits[:, p - 1: p + r - 1].float(), -1)
    return logp.gather(-1, batch[RESPONSE_IDS][..., None]).squeeze(-1)


def test_log_probs_condition_on_observations_and_cover_only_model_tokens(process_group, tiny_model: Path) -> None:
    from hybridrl_fsdp.engine import FSDPEngine

    batch = multi_turn_batch()
    trained = batch[RESPONSE_MASK].bool()
    observations = batch[RESPONSE_ATTENTION_MASK].bool() & ~trained
    assert observations.any()
    reference = reference_log_probs(tiny_model, batch)
    for options in ({"micro_batch": 4}, {"micro_batch": 4, "max_tokens_per_micro_batch": 40},  # packed (default)
                    {"micro_batch": 4, "packing": False}):
        engine = FSDPEngine(context(tiny_model, trainable=False, **options))
        out = engine.compute_log_probs(batch, with_entropy=True)
        torch.testing.assert_close(out[LOG_PROBS][trained], reference[trained], atol=1e-5, rtol=0)
        assert (out[LOG_PROBS][~trained] == 0).all() and (out["entropy"][~trained] == 0).all()
    # the check has teeth: read as padding, the observations would change the model tokens after them
    blind = reference_log_probs(tiny_model, batch, attend_observations=False)
    after_observation = trained & (observations.long().cumsum(-1) > 0)
    assert (blind[after_observation] - reference[after_observation]).abs().max() > 1e-3


def test_update_trains_the_model_tokens_only(process_group, tiny_model: Path) -> None:
    from hybridrl_fsdp.engine import FSDPEngine

    batch = multi_turn_batch(seed=1)
    trained = batch[RESPONSE_MASK].bool()
    reference = reference_log_probs(tiny_model, batch)
    expected_loss = -float((reference * batch[ADVANTAGES])[trained].sum()) / int(trained.sum())

    first = FSDPEngine(context(tiny_model, lr=1e-2, micro_batch=4))
    metrics = first.update(batch, PolicyGradient())
    assert abs(metrics["loss"] - expected_loss) < 1e-5

    other = multi_turn_batch(seed=1)
    other.tensors[ADVANTAGES][~trained] = 100.0  # anything at observation (and padding) positions
    second = FSDPEngine(context(tiny_model, lr=1e-2, micro_batch=4))
    assert abs(second.update(other, PolicyGradient())["loss"] - expected_loss) < 1e-5
    a, b = first.full_state_dict(), second.full_state_dict()
    assert all(torch.equal(a[name], b[name]) for name in a), "observation positions moved the update"

    packed = FSDPEngine(context(tiny_model, lr=1e-2, micro_batch=3, max_tokens_per_micro_batch=40))
    assert abs(packed.update(other, PolicyGradient())["loss"] - expected_loss) < 1e-5
    c = packed.full_state_dict()
    for name in a:  # another micro-batching: the same step up to fp32 reduction order (amplified by Adam)
        torch.testing.assert_close(c[name], a[name], atol=1e-4, rtol=0, msg=name)
    # padded rows give the same loss (their gradients equal the packed ones': tests/fsdp/test_packing.py; the
    # weights after one Adam step are not compared, Adam's first step is lr * sign(g) where g is ~0)
    padded = FSDPEngine(context(tiny_model, lr=1e-2, micro_batch=3, packing=False))
    assert abs(padded.update(other, PolicyGradient())["loss"] - expected_loss) < 1e-5
