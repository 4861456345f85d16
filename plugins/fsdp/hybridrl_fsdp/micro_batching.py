"""Micro-batch plans: a fixed number of rows, or a token budget (``max_tokens_per_micro_batch``).

Packed micro-batches (the default, ``packing``) lay their rows end to end (``packing.pack_rows``), so a
forward costs the sum of its rows' real lengths. With a token budget, rows then go into bins first-fit by
decreasing length while that sum stays within the budget (a row longer than the budget gets a bin of its own).

Padded micro-batches (``packing: false``) cost ``rows x (longest prompt + longest response in the bin)``: rows are
sorted by real length and binned greedily, longest first, while that cost stays within the budget. Either
way each micro-batch is trimmed to its own widths (the all-padding columns at the left of the prompts and at
the right of the responses are dropped). Results are put back in the original order.

With shared prompts (``share_prompts``) a packed forward holds each distinct prompt once, so the rows of one
prompt go into bins together: the bins take whole groups first-fit by decreasing cost (the prompt once plus the
responses), and a group costlier than the budget is cut into runs of rows that fit.

Every data-parallel rank must run the same number of forwards (FSDP's all-gathers are collectives), so a rank
with fewer bins splits its largest ones until it has as many as the rank with the most.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybridrl.engines.batch import PROMPT_IDS, PROMPT_MASK, RESPONSE_MASK, Batch, response_attention_mask
from hybridrl_fsdp.packing import PackedRows, pack_rows, prompt_groups

PROMPT_KEYS = (PROMPT_IDS, PROMPT_MASK)


@dataclass(frozen=True)
class MicroBatch:
    """Rows ``index`` of the local batch, trimmed to ``response_width`` response columns; ``packed``: the same
    rows laid end to end (None for a padded micro-batch)."""

    batch: Batch
    index: torch.Tensor  # (b,) positions in the local batch
    response_width: int
    packed: PackedRows | None = None

    def to(self, device: torch.device | str) -> MicroBatch:
        packed = self.packed.to(device) if self.packed is not None else None
        return MicroBatch(self.batch.to(device), self.index, self.response_width, packed)


def real_lengths(batch: Batch) -> tuple[list[int], list[int]]:
    """Real prompt and response tokens per row (a multi-turn row's observations count: they are attended)."""
    return batch[PROMPT_MASK].sum(-1).tolist(), response_attention_mask(batch).sum(-1).tolist()


Cost = Callable[[list[int], list[int], list[int]], int]


def _cost(rows: list[int], prompt_lens: list[int], response_lens: list[int]) -> int:
    """Tokens a padded forward over ``rows`` processes once trimmed (padding included)."""
    if not rows:
        return 0
    return len(rows) * (max(prompt_lens[i] for i in rows) + max(max(response_lens[i] for i in rows), 1))


def packed_cost(rows: list[int], prompt_lens: list[int], response_lens: list[int]) -> int:
    """Tokens a packed forward over ``rows`` processes: their real lengths."""
    return sum(prompt_lens[i] + response_lens[i] for i in rows)


def pack_first_fit(prompt_lens: list[int], response_lens: list[int], budget: int) -> list[list[int]]:
    """Bins of row indices whose summed real lengths stay within ``budget``: rows longest first, each into the
    first bin it fits (first-fit decreasing), a row longer than the budget alone."""
    rows = [(p + r, [i]) for i, (p, r) in enumerate(zip(prompt_lens, response_lens))]
    return [members for _, members in _first_fit_decreasing(rows, budget)]


def shared_cost(groups: list[int]) -> Cost:
    """The tokens of a packed forward that holds each distinct prompt once (``groups``: each row's prompt)."""
    def cost(rows: list[int], prompt_lens: list[int], response_lens: list[int]) -> int:
        prompts = {groups[i]: prompt_lens[i] for i in rows}
        return sum(prompts.values()) + sum(response_lens[i] for i in rows)
    return cost


def pack_groups_first_fit(groups: list[int], prompt_lens: list[int], response_lens: list[int],
                          budget: int) -> list[list[int]]:
    """Bins of row indices keeping the rows of one prompt together (module docstring): whole groups
    first-fit decreasing by their shared cost; a group over the budget is first cut, first-fit decreasing
    too, into runs of rows that each fit with the prompt once."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    items: list[tuple[int, list[int]]] = []
    for rows in members.values():
        prompt = prompt_lens[rows[0]]
        runs = _first_fit_decreasing([(response_lens[i], [i]) for i in rows], budget - prompt)
        items.extend((prompt + load, run) for load, run in runs)
    return [run for _, run in _first_fit_decreasing(items, budget)]


def _first_fit_decreasing(items: list[tuple[int, list[int]]], budget: int) -> list[tuple[int, list[int]]]:
    """``(load, rows)`` items into ``(load, rows)`` bins of at most ``budget`` (an item over it alone): the
    heaviest first, each into the first bin it fits; ties by first row."""
    bins: list[tuple[int, list[int]]] = []
    for load, rows in sorted(items, key=lambda item: (-item[0], item[1][0])):
        for b, (used, members) in enumerate(bins):
            if used + load <= budget:
                bins[b] = (used + load, members + rows)
                break
        else:
            bins.append((load, list(rows)))
    return bins


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


def split_to_count(bins: list[list[int]], count: int, prompt_lens: list[int], response_lens: list[int],
                   cost: Cost = _cost) -> list[list[int]]:
    """Split the costliest bins (of two rows or more) in halves until there are ``count`` bins."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            raise RuntimeError(f"cannot make {count} micro-batches out of {sum(map(len, bins))} rows")
        largest = max(splittable, key=lambda b: cost(b, prompt_lens, response_lens))
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
                       count_for_all_ranks=None, packed: bool = False,
                       share_prompts: bool = False) -> list[MicroBatch]:
    """The micro-batches of one local batch. ``count_for_all_ranks(n) -> max n over ranks`` aligns the
    number of bins across data-parallel ranks (token-budget mode only; fixed rows give equal counts).
    ``packed``: each micro-batch also carries its rows packed end to end (``MicroBatch.packed``), each distinct
    prompt once with ``share_prompts``."""
    n = len(batch)
    share_prompts = share_prompts and packed
    if token_budget is None:
        groups = [list(range(start, min(start + rows_per_micro, n))) for start in range(0, n, rows_per_micro)]
    else:
        prompt_lens, response_lens = real_lengths(batch)
        if share_prompts:
            prompt_of = prompt_groups(batch).tolist()
            cost = shared_cost(prompt_of)
            groups = pack_groups_first_fit(prompt_of, prompt_lens, response_lens, token_budget)
        else:
            cost = packed_cost if packed else _cost
            groups = (pack_first_fit if packed else pack_by_tokens)(prompt_lens, response_lens, token_budget)
        if count_for_all_ranks is not None:
            groups = split_to_count(groups, count_for_all_ranks(len(groups)), prompt_lens, response_lens, cost)
    out = []
    for rows in groups:
        index = torch.tensor(sorted(rows), dtype=torch.long)
        if token_budget is None and not packed:  # fixed rows, padded: the batch's own widths, as before
            out.append(MicroBatch(batch.index(index), index, batch[RESPONSE_MASK].shape[1]))
            continue
        trimmed, width = trim(batch.index(index))
        out.append(MicroBatch(trimmed, index, width, pack_rows(trimmed, share_prompts) if packed else None))
    return out


def scatter_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], n: int, width: int) -> torch.Tensor:
    """Put ``(index, (b, w) values)`` parts back into an ``(n, width)`` tensor, zero-padded on the right."""
    dtype = parts[0][1].dtype if parts else torch.float32
    out = torch.zeros(n, width, dtype=dtype)
    for index, values in parts:
        out[index, : values.shape[1]] = values
    return out
