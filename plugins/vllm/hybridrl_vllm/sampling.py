"""hybridrl ``SamplingParams`` -> keyword arguments of ``vllm.SamplingParams`` (engine-free).

The engine runs without a tokenizer (``skip_tokenizer_init``), so vLLM knows no EOS of its own: the model's
EOS ids become ``stop_token_ids`` (which also makes ``min_tokens`` mask them, as the contract asks), and
nothing is detokenized. ``logprobs=0`` returns exactly the sampled token's log-prob, which with the engine's
``processed_logprobs`` mode is its log-prob under the distribution it was drawn from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hybridrl.engines import SamplingParams
from hybridrl.engines.rollout_kit import request_seeds

#: ``seed_mode`` values: one seed per request (reproducible, independent of batching), the engine's
#: own random stream (no per-request generators: faster for large batches on GPU), or ``auto``: request on
#: CPU (tests compare runs), engine on GPU (vLLM samples seeded rows one by one).
SEED_MODES = ("auto", "request", "engine")


def resolve_seed_mode(mode: str, device: str) -> str:
    if mode not in SEED_MODES:
        raise ValueError(f"seed_mode must be one of {SEED_MODES}, got '{mode}'")
    if mode == "auto":
        return "engine" if device == "cuda" else "request"
    return mode


def sampling_kwargs(params: SamplingParams, eos_ids: Sequence[int], *, flat_logprobs: bool = False) -> dict[str, Any]:
    """Keyword arguments shared by every request of one ``generate`` call (no seed)."""
    if params.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 for vLLM, got {params.max_new_tokens}")
    if params.min_new_tokens > params.max_new_tokens:
        raise ValueError(f"min_new_tokens={params.min_new_tokens} exceeds max_new_tokens={params.max_new_tokens}")
    kwargs: dict[str, Any] = {
        "n": 1,
        "temperature": float(params.temperature),
        "max_tokens": int(params.max_new_tokens),
        "min_tokens": int(params.min_new_tokens),
        "logprobs": 0 if params.logprobs else None,
        "detokenize": False,
        "skip_special_tokens": False,
        "ignore_eos": bool(params.ignore_eos),
    }
    if not params.greedy:  # greedy ignores them; vLLM would only warn
        kwargs["top_p"] = float(params.top_p)
        kwargs["top_k"] = int(params.top_k) if params.top_k and params.top_k > 0 else 0
    # ignore_eos: an EOS must not end the row, and stop_token_ids would end it regardless of ignore_eos.
    if not params.ignore_eos and eos_ids:
        kwargs["stop_token_ids"] = [int(e) for e in eos_ids]
    if flat_logprobs and params.logprobs:
        kwargs["flat_logprobs"] = True
    return kwargs


def per_request_kwargs(params: SamplingParams, eos_ids: Sequence[int], rows: int, replica: int,
                       seed_mode: str = "request", flat_logprobs: bool = False,
                       caps: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """The kwargs of each row's ``vllm.SamplingParams``; with ``seed_mode="request"`` and a seed, each row
    carries its own (see ``request_seeds``). ``caps``: each row's token budget (the batch's ``max_new_tokens``,
    at most ``params.max_new_tokens``; ``min_new_tokens`` shrinks to it); a row of budget 0 gets no request
    (the caller leaves it out: vLLM asks for at least one token)."""
    if seed_mode not in SEED_MODES or seed_mode == "auto":
        raise ValueError(f"seed_mode must be 'request' or 'engine' here (resolve 'auto' first), got '{seed_mode}'")
    if caps is not None and len(caps) != rows:
        raise ValueError(f"{len(caps)} max_new_tokens caps for {rows} rows")
    shared = sampling_kwargs(params, eos_ids, flat_logprobs=flat_logprobs)
    seeds = request_seeds(params.seed, replica, rows) if seed_mode == "request" and not params.greedy else None
    if seeds is None and caps is None:
        return [shared] * rows
    out = []
    for i in range(rows):
        kwargs = shared if seeds is None else {**shared, "seed": seeds[i]}
        if caps is not None and caps[i] != shared["max_tokens"]:
            cap = int(caps[i])
            kwargs = {**kwargs, "max_tokens": cap, "min_tokens": min(int(shared["min_tokens"]), cap)}
        out.append(kwargs)
    return out
