"""Between hybridrl's padded tensors and SGLang's per-request token lists (engine-free).

In: ``prompt_ids``/``prompt_mask`` left-padded ``(B, P)`` -> one ``input_ids`` list per row. Out: each request's
``output_ids`` and ``meta_info["output_token_logprobs"]`` (``(logprob, token_id, text)`` triples) ->
``response_ids``/``response_mask``/``rollout_log_probs`` right-padded to exactly ``max_new_tokens`` columns.

SGLang's sampled-token log-probs are ``log softmax(logits / T)`` *before* top-k/top-p truncation; the contract
wants them under the distribution the token was drawn from, so with top-k/top-p they are renormalised over the
kept support, computed from the top log-probs SGLang returns (``renormalise``). Unpadding, the context check and
packing are the core's (``hybridrl.engines.rollout_kit``).

An MoE engine started with ``enable_return_routed_experts`` answers a request that sets ``return_routed_experts``
with ``meta_info["routed_experts"]``: base64 of int32 ``(tokens fed, layers, top_k)``, the prompt's tokens and
each output token but the last (``routed_experts``), the layout ``rollout_kit.pack_routing`` takes.
"""

from __future__ import annotations

import base64
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Completion:
    """One request's sampled tokens, their log-probs, and (when asked) the top log-probs at each position."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[float, int]]] = field(default_factory=list)


def parse_output(out: Mapping[str, Any], row: int, logprobs: bool = True) -> Completion:
    """Read one element of ``Engine.generate``'s result. Log-probs are matched to tokens by position and the
    token id they carry is checked, so a shifted or truncated list fails loudly instead of mislabelling.
    ``logprobs=False``: the request did not ask for them; the completion carries none."""
    ids = [int(t) for t in out.get("output_ids") or []]
    if not logprobs:
        return Completion(ids, [])
    meta = out.get("meta_info") or {}
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise ValueError(f"row {row}: SGLang returned no output_token_logprobs (return_logprob must be on)")
    if len(entries) != len(ids):
        raise ValueError(f"row {row}: {len(ids)} output ids but {len(entries)} log-probs")
    lps = []
    for pos, (entry, tok) in enumerate(zip(entries, ids)):
        value, token = float(entry[0]), int(entry[1])
        if token != tok:
            raise ValueError(f"row {row}, position {pos}: log-prob of token {token}, but token {tok} was sampled")
        lps.append(value)
    top: list[list[tuple[float, int]]] = []
    raw_top = meta.get("output_top_logprobs")
    if raw_top:
        top = [[(float(e[0]), int(e[1])) for e in (pos or [])] for pos in raw_top[:len(ids)]]
    return Completion(ids, lps, top)


def _logsumexp(values: Sequence[float]) -> float:
    m = max(values)
    if m == -math.inf:
        return m
    return m + math.log(sum(math.exp(v - m) for v in values))


def renormalise(logprob: float, top: Sequence[tuple[float, int]], top_k: int, top_p: float,
                joint: bool = True) -> tuple[float, bool]:
    """``(log-prob under the truncated distribution, exact)`` of a token whose full-vocabulary log-prob is
    ``logprob``, given the position's top log-probs ``top`` (any order).

    The support is the ``top_k`` most likely tokens (0: all) that also pass top-p: a token is kept while the
    probability mass before it stays within ``top_p`` (the most likely token always kept). ``joint=True`` measures
    that mass on the full distribution, as SGLang's samplers do (FlashInfer's ``joint`` order and its PyTorch
    fallback); ``joint=False`` on the distribution renormalised over the top-k first, as
    ``hybridrl.rollout.hf.filter_logits`` does. The two agree unless both top-k and top-p are set. ``exact`` is
    False when ``top`` is too short to close the support (the log-sum then stops at what was returned)."""
    k = int(top_k) if top_k and top_k > 0 else 0
    if k == 0 and top_p >= 1.0:
        return logprob, True
    values = sorted((v for v, _ in top), reverse=True)
    if not values:
        return logprob, False
    exact = not k or len(values) >= k
    kept = values[:k] if k else values
    if top_p < 1.0:
        # log-probs are normalised over the vocabulary; renormalise over the top-k first unless joint
        base = _logsumexp(kept) if (k and exact and not joint) else 0.0
        nucleus, before = [], 0.0
        for v in kept:
            if nucleus and before >= top_p:
                break
            nucleus.append(v)
            before += math.exp(v - base)
        else:
            if not k and before < top_p:  # ran out of returned entries before the mass reached top_p
                exact = False
        kept = nucleus
    return logprob - _logsumexp(kept), exact


def ended(tokens: Sequence[int], eos_ids: Sequence[int]) -> bool:
    """Whether a phase's output stopped at an EOS (then later phases add nothing to the row)."""
    return bool(tokens) and int(tokens[-1]) in {int(e) for e in eos_ids}


def routed_experts(out: Mapping[str, Any], row: int, layers: int, top_k: int, fed: int) -> torch.Tensor:
    """One request's experts per fed token, ``(fed, layers, top_k)`` int32, from ``meta_info["routed_experts"]``.
    ``fed``: the tokens the request fed (its input and every output token but the last); an answer of another
    size, or none, fails loudly rather than shifting the routing against the tokens."""
    raw = (out.get("meta_info") or {}).get("routed_experts")
    if raw is None:
        raise ValueError(f"row {row}: SGLang returned no routed_experts (the engine must start with "
                         "enable_return_routed_experts and the request ask for return_routed_experts)")
    data = bytearray(base64.b64decode(raw)) if isinstance(raw, str) else None
    flat = (torch.frombuffer(data, dtype=torch.int32) if data else torch.zeros(0, dtype=torch.int32)) \
        if data is not None else torch.as_tensor(raw, dtype=torch.int32).flatten()
    if flat.numel() != fed * layers * top_k:
        raise ValueError(f"row {row}: {flat.numel()} routed expert ids, not {fed} fed tokens x {layers} layers x "
                         f"top {top_k}")
    return flat.reshape(fed, layers, top_k)
