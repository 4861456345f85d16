"""Between hybridrl's padded tensors and vLLM's per-request token lists (engine-free).

In: ``prompt_ids``/``prompt_mask`` left-padded ``(B, P)`` -> one token list per row. Out: each request's
sampled ids and the log-probs vLLM returned -> ``response_ids``/``response_mask``/``rollout_log_probs``,
right-padded to exactly ``max_new_tokens`` columns, the stop (EOS) token inside the mask.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from hybridrl.batch import RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS, Batch


def unpad_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[list[int]]:
    """The real tokens of each row (where the mask is 1), in order. A row with no token raises
    ``ValueError`` naming it: vLLM cannot generate from an empty prompt."""
    if prompt_ids.shape != prompt_mask.shape:
        raise ValueError(f"prompt_ids {tuple(prompt_ids.shape)} and prompt_mask {tuple(prompt_mask.shape)} differ")
    ids = prompt_ids.to(torch.long).tolist()
    keep = prompt_mask.to(torch.bool).tolist()
    rows = []
    for i, (row, m) in enumerate(zip(ids, keep)):
        tokens = [t for t, k in zip(row, m) if k]
        if not tokens:
            raise ValueError(f"row {i}: empty prompt (its prompt_mask has no token)")
        rows.append(tokens)
    return rows


def check_context(prompts: Sequence[Sequence[int]], max_new_tokens: int, context_length: int | None) -> None:
    """Refuse a row whose prompt plus ``max_new_tokens`` exceeds the engine's context (vLLM would reject it
    with a less specific message, after the other rows started)."""
    if context_length is None:
        return
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > context_length:
            raise ValueError(f"row {i}: prompt of {len(p)} tokens + max_new_tokens={max_new_tokens} exceeds the "
                             f"engine's context length {context_length}")


def sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """The log-prob of each sampled token from vLLM's ``CompletionOutput.logprobs``.

    Accepts the flat form (``FlatLogprobs``: parallel lists ``token_ids``/``logprobs`` with per-position
    ``start_indices``/``end_indices``) and the classic list of ``{token_id: Logprob}`` dicts. A missing entry
    raises ``ValueError``: the engine must be asked for ``logprobs=0``."""
    n = len(token_ids)
    if logprobs is None:
        raise ValueError("vLLM returned no log-probs (the request must ask for logprobs=0)")
    if hasattr(logprobs, "start_indices") and hasattr(logprobs, "logprobs"):
        starts, ends = logprobs.start_indices, logprobs.end_indices
        flat_ids, flat_lp = logprobs.token_ids, logprobs.logprobs
        if len(starts) < n:
            raise ValueError(f"vLLM returned log-probs for {len(starts)} of {n} tokens")
        if len(flat_lp) == n and list(flat_ids) == list(token_ids):  # one entry per position: the sampled one
            return [float(v) for v in flat_lp]
        out = []
        for pos, tok in enumerate(token_ids):
            for j in range(starts[pos], ends[pos]):
                if flat_ids[j] == tok:
                    out.append(float(flat_lp[j]))
                    break
            else:
                raise ValueError(f"position {pos}: no log-prob for the sampled token {tok}")
        return out
    if len(logprobs) < n:
        raise ValueError(f"vLLM returned log-probs for {len(logprobs)} of {n} tokens")
    out = []
    for pos, tok in enumerate(token_ids):
        entry = logprobs[pos].get(tok) if logprobs[pos] is not None else None
        if entry is None:
            raise ValueError(f"position {pos}: no log-prob for the sampled token {tok}")
        out.append(float(getattr(entry, "logprob", entry)))
    return out


def pack_responses(token_lists: Sequence[Sequence[int]], logprob_lists: Sequence[Sequence[float]] | None, width: int,
                   pad_id: int) -> Batch:
    """``response_ids`` (pad after the last token), ``response_mask`` (1 on every returned token, the stop
    token included) and ``rollout_log_probs`` (float32, 0 where masked; left out when ``logprob_lists`` is
    None), each ``(B, width)`` on CPU. A response longer than ``width`` raises (the engine was asked for at
    most ``width`` tokens)."""
    n = len(token_lists)
    with_logprobs = logprob_lists is not None
    logprob_lists = logprob_lists if with_logprobs else [[0.0] * len(t) for t in token_lists]
    if len(logprob_lists) != n:
        raise ValueError(f"{n} responses but {len(logprob_lists)} log-prob lists")
    ids = torch.full((n, width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    logps = torch.zeros((n, width), dtype=torch.float32)
    for i, (toks, lps) in enumerate(zip(token_lists, logprob_lists)):
        k = len(toks)
        if k > width:
            raise ValueError(f"row {i}: {k} tokens returned, at most {width} asked for")
        if len(lps) != k:
            raise ValueError(f"row {i}: {k} tokens but {len(lps)} log-probs")
        if k:
            ids[i, :k] = torch.as_tensor(list(toks), dtype=torch.long)
            mask[i, :k] = 1
            logps[i, :k] = torch.as_tensor(list(lps), dtype=torch.float32)
    tensors = {RESPONSE_IDS: ids, RESPONSE_MASK: mask}
    if with_logprobs:
        tensors[ROLLOUT_LOG_PROBS] = logps
    return Batch.from_tensors(tensors)
