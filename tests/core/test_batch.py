"""Batch scatter/gather: padding to a divisor, chunking, concatenation, and the sequence tensors."""

from __future__ import annotations

import pytest
import torch

from hybridrl.engines.batch import (
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    Batch,
    left_pad,
    padded_rows,
    right_pad,
    sequence_tensors,
)


def make(n: int) -> Batch:
    return Batch.from_tensors({"x": torch.arange(n * 2).reshape(n, 2)}, {"name": [f"s{i}" for i in range(n)]})


def test_pad_chunk_concat_unpad_round_trip():
    batch = make(5)
    padded, pad = batch.pad_to_multiple(4)
    assert pad == 3 and len(padded) == 8
    chunks = padded.chunk(4)
    assert [len(c) for c in chunks] == [2, 2, 2, 2]
    back = Batch.concat(chunks).unpad(pad)
    assert torch.equal(back["x"], batch["x"]) and back["name"] == batch["name"]


def test_chunk_requires_a_divisor_and_fields_must_agree():
    with pytest.raises(ValueError, match="does not split"):
        make(5).chunk(2)
    with pytest.raises(ValueError, match="entries for a batch of 2"):
        Batch.from_tensors({"x": torch.zeros(2)}, {"name": ["a"]})


def test_repeat_interleave_keeps_samples_of_a_prompt_together():
    out = make(2).repeat_interleave(3)
    assert out["name"] == ["s0"] * 3 + ["s1"] * 3
    assert out["x"][:, 0].tolist() == [0, 0, 0, 2, 2, 2]


def test_sequence_tensors_positions_skip_left_padding():
    p_ids, p_mask = left_pad([[5, 6], [7]], pad_id=0)
    r_ids, r_mask = right_pad([[8], [9, 10]], pad_id=0, width=2)
    batch = Batch.from_tensors({PROMPT_IDS: p_ids, PROMPT_MASK: p_mask, RESPONSE_IDS: r_ids, RESPONSE_MASK: r_mask})
    ids, mask, pos = sequence_tensors(batch)
    assert ids.tolist() == [[5, 6, 8, 0], [0, 7, 9, 10]]
    assert mask.tolist() == [[1, 1, 1, 0], [0, 1, 1, 1]]
    assert pos[1, 1:].tolist() == [0, 1, 2] and pos[0, :3].tolist() == [0, 1, 2]


# --- multi-turn rows: trained tokens and attended tokens differ ----------------------------------------------
def multi_turn_batch() -> Batch:
    """Row 0: model [11, 12], observation [21, 22], model [13]; row 1: one model turn [14, 15]."""
    from hybridrl.engines.batch import RESPONSE_ATTENTION_MASK

    p_ids, p_mask = left_pad([[5, 6], [7]], pad_id=0)
    r_ids, attention = right_pad([[11, 12, 21, 22, 13], [14, 15]], pad_id=0, width=6)
    trained = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0]])
    return Batch.from_tensors({PROMPT_IDS: p_ids, PROMPT_MASK: p_mask, RESPONSE_IDS: r_ids, RESPONSE_MASK: trained,
                               RESPONSE_ATTENTION_MASK: attention})


def test_sequence_tensors_attend_to_observations_and_keys_carry_the_attention_mask():
    from hybridrl.engines.batch import RESPONSE_ATTENTION_MASK, SEQUENCE_KEYS, response_attention_mask, sequence_keys

    batch = multi_turn_batch()
    _, attention, positions = sequence_tensors(batch)
    assert attention.tolist() == [[1, 1, 1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0, 0, 0]]
    assert positions[0].tolist()[:7] == [0, 1, 2, 3, 4, 5, 6]
    assert torch.equal(response_attention_mask(batch), batch[RESPONSE_ATTENTION_MASK])
    assert sequence_keys(batch) == SEQUENCE_KEYS + (RESPONSE_ATTENTION_MASK,)
    single = batch.select(*SEQUENCE_KEYS)
    assert sequence_keys(single) == SEQUENCE_KEYS
    assert torch.equal(response_attention_mask(single), single[RESPONSE_MASK])


def test_reward_sits_on_the_last_model_token_and_text_covers_observations():
    from hybridrl.engines.batch import last_positions
    from hybridrl.model.tokenizer import build_char_tokenizer
    from hybridrl.rewards.scorer import decode_responses, on_last_token

    batch = multi_turn_batch()
    assert last_positions(batch[RESPONSE_MASK]).tolist() == [4, 1]
    assert last_positions(torch.zeros(2, 3)).tolist() == [0, 0]
    rewards = on_last_token(torch.tensor([2.0, 3.0]), batch[RESPONSE_MASK])
    assert rewards.tolist() == [[0, 0, 0, 0, 2.0, 0], [0, 3.0, 0, 0, 0, 0]]
    contiguous = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    expected = [[0, 0, 1, 0], [2, 0, 0, 0], [0, 0, 0, 0]]
    assert on_last_token(torch.tensor([1.0, 2.0, 3.0]), contiguous).tolist() == expected
    tok = build_char_tokenizer()
    ids = [tok.convert_tokens_to_ids(c) for c in "abxyc"]
    batch[RESPONSE_IDS][0, :5] = torch.tensor(ids)
    assert decode_responses(tok, batch)[0] == "abxyc"


def test_padding_rows_copy_the_attention_mask_but_train_nothing():
    from hybridrl.engines.batch import RESPONSE_ATTENTION_MASK

    padded, pad = multi_turn_batch().pad_to_multiple(4, zero_keys=(RESPONSE_MASK,))
    assert pad == 2 and padded[RESPONSE_MASK][2:].sum() == 0 and padded[RESPONSE_ATTENTION_MASK][2:].sum() > 0


def test_padded_rows_place_each_sequence_in_its_row_on_either_side():
    ids, mask = left_pad([[5, 6, 7], [], [8]], pad_id=-1)
    assert ids.tolist() == [[5, 6, 7], [-1, -1, -1], [-1, -1, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 0], [0, 0, 1]]
    ids, mask = right_pad([[5], [6, 7]], pad_id=0, width=4)
    assert ids.tolist() == [[5, 0, 0, 0], [6, 7, 0, 0]] and mask.dtype == torch.long
    logps, kept = padded_rows([[-0.5, -1.25], [-2.0]], 3, 0.0, torch.float32)
    assert logps.dtype == torch.float32 and logps.tolist() == [[-0.5, -1.25, 0.0], [-2.0, 0.0, 0.0]]
    assert kept.tolist() == [[True, True, False], [True, False, False]]
    assert padded_rows([], 0, 0, torch.long)[0].shape == (0, 0)
    with pytest.raises(ValueError, match="does not fit a width of 2"):
        right_pad([[1, 2, 3]], pad_id=0, width=2)
