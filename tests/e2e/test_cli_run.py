"""``hybridrl train`` as a user runs it: the metrics file carries every phase of every step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"

PHASES = ["gen", "reward", "ref", "old_log_prob", "adv", "update_actor", "reshard", "step"]


def test_train_cli_writes_metrics_with_every_phase(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(QUICKSTART), "trainer.steps=3",
                           f"trainer.out={out}", "data.prompts_per_step=4", "algorithm.n_samples=4",
                           "algorithm.old_log_probs=recompute"],  # the quick start would skip that pass
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "actor[fsdp] rank 0/1" in proc.stdout  # the device map printed at start-up
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        for phase in PHASES:
            assert row[f"timing/{phase}"] >= 0.0
        assert 0.0 <= row["reward/mean"] <= 1.0
        assert row["response_length/mean"] > 0


def test_bad_input_fails_before_any_process_starts(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", str(QUICKSTART), f"data.train={empty}",
                           "roles.rollout.backend=nope", f"trainer.out={tmp_path / 'run'}"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "roles.rollout.backend" in proc.stderr and "unknown rollout backend 'nope'" in proc.stderr
    assert "empty" in proc.stderr.lower()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
