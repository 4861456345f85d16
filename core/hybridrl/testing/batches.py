"""Inputs of the battery: prompt batches for rollouts, scored sequence batches and a loss for trainers."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridrl.engines import LossScale
from hybridrl.engines.batch import (
    ADVANTAGES,
    LOG_PROBS,
    PROMPT_IDS,
    PROMPT_MASK,
    RESPONSE_IDS,
    RESPONSE_MASK,
    Batch,
    left_pad,
    right_pad,
)

#: ids below this are the character tokenizer's specials (pad, eos, bos): random sequences avoid them.
FIRST_PLAIN_ID = 3


def prompt_batch(prompts: Sequence[Sequence[int]], pad_id: int, width: int | None = None) -> Batch:
    """Left-padded prompts, as the trainer sends them to ``generate``."""
    ids, mask = left_pad([list(p) for p in prompts], pad_id, width)
    return Batch.from_tensors({PROMPT_IDS: ids, PROMPT_MASK: mask})


def sequence_batch(size: int, seed: int, vocab_size: int, pad_id: int, max_prompt: int = 7,
                   max_response: int = 6) -> Batch:
    """Left-padded prompts and right-padded responses of random lengths (>= 1, the widths reached by row 0)
    with random advantages: what the trainer hands to ``compute_log_probs`` and ``update``."""
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, max_prompt + 1, (size,), generator=gen).tolist()
    response_lens = torch.randint(1, max_response + 1, (size,), generator=gen).tolist()
    prompt_lens[0], response_lens[0] = max_prompt, max_response
    prompts = [torch.randint(FIRST_PLAIN_ID, vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    responses = [torch.randint(FIRST_PLAIN_ID, vocab_size, (n,), generator=gen).tolist() for n in response_lens]
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    response_ids, response_mask = right_pad(responses, pad_id)
    advantages = torch.randn(size, max_response, generator=gen) * response_mask
    return Batch.from_tensors({PROMPT_IDS: prompt_ids, PROMPT_MASK: prompt_mask, RESPONSE_IDS: response_ids,
                               RESPONSE_MASK: response_mask, ADVANTAGES: advantages})


def rows(batch: Batch) -> list[tuple[list[int], list[int]]]:
    """``(prompt tokens, response tokens)`` of each row, padding removed."""
    out = []
    for i in range(len(batch)):
        prompt = batch[PROMPT_IDS][i][batch[PROMPT_MASK][i].bool()].tolist()
        response = batch[RESPONSE_IDS][i][batch[RESPONSE_MASK][i].bool()].tolist()
        out.append((prompt, response))
    return out


class PolicyGradientLoss:
    """``-sum(log_probs * advantages * mask) / total_tokens * dp_size`` per micro-batch: its exact share of the
    token-mean loss of the whole batch (see ``LossScale``), so the shares add up to ``policy_gradient_loss``."""

    needs = (LOG_PROBS,)

    def __call__(self, outputs: dict[str, torch.Tensor], micro_batch: Batch, scale: LossScale
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = micro_batch[RESPONSE_MASK].to(outputs[LOG_PROBS].device).float()
        adv = micro_batch[ADVANTAGES].to(outputs[LOG_PROBS].device)
        loss = -(outputs[LOG_PROBS] * adv * mask).sum() / scale.total_tokens * scale.dp_size
        return loss, {"kit_tokens": float(mask.sum())}


def policy_gradient_loss(log_probs: torch.Tensor, batch: Batch) -> float:
    """The whole batch's loss from per-token log-probs (what ``PolicyGradientLoss`` sums to)."""
    mask = batch[RESPONSE_MASK].float()
    return float(-(log_probs * batch[ADVANTAGES] * mask).sum() / mask.sum())
