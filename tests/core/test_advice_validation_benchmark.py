"""``benchmarks/advice_validation.py``'s measurement: a pipelined run's last step (a drain that only trains) is
left out of its mean, and an in-flight map is never taken for its synchronous profile run."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
advice_validation = pytest.importorskip("advice_validation")


def metrics(step_seconds: list[float], pipelined: bool) -> list[dict]:
    extra = {"timing/overlap_saved": 1.0} if pipelined else {}
    return [{"step": n, "timing/step": s, **extra} for n, s in enumerate(step_seconds, 1)]


@pytest.mark.parametrize("pipelined, steps", [(True, [2, 3]), (False, [2, 3, 4])])
def test_a_pipelined_runs_drain_step_is_not_steady(pipelined, steps):
    steady = advice_validation.steady_steps(metrics([9.0, 4.0, 4.2, 1.7], pipelined), skip=1)
    assert [r["step"] for r in steady] == steps


def test_one_steady_step_is_kept_even_when_it_is_the_last():
    steady = advice_validation.steady_steps(metrics([9.0, 4.0], pipelined=True), skip=1)
    assert [r["step"] for r in steady] == [2]


def _map(mode: str, pipelined: bool = False):
    cfg = types.SimpleNamespace(roles=types.SimpleNamespace(rollout=types.SimpleNamespace(tensor_parallel=1)),
                                trainer=types.SimpleNamespace(pipelined=pipelined, mode=mode))
    plan = types.SimpleNamespace(pools={"main": [0]}, role_pool={"actor": "main", "rollout": "main"})
    return cfg, plan


def test_an_in_flight_map_is_not_its_synchronous_twin():
    assert advice_validation.signature(*_map("sync")) != advice_validation.signature(*_map("async"))
    assert advice_validation.signature(*_map("sync")) == advice_validation.signature(*_map("sync"))
