"""The trainer's sync check (``hybridrl.weights.sync_check``): margins, the metrics read from them, the rows checked."""

from __future__ import annotations

import torch

from hybridrl.engines import SamplingParams
from hybridrl.engines.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, Batch
from hybridrl.weights.sync_check import SyncCheck, greedy_margins


def test_greedy_margins_are_zero_at_the_argmax_and_the_gap_elsewhere():
    logits = torch.tensor([[[1.0, 3.0, 2.0], [0.5, 0.5, -1.0]]], dtype=torch.bfloat16)
    labels = torch.tensor([[1, 0]])
    assert greedy_margins(logits, labels).tolist() == [[0.0, 0.0]]  # a tie counts as an argmax
    assert greedy_margins(logits, torch.tensor([[2, 2]])).tolist() == [[1.0, 1.5]]


def test_metrics_count_tokens_off_the_argmax_beyond_the_tolerance_only_inside_the_mask():
    check = SyncCheck(every=1, tie_tolerance=0.05)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    margins = torch.tensor([[0.0, 0.0, 0.0, 9.0],  # padding is not checked
                            [0.0, 0.01, 0.0, 0.0]])  # a near-tie: not the exact argmax, not off
    m = check.metrics(Batch.from_tensors({RESPONSE_MASK: mask}), margins)
    assert m["sync_check/tokens"] == 5 and m["sync_check/off_argmax"] == 0
    assert m["sync_check/rows_equal"] == 0.5 and abs(m["sync_check/argmax_fraction"] - 0.8) < 1e-6
    margins[1, 1] = 0.7
    m = check.metrics(Batch.from_tensors({RESPONSE_MASK: mask}), margins)
    assert m["sync_check/off_argmax"] == 1 and abs(m["sync_check/max_gap"] - 0.7) < 1e-6


def test_one_prompt_per_group_and_short_greedy_params():
    ids = torch.arange(12).reshape(6, 2)
    batch = Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: torch.ones(6, 2, dtype=torch.long),
                                "group_index": torch.tensor([0, 0, 1, 1, 2, 2])})
    picked = SyncCheck(every=2, rows=2).prompts(batch)
    assert picked[PROMPT_IDS].tolist() == [[0, 1], [4, 5]]
    params = SyncCheck(tokens=32).params(SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True))
    assert params.greedy and params.max_new_tokens == 8 and params.ignore_eos and not params.logprobs
    check = SyncCheck(every=2)
    assert [check.due(s) for s in range(5)] == [True, False, True, False, True]
    assert not SyncCheck(every=0).due(0)


def test_sixteen_bit_models_get_a_wider_near_tie():
    assert SyncCheck.for_dtype(1, "float32").tie_tolerance == 0.05
    wide = SyncCheck.for_dtype(1, "bfloat16")
    generated = Batch.from_tensors({RESPONSE_MASK: torch.ones(1, 2, dtype=torch.long)})
    # one bfloat16 step at logit magnitude 8-16 (seen on the H200): a near-tie, not a wrong token
    assert wide.metrics(generated, torch.tensor([[0.0625, 0.0]]))["sync_check/off_argmax"] == 0
    assert wide.metrics(generated, torch.tensor([[1.5, 0.0]]))["sync_check/off_argmax"] == 1
