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

Shared prompts (``share_prompts``): the rows of a GRPO group repeat one prompt, and a prompt position's output
depends on the prompt alone (causal attention), so a pack may hold each distinct prompt once. Its prompts then
come first, end to end, and every row's response after them; a response token attends to its row's prompt and to
its own earlier tokens (``SharedPrompts``). The result is the same; the forward and backward run on
``prompts + responses`` tokens instead of ``rows x prompt + responses``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from hybridrl.engines.batch import (
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    Batch,
    distinct_prompts,
    response_attention_mask,
)


@dataclass(frozen=True)
class SharedPrompts:
    """Attention of a pack whose distinct prompts come first (``prompt_tokens`` of them, one segment each) and
    the rows' responses after them: response segment ``a`` (queries ``response_cu_q[a] ..``, counted from
    ``prompt_tokens``) attends to the pack's tokens ``kv_index[response_cu_k[a] .. response_cu_k[a+1]]``, its
    row's prompt then itself, causally aligned at the end (the last query sees every key)."""

    prompt_tokens: int
    prompt_cu: torch.Tensor  # (G + 1,) int32
    prompt_max: int
    response_cu_q: torch.Tensor  # (A + 1,) int32 over the response part
    response_cu_k: torch.Tensor  # (A + 1,) int32 over kv_index
    kv_index: torch.Tensor  # (K,) long: pack positions of each response segment's keys
    response_max_q: int
    response_max_k: int

    def to(self, device: torch.device | str) -> SharedPrompts:
        return SharedPrompts(**{f.name: _moved(getattr(self, f.name), device) for f in fields(self)})


def _moved(value: Any, device: torch.device | str) -> Any:
    """``value`` on ``device`` when it is a tensor (from pinned memory without blocking on CUDA)."""
    if isinstance(value, SharedPrompts):
        return value.to(device)
    if not isinstance(value, torch.Tensor):
        return value
    cuda = torch.device(device).type == "cuda"
    return (value.pin_memory() if cuda and value.device.type == "cpu" else value).to(device, non_blocking=cuda)


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
    shared: SharedPrompts | None = None  # set when distinct prompts are held once (then cu_seqlens is unused)

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str) -> PackedRows:
        """The same rows with every tensor on ``device`` (copied from pinned memory without blocking on CUDA)."""
        return PackedRows(**{f.name: _moved(getattr(self, f.name), device) for f in fields(self)})

    def attention_kwargs(self) -> dict[str, Any]:
        """The rows' boundaries as keyword arguments of a transformers forward (with no attention mask); a pack
        with shared prompts passes its layout under ``SHARED_KWARG``, which only the engine's attention reads."""
        if self.shared is not None:
            return {SHARED_KWARG: self.shared}
        return {"cu_seq_lens_q": self.cu_seqlens, "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_len, "max_length_k": self.max_len}

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """``(n,)`` per-response-token values -> ``(b, R)``, 0 at padding, in the values' dtype (differentiable)."""
        out = values.new_zeros(self.response_mask.shape)
        return out.masked_scatter(self.response_mask, values)


#: the forward keyword that carries a ``SharedPrompts`` layout to ``varlen_attention``.
SHARED_KWARG = "hybridrl_shared_prompts"


def prompt_groups(batch: Batch) -> torch.Tensor:
    """``(B,)`` the same id for rows whose prompts are the same real tokens (``batch.distinct_prompts``)."""
    return distinct_prompts(batch[PROMPT_IDS], batch[PROMPT_MASK])[0]


def pack_rows(batch: Batch, share_prompts: bool = False) -> PackedRows:
    """Pack a (left-padded prompt, right-padded response) batch: each row's real tokens (its prompt, then its
    response: a multi-turn row's observations included, ``response_attention_mask``), rows one after the other.
    Log-probs are taken at the trained tokens (``response_mask``). Every row with a response needs a prompt
    token before it (its first token's context). ``share_prompts``: each distinct prompt once, when two rows
    or more share one (``SharedPrompts``)."""
    prompt_mask = batch[PROMPT_MASK].bool()
    attended, trained = response_attention_mask(batch).bool(), batch[RESPONSE_MASK].bool()
    if bool((attended.any(1) & ~prompt_mask.any(1)).any()):
        raise ValueError("a row has a response but no prompt token: its first response token has no context")
    if bool((trained & ~attended).any()):
        raise ValueError("response_mask marks a token that response_attention_mask leaves out")
    if share_prompts:
        groups, first = distinct_prompts(batch[PROMPT_IDS], batch[PROMPT_MASK])
        if len(first) < len(batch):
            return _pack_shared(batch, groups, first, prompt_mask, attended, trained)
    ids = torch.cat([batch[PROMPT_IDS], batch[RESPONSE_IDS]], dim=1)
    mask = torch.cat([prompt_mask, attended], dim=1)
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


def _pack_shared(batch: Batch, groups: torch.Tensor, first: torch.Tensor, prompt_mask: torch.Tensor,
                 attended: torch.Tensor, trained: torch.Tensor) -> PackedRows:
    """The shared-prompt layout (module docstring): group ``g``'s prompt (that of its row ``first[g]``), then every
    row's response in row order; positions continue from the prompt, as in the row's own sequence."""
    n_groups = len(first)
    group_mask = prompt_mask[first]
    prompt_lens = group_mask.sum(1)
    prompt_cu = torch.zeros(n_groups + 1, dtype=torch.long)
    prompt_cu[1:] = prompt_lens.cumsum(0)
    prompt_tokens = int(prompt_cu[-1])
    response_lens = attended.sum(1)
    response_cu = torch.zeros(len(batch) + 1, dtype=torch.long)
    response_cu[1:] = response_lens.cumsum(0)
    row_prompt_start, row_prompt_len = prompt_cu[groups], prompt_lens[groups]
    input_ids = torch.cat([batch[PROMPT_IDS][first][group_mask], batch[RESPONSE_IDS][attended]])
    position_ids = torch.cat([(group_mask.long().cumsum(1) - 1)[group_mask],
                              (row_prompt_len[:, None] + attended.long().cumsum(1) - 1)[attended]])
    # the position whose output predicts response column t: the prompt's last token for t = 0, else column t-1
    response_start = prompt_tokens + response_cu[:-1]
    columns = torch.arange(attended.shape[1])
    before = torch.where(columns[None, :] == 0, (row_prompt_start + row_prompt_len - 1)[:, None],
                         response_start[:, None] + columns[None, :] - 1)
    last = torch.where(response_lens > 0, response_start + response_lens - 1, row_prompt_start + row_prompt_len - 1)
    # one attention segment per row with a response: its prompt's keys, then its own
    rows = torch.nonzero(response_lens > 0).flatten()
    key_lens = row_prompt_len[rows] + response_lens[rows]
    cu_q = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu_q[1:] = response_lens[rows].cumsum(0)
    cu_k = torch.zeros(len(rows) + 1, dtype=torch.int32)
    cu_k[1:] = key_lens.cumsum(0)
    segment = torch.repeat_interleave(torch.arange(len(rows)), key_lens)
    slot = torch.arange(int(cu_k[-1])) - cu_k[:-1].long()[segment]
    row = rows[segment]
    kv_index = torch.where(slot < row_prompt_len[row], row_prompt_start[row] + slot,
                           response_start[row] + slot - row_prompt_len[row])
    lengths = row_prompt_len + response_lens
    return PackedRows(
        input_ids=input_ids.view(1, -1),
        position_ids=position_ids.view(1, -1),
        cu_seqlens=torch.zeros(1, dtype=torch.int32),
        max_len=max(int(lengths.max()), 1),
        predict_index=before[trained],
        labels=batch[RESPONSE_IDS][trained],
        response_mask=trained,
        last_index=last,
        shared=SharedPrompts(prompt_tokens=prompt_tokens, prompt_cu=prompt_cu.to(torch.int32),
                             prompt_max=max(int(prompt_lens.max()), 1), response_cu_q=cu_q, response_cu_k=cu_k,
                             kv_index=kv_index, response_max_q=max(int(response_lens.max()), 1),
                             response_max_k=max(int(key_lens.max()) if len(rows) else 1, 1)),
    )
