"""Micro-batch plans: a fixed number of rows, or a token budget (``max_tokens_per_micro_batch``).

With a token budget, rows are sorted by real length (prompt + response tokens, padding excluded) and packed
greedily, longest first, while ``rows x (longest prompt + longest response in the bin)`` stays within the
budget; each micro-batch is then trimmed to its own widths (the all-padding columns at the left of the
prompts and at the right of the responses are dropped). Short rows thus share micro-batches and long rows get
their own, and no forward pays for another bin's longest row. Results are put back in the original order.

Every data-parallel rank must run the same number of forwards (FSDP's all-gathers are collectives), so a rank
with fewer bins splits its largest ones until it has as many as the rank with the most.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, Batch, response_attention_mask

PROMPT_KEYS = (PROMPT_IDS, PROMPT_MASK)


@dataclass(frozen=True)
class MicroBatch:
    """Rows ``index`` of the local batch, trimmed to ``response_width`` response columns."""

    batch: Batch
    index: torch.Tensor  # (b,) positions in the local batch
    response_width: int


def real_lengths(batch: Batch) -> tuple[list[int], list[int]]:
    """Real prompt and response tokens per row (a multi-turn row's observations count: they are attended)."""
    return batch[PROMPT_MASK].sum(-1).tolist(), response_attention_mask(batch).sum(-1).tolist()


def _cost(rows: list[int], prompt_lens: list[int], response_lens: list[int]) -> int:
    """Tokens a forward over ``rows`` processes once trimmed (padding included)."""
    if not rows:
        return 0
    return len(rows) * (max(prompt_lens[i] for i in rows) + max(max(response_lens[i] for i in rows), 1))


def pack_by_tokens(prompt_lens: list[int], response_lens: list[int], budget: int) -> list[list[int]]:
    """Bins of row indices, longest rows first; a row longer than the budget gets a bin of its own."""
    order = sorted(range(len(prompt_lens)), key=lambda i: (-(prompt_lens[i] + response_lens[i]), i))
    bins: list[list[int]] = []
    current: list[int] = []
    for i in order:
        if current and _cost(current + [i], prompt_lens, response_lens) > budget:
            bins.append(current)
            current = []
        current.append(i)
    if current:
        bins.append(current)
    return bins


def split_to_count(bins: list[list[int]], count: int, prompt_lens: list[int], response_lens: list[int]
                   ) -> list[list[int]]:
    """Split the costliest bins (of two rows or more) in halves until there are ``count`` bins."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            raise RuntimeError(f"cannot make {count} micro-batches out of {sum(map(len, bins))} rows")
        largest = max(splittable, key=lambda b: _cost(b, prompt_lens, response_lens))
        at = bins.index(largest)
        half = len(largest) // 2
        bins[at:at + 1] = [largest[:half], largest[half:]]
    return bins


def trim(batch: Batch) -> tuple[Batch, int]:
    """Drop all-padding prompt columns (left) and response columns (right). Every other 2-D tensor with the
    response's width is response-aligned (``(B, R)``: masks, advantages, old log-probs ...) and is cut with it.
    Returns the trimmed batch and its response width (at least 1)."""
    prompt_mask, response_mask = batch[PROMPT_MASK], response_attention_mask(batch)
    p_full, r_full = prompt_mask.shape[1], response_mask.shape[1]
    p_keep = max(int(prompt_mask.sum(-1).max()) if len(batch) else 1, 1)
    r_keep = max(int(response_mask.sum(-1).max()) if len(batch) else 1, 1)
    tensors = {}
    for key, value in batch.tensors.items():
        if key in PROMPT_KEYS:
            tensors[key] = value[:, p_full - p_keep:]
        elif value.dim() == 2 and value.shape[1] == r_full:
            tensors[key] = value[:, :r_keep]
        else:
            tensors[key] = value
    return Batch.from_tensors(tensors, batch.non_tensors, batch.info), r_keep


def plan_micro_batches(batch: Batch, rows_per_micro: int, token_budget: int | None,
                       count_for_all_ranks=None) -> list[MicroBatch]:
    """The micro-batches of one local batch. ``count_for_all_ranks(n) -> max n over ranks`` aligns the
    number of bins across data-parallel ranks (token-budget mode only; fixed rows give equal counts)."""
    n = len(batch)
    if token_budget is None:
        out = []
        for start in range(0, n, rows_per_micro):
            index = torch.arange(start, min(start + rows_per_micro, n))
            out.append(MicroBatch(batch.index(index), index, batch[RESPONSE_MASK].shape[1]))
        return out
    prompt_lens, response_lens = real_lengths(batch)
    bins = pack_by_tokens(prompt_lens, response_lens, token_budget)
    if count_for_all_ranks is not None:
        bins = split_to_count(bins, count_for_all_ranks(len(bins)), prompt_lens, response_lens)
    out = []
    for rows in bins:
        index = torch.tensor(sorted(rows), dtype=torch.long)
        trimmed, width = trim(batch.index(index))
        out.append(MicroBatch(trimmed, index, width))
    return out


def scatter_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], n: int, width: int) -> torch.Tensor:
    """Put ``(index, (b, w) values)`` parts back into an ``(n, width)`` tensor, zero-padded on the right."""
    dtype = parts[0][1].dtype if parts else torch.float32
    out = torch.zeros(n, width, dtype=dtype)
    for index, values in parts:
        out[index, : values.shape[1]] = values
    return out
