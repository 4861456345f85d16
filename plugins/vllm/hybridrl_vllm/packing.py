"""Between hybridrl's padded tensors and vLLM's per-request token lists (engine-free).

In: ``prompt_ids``/``prompt_mask`` left-padded ``(B, P)`` -> one token list per row. Out: each request's
sampled ids and the log-probs vLLM returned -> ``response_ids``/``response_mask``/``rollout_log_probs``,
right-padded to exactly ``max_new_tokens`` columns, the stop (EOS) token inside the mask. Unpadding, the
context check and packing are the core's (``hybridrl.engines.rollout_kit``); reading vLLM's log-probs is here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


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

