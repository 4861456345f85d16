"""Checks of one ``generate`` result against the contract and the reference model.

Each check returns a list of human-readable problems (empty: the contract holds) so that a failure lists
every bad row at once; ``violated`` turns them into a test failure that names the broken contract.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from hybridrl.engines import SamplingParams
from hybridrl.engines.batch import RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS, Batch
from hybridrl.testing.reference import ReferenceModel, near_support_edge, sampling_log_probs


def violated(backend: str, contract: str, problems: Sequence[str]) -> None:
    """Fail the test with ``<backend>: <contract>`` and every problem, one per line (the kit's models are tiny:
    a list of all of them is short, and the one a fix needs is never hidden)."""
    listed = "\n  ".join(problems)
    pytest.fail(f"backend '{backend}': {contract}\n  {listed}", pytrace=False)


def check(backend: str, contract: str, problems: Sequence[str]) -> None:
    if problems:
        violated(backend, contract, problems)


def layout_problems(out: Batch, rows: int, width: int, vocab_size: int) -> list[str]:
    """Keys, shapes, dtypes, devices, value ranges and right-padded masks."""
    problems = []
    for key in (RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS):
        if key not in out:
            problems.append(f"'{key}' missing from the result")
    if problems:
        return problems
    expected = {RESPONSE_IDS: torch.int64, RESPONSE_MASK: torch.int64, ROLLOUT_LOG_PROBS: torch.float32}
    for key, dtype in expected.items():
        t = out[key]
        if tuple(t.shape) != (rows, width):
            problems.append(f"'{key}' has shape {tuple(t.shape)}, expected ({rows}, {width}) = (rows, max_new_tokens)")
        if t.dtype != dtype:
            problems.append(f"'{key}' has dtype {t.dtype}, expected {dtype}")
        if t.device.type != "cpu":
            problems.append(f"'{key}' is on {t.device}, expected cpu")
    if problems:
        return problems
    ids, mask, logp = out[RESPONSE_IDS], out[RESPONSE_MASK], out[ROLLOUT_LOG_PROBS]
    if not ((mask == 0) | (mask == 1)).all():
        problems.append(f"response_mask holds values other than 0/1: {sorted(set(mask.unique().tolist()))}")
    for i in range(rows):
        m = mask[i].tolist()
        n = sum(1 for v in m if v)
        if m != [1] * n + [0] * (width - n):
            problems.append(f"row {i}: response_mask {m} is not right-padded (ones, then zeros)")
        elif n == 0:
            problems.append(f"row {i}: no token generated (max_new_tokens={width} >= 1)")
        real = ids[i, :n]
        if n and ((real < 0) | (real >= vocab_size)).any():
            problems.append(f"row {i}: token ids {real.tolist()} outside the vocabulary [0, {vocab_size})")
        if not torch.isfinite(logp[i]).all():
            problems.append(f"row {i}: rollout_log_probs not finite: {logp[i].tolist()}")
        elif n and (logp[i, :n] > 1e-4).any():
            problems.append(f"row {i}: rollout_log_probs > 0: {logp[i, :n].tolist()}")
    return problems


def stop_problems(out: Batch, eos_ids: Sequence[int], params: SamplingParams) -> list[str]:
    """A row ends at its first EOS, which is inside the mask; a row shorter than the width ends with an EOS;
    no EOS before ``min_new_tokens``; with ``ignore_eos`` every row fills the width."""
    problems = []
    width = params.max_new_tokens
    for i in range(out[RESPONSE_IDS].shape[0]):
        n = int(out[RESPONSE_MASK][i].sum())
        ids = out[RESPONSE_IDS][i, :n].tolist()
        eos_at = [t for t, tok in enumerate(ids) if tok in eos_ids]
        if params.ignore_eos:
            if n != width:
                problems.append(f"row {i}: {n} tokens kept with ignore_eos=True, expected all {width}")
        else:
            if eos_at and eos_at[0] != n - 1:
                problems.append(f"row {i}: an EOS at step {eos_at[0]} does not end the row (mask keeps {n} tokens: "
                                f"{ids})")
            if n < width and (not ids or ids[-1] not in eos_ids):
                problems.append(f"row {i}: stops after {n} of {width} tokens without an EOS as its last kept token "
                                f"({ids})")
        early = [t for t in eos_at if t < params.min_new_tokens]
        if early:
            problems.append(f"row {i}: EOS at step {early[0]} < min_new_tokens={params.min_new_tokens}")
    return problems


def reference_problems(out: Batch, prompts: Sequence[Sequence[int]], ref: ReferenceModel, params: SamplingParams,
                       eos_ids: Sequence[int], logprob_atol: float, tie_tolerance: float, logit_rtol: float = 0.0
                       ) -> tuple[list[str], list[str]]:
    """Teacher-forced comparison with the reference model on the engine's own kept tokens (one forward per
    row); returns ``(token problems, log-prob problems)``.

    Tokens, greedy: each is the reference argmax (or within ``tie_tolerance`` of its log-prob, a near-tie
    that numerical noise may break either way); sampled: each lies in the support of the sampling
    distribution, or within ``tie_tolerance`` of a top-k/top-p edge (``reference.near_support_edge``: the same
    near-tie at the support's border; such a token's log-prob has no reference value and is not compared).
    Log-probs: equal to the reference's within ``logprob_atol``.

    ``logit_rtol`` widens both tolerances of a row by that fraction of its largest reference logit: a 16-bit
    engine rounds logits (and the activations before them) relative to their size, 2**-8 per operation in
    bfloat16, so a model with large logits differs from an fp32 reference by more than a fixed tolerance."""
    tokens: list[str] = []
    log_probs: list[str] = []
    for i, prompt in enumerate(prompts):
        n = int(out[RESPONSE_MASK][i].sum())
        if n == 0:
            continue
        ids = out[RESPONSE_IDS][i, :n].tolist()
        logits = ref.step_logits(prompt, ids)
        widen = logit_rtol * float(logits.abs().max()) if logit_rtol else 0.0
        row_atol, row_tie = logprob_atol + widen, tie_tolerance + widen
        logp_ref = sampling_log_probs(logits, params, eos_ids)
        chosen = logp_ref[torch.arange(n), torch.tensor(ids, dtype=torch.long)]
        for t, tok in enumerate(ids):
            if params.greedy:
                best = int(logp_ref[t].argmax())
                gap = float(logp_ref[t, best] - logp_ref[t, tok])
                if tok != best and gap > row_tie:
                    tokens.append(f"row {i} step {t}: engine chose {tok}, the reference argmax is {best} "
                                  f"(log-prob gap {gap:.3g}); engine row {ids}")
                    break
            elif not torch.isfinite(chosen[t]) and not near_support_edge(logits[t], tok, params, eos_ids, t, row_tie):
                tokens.append(f"row {i} step {t}: token {tok} has probability 0 under the sampling distribution "
                              f"(temperature={params.temperature}, top_k={params.top_k}, top_p={params.top_p}, "
                              f"min_new_tokens={params.min_new_tokens})")
                break
        got = out[ROLLOUT_LOG_PROBS][i, :n].float()
        ok = torch.isfinite(chosen)
        diff = (got[ok] - chosen[ok]).abs()
        if diff.numel() and float(diff.max()) > row_atol:
            t = int(ok.nonzero()[diff.argmax()])
            log_probs.append(f"row {i} step {t}: rollout log-prob {float(got[t]):.6f}, reference "
                             f"{float(chosen[t]):.6f} (|diff| {float(diff.max()):.2e} > atol {row_atol:g})")
    return tokens, log_probs
