"""The quick start, exactly as the README runs it, learns the task (the issue's acceptance bar).

About 3 minutes on 2 quiet cores: ``HYBRIDRL_SLOW=1 python -m pytest tests/e2e/test_quickstart_learns.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("HYBRIDRL_SLOW"), reason="minutes of CPU: set HYBRIDRL_SLOW=1 to run")
def test_quickstart_learns_to_reverse(tmp_path):
    out = tmp_path / "qs"
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", "examples/quickstart.yaml",
                           f"trainer.out={out}", "trainer.progress=false", "trainer.trackers=[jsonl]"],
                          capture_output=True, text=True, cwd=ROOT, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rewards = [json.loads(line)["reward/mean"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= 0.8, f"last-10 mean reward {last:.3f} < 0.8 (first-10 {first:.3f})"
    assert last - first >= 0.3
