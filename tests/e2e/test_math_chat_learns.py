"""``examples/math-chat.yaml`` learns on CPU: the tiny model with the chat tokenizer, one-digit addition in chat
form, the built-in gsm8k reward plus a format bonus; the greedy validation reward rises (on demand:
``HYBRIDRL_SLOW=1 python -m pytest tests/e2e/test_math_chat_learns.py``; minutes of CPU)."""

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
def test_math_chat_learns_and_its_validation_reward_rises(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", "examples/math-chat.yaml",
                           f"trainer.out={out}", "trainer.progress=false"],
                          capture_output=True, text=True, cwd=ROOT, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val/reward/mean"]) for r in rows if "val/reward/mean" in r]
    assert val[0][0] == 0 and val[-1][0] == 300
    first, last = val[0][1], val[-1][1]
    # measured: 0.00 before training; after 300 steps 0.43 (pass@1 0.23) under this test, 0.64 (0.44) in a run with
    # only the jsonl tracker. A policy that settles on the format bonus alone ends at 0.2 with pass@1 0.
    assert last >= first + 0.3, val
    pass_at_1 = [r["val/pass@1"] for r in rows if "val/pass@1" in r]
    assert pass_at_1[-1] >= 0.2, pass_at_1  # twice a guessed digit's 0.1
    best = json.loads((out / "best" / "best.json").read_text())
    assert best["value"] == max(v for s, v in val if s > 0)
