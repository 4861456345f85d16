"""The ``requests`` capability: ``generate_request`` awaited many at once, each checked as a row of ``generate``.

The multi-turn episode runner awaits one request per live trajectory (``hybridrl.environments.runner``), each with
a seed of its own, on the loop ``run_requests`` gives; the kit does the same with a mix of greedy, sampled and
log-prob-free requests in flight together, so that requests that leak into each other show.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hybridrl.engines import SamplingParams
from hybridrl.engines.batch import RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS, Batch
from hybridrl.testing.checks import reference_problems, stop_problems
from hybridrl.testing.reference import ReferenceModel


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    params: SamplingParams


def run_all(engine: Any, requests: Sequence[Request]) -> list[Any]:
    """Every request awaited at once, on the engine's loop (``run_requests``)."""

    async def gather() -> list[Any]:
        return list(await asyncio.gather(*(engine.generate_request(list(r.prompt), r.params) for r in requests)))

    return engine.run_requests(gather())


def shape_problems(results: Sequence[Any], requests: Sequence[Request], vocab_size: int) -> list[str]:
    """Each result: ``token_ids`` a list of 1..max_new_tokens vocabulary ids; ``log_probs`` as many finite
    floats <= 0, or None exactly when the request asked for none (``params.logprobs=False``)."""
    problems = []
    for i, (out, req) in enumerate(zip(results, requests)):
        ids = list(getattr(out, "token_ids", None) or [])
        logps = getattr(out, "log_probs", None)
        width = int(req.params.max_new_tokens)
        if not 1 <= len(ids) <= width:
            problems.append(f"request {i}: {len(ids)} token ids, expected 1 to max_new_tokens={width}")
        if any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
            problems.append(f"request {i}: token ids {ids} are not ints in [0, {vocab_size})")
        if not req.params.logprobs:
            if logps is not None:
                problems.append(f"request {i}: log_probs {logps} returned although params.logprobs=False (None)")
        elif logps is None or len(logps) != len(ids):
            problems.append(f"request {i}: {None if logps is None else len(logps)} log-probs for {len(ids)} tokens")
        elif any(not (v <= 1e-4) for v in logps):  # also catches NaN
            problems.append(f"request {i}: log-probs {list(logps)} not all finite and <= 0")
    return problems


def as_rows(results: Sequence[Any], width: int, pad_id: int) -> Batch:
    """The results as ``generate`` would have returned them (right-padded to ``width``)."""
    n = len(results)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    logps = torch.zeros((n, width), dtype=torch.float32)
    for i, out in enumerate(results):
        toks = list(out.token_ids)[:width]
        ids[i, :len(toks)] = torch.tensor(toks, dtype=torch.long)
        mask[i, :len(toks)] = 1
        if out.log_probs is not None:
            logps[i, :len(toks)] = torch.tensor(list(out.log_probs)[:len(toks)], dtype=torch.float32)
    return Batch.from_tensors({RESPONSE_IDS: ids, RESPONSE_MASK: mask, ROLLOUT_LOG_PROBS: logps})


def request_problems(results: Sequence[Any], requests: Sequence[Request], ref: ReferenceModel, eos_ids: Sequence[int],
                     pad_id: int, atol: float, tie: float, logit_rtol: float) -> list[str]:
    """Stopping, tokens and log-probs of requests that share their ``params`` but for the seed, against the
    reference model, as for ``generate``'s rows (``request i`` is row i of this group)."""
    params = requests[0].params
    rows = as_rows(results, int(params.max_new_tokens), pad_id)
    problems = stop_problems(rows, eos_ids, params)
    tokens, log_probs = reference_problems(rows, [r.prompt for r in requests], ref, params, eos_ids, atol, tie,
                                           logit_rtol)
    problems += tokens + (log_probs if params.logprobs else [])
    return [p.replace("row ", "request ", 1) for p in problems]
