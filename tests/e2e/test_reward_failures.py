"""A reward that passes the pre-flight probe and then fails on the real responses (issue 21's case), through
``hybridrl train`` as a user runs it: the run stops at the first step with exit code 1, naming
``roles.reward.fn`` and the first failure, instead of crashing with a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


@pytest.mark.parametrize("runner", ["process"])
def test_a_reward_failing_after_the_probe_stops_the_run_with_its_key(tmp_path, runner):
    path = os.pathsep.join([str(ROOT / "tests" / "core"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(QUICKSTART), "trainer.steps=3",
                           f"trainer.out={tmp_path / 'run'}", "data.prompts_per_step=4", "algorithm.n_samples=4",
                           "roles.reward.fn=_reward_helpers:late_failure", f"roles.reward.runner={runner}",
                           "trainer.progress=false"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridrl: ") and "rewards of the batch failed" in last, proc.stderr[-3000:]
    assert "roles.reward.fn '_reward_helpers:late_failure'" in last
    assert "Traceback" not in proc.stderr
    assert "step 1" not in proc.stdout  # it stopped in the first step's reward phase


def test_a_reward_that_starts_hanging_stops_the_run_after_its_limit_in_a_row(tmp_path):
    """Passes the probe, then hangs on every response: each call is cut at roles.reward.timeout_s, and after
    roles.reward.max_consecutive_failures timeouts in a row the run stops with one line naming the key, instead
    of paying the timeout for all 16 responses of the step."""
    import time

    path = os.pathsep.join([str(ROOT / "tests" / "core"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(QUICKSTART), "trainer.steps=3",
                           f"trainer.out={tmp_path / 'run'}", "data.prompts_per_step=4", "algorithm.n_samples=4",
                           "roles.reward.fn=_user_code_helpers:late_hang", "roles.reward.runner=process",
                           "roles.reward.workers=1", "roles.reward.timeout_s=2", "roles.reward.max_failed_fraction=1",
                           "roles.reward.max_consecutive_failures=3", "trainer.progress=false"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    took = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("hybridrl: roles.reward.fn '_user_code_helpers:late_hang' failed 3 times in a row the "
                           "same way (the last: timed out after 2s (roles.reward.timeout_s))"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "step 1" not in proc.stdout
    print(f"run stopped after {took:.1f}s")  # 16 timeouts at 2 s would be 32 s of scoring alone
