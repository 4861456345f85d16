"""Vocabulary-parallel log-probs and entropies against a full-vocabulary log-softmax (values and gradients);
pure torch.distributed, no megatron-core needed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from _lp_cases import PADDED, case, reference

from hybridrl.runtime.distributed import free_port
from hybridrl_megatron.logprobs import vocab_parallel_greedy_margins, vocab_parallel_log_probs

WORKER = Path(__file__).with_name("_logprobs_worker.py")


def reference_grads(logits: torch.Tensor, labels: torch.Tensor, vocab: int, w_lp: torch.Tensor,
                    w_ent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    leaf = logits.clone().requires_grad_(True)
    lp, ent = reference(leaf, labels, vocab)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return lp.detach(), ent.detach(), leaf.grad


def reference_margins(logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> torch.Tensor:
    real = logits[..., :vocab]
    return real.max(-1).values - real.gather(-1, labels[..., None]).squeeze(-1)


def test_greedy_margins_ignore_padding_and_vanish_at_the_argmax() -> None:
    logits, labels, vocab, _, _ = case()
    got = vocab_parallel_greedy_margins(logits, labels, 0, vocab)
    torch.testing.assert_close(got, reference_margins(logits, labels, vocab), atol=1e-6, rtol=0)
    assert (got > 0).any()  # the padding's 50.0 is not the max it is measured from: else every gap would be > 40
    assert got.max() < 40
    argmax = logits[..., :vocab].argmax(-1)
    assert torch.equal(vocab_parallel_greedy_margins(logits, argmax, 0, vocab), torch.zeros_like(got))


def test_one_rank_matches_log_softmax_and_ignores_padding() -> None:
    logits, labels, vocab, w_lp, w_ent = case()
    want_lp, want_ent, want_grad = reference_grads(logits, labels, vocab, w_lp, w_ent)
    leaf = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_log_probs(leaf, labels, 0, vocab, None, with_entropy=True)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    torch.testing.assert_close(lp, want_lp, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent, want_ent, atol=1e-6, rtol=0)
    torch.testing.assert_close(leaf.grad, want_grad, atol=1e-6, rtol=0)
    assert torch.equal(leaf.grad[..., vocab:], torch.zeros_like(leaf.grad[..., vocab:]))
    only_lp, none = vocab_parallel_log_probs(logits, labels, 0, vocab, None)
    assert none is None and torch.allclose(only_lp, want_lp, atol=1e-6)


def test_two_ranks_match_the_full_vocabulary(tmp_path: Path) -> None:
    """Each rank holds half of the padded vocabulary (the second half ends in padding): log-probs and
    entropies equal the full computation on both ranks, and each rank's gradient is its slice of the full one."""
    port, out = free_port(), tmp_path / "lp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", str(port), str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=120)[0] for p in procs]
    for rank, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{log}"
    logits, labels, vocab, w_lp, w_ent = case()
    want_lp, want_ent, want_grad = reference_grads(logits, labels, vocab, w_lp, w_ent)
    width = PADDED // 2
    for rank in range(2):
        got = torch.load(f"{out}.rank{rank}")
        torch.testing.assert_close(got["log_probs"], want_lp, atol=1e-6, rtol=0)
        torch.testing.assert_close(got["entropy"], want_ent, atol=1e-6, rtol=0)
        torch.testing.assert_close(got["grad"], want_grad[..., rank * width:(rank + 1) * width], atol=1e-6, rtol=0)
        torch.testing.assert_close(got["margins"], reference_margins(logits, labels, vocab), atol=1e-6, rtol=0)
