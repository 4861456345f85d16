"""Truncated responses: which rows ran out of ``max_new_tokens``, and DAPO's soft length penalty for them.

A response cut at the length cap has no ending, so its score says little about the text the policy would
have written; DAPO (Yu et al. 2025) either leaves such rows out of the loss ("overlong filtering", here
``algorithm.overlong: mask``) or charges a penalty that grows over the last ``buffer`` tokens before the cap
("soft overlong punishment", ``penalty``): 0 up to ``max_new_tokens - buffer`` tokens, then linearly down to
``-max_penalty`` at the cap.
"""

from __future__ import annotations

import torch


def truncated_rows(response_ids: torch.Tensor, response_mask: torch.Tensor, lengths: torch.Tensor,
                   eos_id: int | None) -> torch.Tensor:
    """``(B,)`` bool: the rows that filled every response position without emitting ``eos_id``.

    ``lengths`` counts each row's real response positions (a multi-turn row's observations included), so a row
    is truncated when it reached the batch's response width, the cap the engine generated to."""
    finished = ((response_ids == eos_id) & response_mask.bool()).any(-1) if eos_id is not None \
        else torch.zeros(len(response_ids), dtype=torch.bool)
    return (lengths >= response_ids.shape[1]) & ~finished


def soft_overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, max_penalty: float) -> torch.Tensor:
    """``(B,)`` float, in ``[-max_penalty, 0]``: DAPO's penalty of each response's length against ``max_len``."""
    free = max_len - buffer
    exceeded = (lengths.float() - free).clamp(min=0)
    return -(exceeded / buffer).clamp(max=1.0) * max_penalty
