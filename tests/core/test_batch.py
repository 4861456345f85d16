"""Batch scatter/gather: padding to a divisor, chunking, concatenation, and the sequence tensors."""

from __future__ import annotations

import pytest
import torch

from hybridrl.batch import (PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK, Batch, left_pad, right_pad,
                            sequence_tensors)


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
