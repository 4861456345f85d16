"""Checks of the ``partial`` capability: per-row caps, ``generate_until`` stopping at its share of groups,
and a cut row resumed as prompt + its tokens (the driver's partial rollouts, ``hybridrl.run.streaming``).

Every check compares the engine with an uninterrupted greedy run of its own: greedy decoding is a function of
the weights and the tokens so far, so a capped, cut or resumed row must reproduce that run's tokens. Where two
runs part at a near-tie of the reference model (two tokens whose log-probs are closer than the kit's tie
tolerance: numerical noise, say of a different batch, may break it either way) the rest of the row is not
compared. Each function returns human-readable problems (empty: the contract holds).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybridrl.engines.batch import (
    FINISHED,
    GROUP_INDEX,
    MAX_NEW_TOKENS,
    RESPONSE_IDS,
    RESPONSE_MASK,
    ROLLOUT_LOG_PROBS,
    Batch,
)
from hybridrl.testing.batches import prompt_batch
from hybridrl.testing.reference import ReferenceModel


def responses(out: Batch) -> list[list[int]]:
    """Each row's kept tokens (where ``response_mask`` is 1)."""
    return [out[RESPONSE_IDS][i][out[RESPONSE_MASK][i].bool()].tolist() for i in range(len(out))]


def requests(prompts: Sequence[Sequence[int]], pad_id: int, caps: Sequence[int], groups: Sequence[int]) -> Batch:
    """Left-padded prompts with each row's ``max_new_tokens`` cap and ``group_index``, as the driver sends them."""
    batch = prompt_batch(prompts, pad_id)
    batch.set(MAX_NEW_TOKENS, torch.tensor(list(caps), dtype=torch.long))
    batch.set(GROUP_INDEX, torch.tensor(list(groups), dtype=torch.long))
    return batch


def parting(ref: ReferenceModel, prompt: Sequence[int], got: Sequence[int], want: Sequence[int],
            tie_tolerance: float, logit_rtol: float = 0.0) -> tuple[int, bool] | None:
    """Where ``got`` first leaves ``want`` (None: ``got`` is a prefix of it), and whether that is a near-tie of
    the reference (the rest of the row is then not comparable)."""
    for t, (a, b) in enumerate(zip(got, want)):
        if a != b:
            logits = ref.step_logits(prompt, list(got[:t + 1]))[t]
            logp = torch.log_softmax(logits.double(), -1)
            tie = tie_tolerance + logit_rtol * float(logits.abs().max())
            return t, abs(float(logp[a] - logp[b])) <= tie
    if len(got) > len(want):
        return len(want), False
    return None


def layout_problems(out: Batch, rows: int, width: int) -> list[str]:
    """``generate``'s keys at the packed width (``params.max_new_tokens``), right-padded masks, and ``finished``
    (B,) bool when asked for."""
    problems = []
    for key in (RESPONSE_IDS, RESPONSE_MASK, ROLLOUT_LOG_PROBS):
        if key not in out:
            problems.append(f"'{key}' missing from the result")
        elif tuple(out[key].shape) != (rows, width):
            problems.append(f"'{key}' has shape {tuple(out[key].shape)}, expected ({rows}, {width}) = (rows, "
                            "params.max_new_tokens: caps do not change the width)")
    if problems:
        return problems
    for i in range(rows):
        m = out[RESPONSE_MASK][i].tolist()
        n = sum(1 for v in m if v)
        if m != [1] * n + [0] * (width - n):
            problems.append(f"row {i}: response_mask {m} is not right-padded (ones, then zeros)")
    return problems


def finished_problems(out: Batch, rows: int) -> list[str]:
    if FINISHED not in out:
        return [f"'{FINISHED}' missing from generate_until's result"]
    finished = out[FINISHED]
    if tuple(finished.shape) != (rows,) or finished.dtype != torch.bool:
        return [f"'{FINISHED}' has shape {tuple(finished.shape)} and dtype {finished.dtype}, expected ({rows},) bool"]
    return []


def capped_problems(out: Batch, prompts: Sequence[Sequence[int]], caps: Sequence[int], full: Batch,
                    ref: ReferenceModel, logprob_atol: float, tie_tolerance: float, logit_rtol: float = 0.0
                    ) -> list[str]:
    """Each row of ``out`` is the first ``cap`` tokens of the uncapped run ``full`` (all of it when shorter),
    with its log-probs."""
    problems = []
    got_rows, full_rows = responses(out), responses(full)
    for i, (prompt, cap, got, uncapped) in enumerate(zip(prompts, caps, got_rows, full_rows)):
        want = uncapped[:cap]
        if len(got) > cap:
            problems.append(f"row {i}: {len(got)} tokens for a cap of {cap}: {got}")
            continue
        parted = parting(ref, prompt, got, want, tie_tolerance, logit_rtol)
        if parted is not None:
            t, tie = parted
            if not tie:
                problems.append(f"row {i} (cap {cap}): token {t} is {got[t] if t < len(got) else None}, the uncapped "
                                f"run's is {want[t] if t < len(want) else None} (capped {got}, uncapped {uncapped})")
            continue
        if len(got) != len(want):
            problems.append(f"row {i}: {len(got)} tokens with a cap of {cap}, the uncapped run gives {len(uncapped)} "
                            f"(capped {got}, uncapped {uncapped})")
            continue
        diff = (out[ROLLOUT_LOG_PROBS][i, :len(got)] - full[ROLLOUT_LOG_PROBS][i, :len(got)]).abs()
        if diff.numel() and float(diff.max()) > logprob_atol:
            problems.append(f"row {i}: rollout_log_probs differ from the uncapped run's by up to "
                            f"{float(diff.max()):.2e}")
    return problems


def cut_problems(out: Batch, prompts: Sequence[Sequence[int]], caps: Sequence[int], full: Batch,
                 eos_ids: Sequence[int], ref: ReferenceModel, logprob_atol: float, tie_tolerance: float,
                 logit_rtol: float = 0.0) -> list[str]:
    """A ``generate_until`` result against the uninterrupted run ``full`` of the same rows: every row a prefix
    of its run (up to its cap) with the same log-probs; ``finished`` exactly on the rows that ended (an EOS or
    the cap), which hold all of their run."""
    problems = []
    finished = out[FINISHED].tolist()
    for i, (prompt, cap, got, whole) in enumerate(zip(prompts, caps, responses(out), responses(full))):
        want = whole[:cap]
        parted = parting(ref, prompt, got, want, tie_tolerance, logit_rtol)
        if parted is not None:
            t, tie = parted
            if not tie:
                problems.append(f"row {i}: token {t} is {got[t] if t < len(got) else None}, an uninterrupted run's is "
                                f"{want[t] if t < len(want) else None} (cut {got}, uninterrupted {want})")
            continue
        ended = len(got) >= cap or (bool(got) and got[-1] in eos_ids)
        if bool(finished[i]) != ended:
            problems.append(f"row {i}: finished={bool(finished[i])} for {len(got)} tokens {got} (cap {cap}, "
                            f"uninterrupted {want}): finished must say whether the row ended (an EOS or its cap)")
        diff = (out[ROLLOUT_LOG_PROBS][i, :len(got)] - full[ROLLOUT_LOG_PROBS][i, :len(got)]).abs()
        if diff.numel() and float(diff.max()) > logprob_atol:
            problems.append(f"row {i}: rollout_log_probs differ from an uninterrupted run's by up to "
                            f"{float(diff.max()):.2e}")
    return problems


def resumed_problems(prompts: Sequence[Sequence[int]], cut: Sequence[Sequence[int]], resumed: Batch, full: Batch,
                     ref: ReferenceModel, tie_tolerance: float, logit_rtol: float = 0.0) -> list[str]:
    """Each cut row's tokens followed by its resumed row's equal the uninterrupted run's."""
    problems = []
    for i, (prompt, head, tail, whole) in enumerate(zip(prompts, cut, responses(resumed), responses(full))):
        got = list(head) + tail
        parted = parting(ref, prompt, got, whole, tie_tolerance, logit_rtol)
        if parted is not None and not parted[1]:
            t = parted[0]
            problems.append(f"row {i}: cut after {len(head)} tokens {list(head)} and resumed, token {t} is "
                            f"{got[t] if t < len(got) else None}, the uninterrupted run's is "
                            f"{whole[t] if t < len(whole) else None} (resumed {got}, uninterrupted {whole})")
        elif parted is None and len(got) != len(whole):
            problems.append(f"row {i}: cut after {len(head)} tokens and resumed gives {len(got)} tokens {got}, the "
                            f"uninterrupted run {len(whole)}: {whole}")
    return problems
