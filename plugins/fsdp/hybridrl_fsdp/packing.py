"""Padding-free micro-batches: the rows of a micro-batch laid end to end in one sequence.

A padded micro-batch computes every layer on ``rows x (longest prompt + longest response)`` positions; packed,
it computes on the real tokens only. Each row keeps its own positions (0, 1, ... restarting at every row, as
``sequence_tensors`` counts them) and attention stays inside each row: the model gets the rows' boundaries as
``cu_seq_lens_q/k`` and ``max_length_q/k`` (the names transformers' flash-attention path reads), which the
engine's varlen attention (``varlen_attention``) turns into one kernel call over all rows.

``pack_rows`` is host work done once per micro-batch before the step's device loop (boolean indexing needs the
values); the result travels to the device in one go and holds everything the forward needs, so the loop itself
never waits on the device. Results come back per row: ``PackedRows.scatter`` puts per-token values into the
``(b, R)`` layout of the micro-batch's responses, differentiably, so the objectives see what they always saw.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from hybridrl.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_IDS, RESPONSE_MASK, Batch, response_attention_mask


@dataclass(frozen=True)
class PackedRows:
    """One micro-batch's rows in one sequence of ``T`` real tokens."""

    input_ids: torch.Tensor  # (1, T)
    position_ids: torch.Tensor  # (1, T), restarting at 0 for every row
    cu_seqlens: torch.Tensor  # (b + 1,) int32, row i is tokens cu[i] .. cu[i+1]
    max_len: int  # the longest row (a host int: no device read in the forward)
    predict_index: torch.Tensor  # (n,) the position whose output predicts each real response token
    labels: torch.Tensor  # (n,) those response tokens
    response_mask: torch.Tensor  # (b, R) bool, where the n response values go back
    last_index: torch.Tensor  # (b,) each row's last real token (the reward model scores there)

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str) -> "PackedRows":
        """The same rows with every tensor on ``device`` (copied from pinned memory without blocking on CUDA)."""
        cuda = torch.device(device).type == "cuda"
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = (value.pin_memory() if cuda and value.device.type == "cpu" else value).to(
                    device, non_blocking=cuda)
            moved[f.name] = value
        return PackedRows(**moved)

    def attention_kwargs(self) -> dict[str, Any]:
        """The rows' boundaries as keyword arguments of a transformers forward (with no attention mask)."""
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_len, "max_length_k": self.max_len}

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``(n,)`` per-response-token values -> ``(b, R)``, 0 at padding, in the values' dtype (differentiable)."""
        out = values.new_zeros(self.response_mask.shape)
        return out.masked_scatter(self.response_mask, values)


def pack_rows(batch: Batch) -> PackedRows:
    """Pack a (left-padded prompt, right-padded response) batch: each row's real tokens (its prompt, then its
    response: a multi-turn row's observations included, ``response_attention_mask``), rows one after the other.
    Log-probs are taken at the trained tokens (``response_mask``). Every row with a response needs a prompt
    token before it (its first token's context)."""
    prompt_mask = batch[PROMPT_MASK].bool()
    attended, trained = response_attention_mask(batch).bool(), batch[RESPONSE_MASK].bool()
    ids = torch.cat([batch[PROMPT_IDS], batch[RESPONSE_IDS]], dim=1)
    mask = torch.cat([prompt_mask, attended], dim=1)
    if bool((attended.any(1) & ~prompt_mask.any(1)).any()):
        raise ValueError("a row has a response but no prompt token: its first response token has no context")
    if bool((trained & ~attended).any()):
        raise ValueError("response_mask marks a token that response_attention_mask leaves out")
    lengths = mask.sum(1)
    flat_position = mask.flatten().cumsum(0).view(mask.shape) - 1  # index of each real token in the pack
    width = prompt_mask.shape[1]
    cu = torch.zeros(len(batch) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    total = int(cu[-1])
    return PackedRows(
        input_ids=ids[mask].view(1, total),
        position_ids=(mask.long().cumsum(1) - 1)[mask].view(1, total),
        cu_seqlens=cu,
        max_len=max(int(lengths.max()) if len(batch) else 1, 1),
        predict_index=flat_position[:, width:][trained] - 1,
        labels=batch[RESPONSE_IDS][trained],
        response_mask=trained,
        last_index=(cu[1:].long() - 1).clamp(min=0),
    )
