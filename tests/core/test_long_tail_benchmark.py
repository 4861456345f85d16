"""``benchmarks/long_tail.py``'s steady state: a pipelined arm's last step (nothing generating beside it) is left
out, a synchronous arm's is kept."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
long_tail = pytest.importorskip("long_tail")


def rows(step_seconds, pipelined):
    """Logged steps as a run writes them: a pipelined step also logs ``timing/overlap_saved``."""
    extra = {"timing/overlap_saved": 1.0} if pipelined else {}
    return [{"timing/step": s, "response_length/mean": 100.0, "reward/mean": 0.0, **extra} for s in step_seconds]


@pytest.mark.parametrize("arm, expected_step, steady", [("fractional", 19.0, 1), ("sync", 12.0, 2)])
def test_a_pipelined_arms_last_step_is_not_steady_state(arm, expected_step, steady):
    args = types.SimpleNamespace(skip=1, steps=3, prompts=4, samples=2)
    busy = types.SimpleNamespace(fraction=lambda: None)
    out = long_tail.summary(args, arm, long_tail.ARMS[arm],
                            rows([30.0, 19.0, 5.0], pipelined=arm != "sync"), 0, 60.0, busy, "")
    assert out["steady_steps"] == steady and out["step_s"] == pytest.approx(expected_step)
    assert out["samples_per_s"] == pytest.approx(8 / expected_step)
