"""hybridrl ``SamplingParams`` -> SGLang's per-request ``sampling_params`` dicts (engine-free).

The engine runs without a tokenizer (``skip_tokenizer_init``), so the model's EOS ids are passed as
``stop_token_ids``. SGLang refuses ``min_new_tokens`` without a tokenizer (its penalizer reads the tokenizer's
EOS), so a request with ``min_new_tokens = m > 0`` runs in two phases: ``m`` tokens with every EOS banned by
``logit_bias`` (the log-probs SGLang returns are then those of the EOS-masked distribution, as the contract asks),
then the rest, continuing from the prompt plus those tokens (the prefix cache holds their KV).

SGLang honours ``sampling_seed`` only with ``enable_deterministic_inference``; ``seed_mode="request"`` turns both on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hybridrl.engines import SamplingParams
from hybridrl.engines.rollout_kit import request_seeds

#: logit bias that bans a token (``-inf`` would also work in SGLang, but a finite value survives every
#: serialisation and gives ``exp() == 0`` in float32).
BAN = -1.0e9


def validate(params: SamplingParams) -> None:
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 for SGLang, got {params.max_new_tokens}")
    if params.min_new_tokens > params.max_new_tokens:
        raise ValueError(f"min_new_tokens={params.min_new_tokens} exceeds max_new_tokens={params.max_new_tokens}")


def base_sampling(params: SamplingParams) -> dict[str, Any]:
    """The distribution part, shared by every phase and row: greedy is ``temperature=0`` (SGLang turns it
    into ``top_k=1`` and returns raw log-softmax log-probs); ``top_k=0`` (off) is SGLang's ``-1``."""
    if params.greedy:
        return {"temperature": 0.0}
    return {"temperature": float(params.temperature), "top_p": float(params.top_p),
            "top_k": int(params.top_k) if params.top_k and params.top_k > 0 else -1}


@dataclass(frozen=True)
class Phase:
    """One ``generate`` call over all rows: ``max_new_tokens`` more tokens, EOS banned or not."""

    max_new_tokens: int
    ban_eos: bool


def phases(params: SamplingParams) -> list[Phase]:
    """``[ban m, then the rest]`` with ``min_new_tokens = m`` (one phase when the rest is empty), else one
    ordinary phase. With ``ignore_eos`` the EOS is neither banned nor a stop, so one phase suffices."""
    validate(params)
    m, n = int(params.min_new_tokens), int(params.max_new_tokens)
    if m <= 0 or params.ignore_eos:
        return [Phase(n, False)]
    return [Phase(m, True)] + ([Phase(n - m, False)] if n > m else [])


def phase_sampling(params: SamplingParams, phase: Phase, eos_ids: Sequence[int]) -> dict[str, Any]:
    """The ``sampling_params`` dict of one phase (no seed)."""
    kwargs = {**base_sampling(params), "max_new_tokens": int(phase.max_new_tokens), "skip_special_tokens": False}
    eos = sorted({int(e) for e in eos_ids})
    if phase.ban_eos:
        # nothing can stop this phase early: the EOS cannot be drawn and the length is fixed
        kwargs["ignore_eos"] = True
        if eos:
            kwargs["logit_bias"] = {str(e): BAN for e in eos}
    elif params.ignore_eos:
        kwargs["ignore_eos"] = True
    elif eos:
        kwargs["stop_token_ids"] = eos
    return kwargs


def per_request(params: SamplingParams, phase: Phase, eos_ids: Sequence[int], rows: int, replica: int,
                seed_mode: str, budgets: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Each row's ``sampling_params`` for one phase; with ``seed_mode="request"`` and a seed each row
    carries its own ``sampling_seed`` (the same in every phase: SGLang mixes in the position). ``budgets``:
    each row's tokens in this phase (``phase_budgets``: per-row caps), where they differ from the phase's."""
    shared = phase_sampling(params, phase, eos_ids)
    seeds = request_seeds(params.seed, replica, rows) if seed_mode == "request" and not params.greedy else None
    if seeds is None:
        out = [dict(shared) for _ in range(rows)]
    else:
        out = [{**shared, "sampling_seed": s} for s in seeds]
    if budgets is not None:
        if len(budgets) != rows:
            raise ValueError(f"{len(budgets)} phase budgets for {rows} rows")
        for kwargs, budget in zip(out, budgets):
            kwargs["max_new_tokens"] = int(budget)
    return out


def phase_budgets(phase: Phase, caps: Sequence[int], lengths: Sequence[int]) -> list[int]:
    """How many tokens each row may add in ``phase``: the phase's length, cut to what is left of the row's cap
    (``caps``: each row's ``max_new_tokens``; ``lengths``: its tokens so far). A row of budget 0 sits the phase
    out. A cap below ``min_new_tokens`` ends its row inside the EOS-banned phase, with no EOS: the cap wins."""
    return [max(0, min(int(phase.max_new_tokens), int(cap) - int(n))) for cap, n in zip(caps, lengths)]


def top_logprobs_wanted(params: SamplingParams, top_n: int, vocab_size: int | None = None) -> int:
    """How many top log-probs per token to ask for, to renormalise over the top-k / top-p support
    (``hybridrl_sglang.packing.renormalise``); 0 when the support is the whole vocabulary or greedy. Never
    more than the vocabulary: SGLang's scheduler takes ``topk`` of that many and dies past the vocabulary."""
    if params.greedy:
        return 0
    k = int(params.top_k) if params.top_k and params.top_k > 0 else 0
    wanted = (max(k, top_n) if k == 0 else k) if params.top_p < 1.0 else k
    return min(wanted, int(vocab_size)) if vocab_size else wanted
