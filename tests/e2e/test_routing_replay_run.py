"""The MoE quick start with routing replay runs end to end: the HF rollout returns each response token's experts,
the driver carries them into the actor's old-log-prob pass and update, and the run logs how often the actor's own
routing differs from the rollout's (``moe/routing_mismatch``) next to ``rollout/logp_diff``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_moe_quickstart_with_routing_replay_runs(tmp_path):
    out = tmp_path / "qs-moe-replay"
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", "examples/quickstart-moe.yaml",
                           f"trainer.out={out}", "trainer.progress=false", "trainer.trackers=[jsonl]",
                           "trainer.steps=3", "trainer.sync_check_every=0", "data.prompts_per_step=4",
                           "algorithm.n_samples=4", "algorithm.routing_replay=true", "roles.rollout.log_probs=true",
                           "algorithm.old_log_probs=recompute"],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert 0.0 <= row["moe/routing_mismatch"] <= 1.0
        assert row["rollout/logp_diff"] < 1e-3  # the actor's log-probs are the rollout's (its routing replayed)
