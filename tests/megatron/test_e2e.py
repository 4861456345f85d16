"""The real run: ``hybridrl train`` with a tensor-parallel-2 Megatron actor and reference over two Ray workers,
the transformers rollout in the same processes. After every step's reshard the rollout's log-probs of its own
samples must equal the Megatron actor's (``rollout/logp_diff``): the export is the trained model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _mg_markers import needs_megatron

pytestmark = [*needs_megatron, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_quickstart_with_tensor_parallel_megatron(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", "examples/quickstart.yaml",
                           "roles.actor.backend=megatron", "roles.ref.backend=megatron",
                           "roles.actor.options.tensor_parallel=2", "pools.main.devices_per_node=2",
                           "trainer.steps=3", f"trainer.out={out}", "trainer.progress=false",
                           "trainer.trackers=[jsonl]",
                           "roles.rollout.log_probs=true"],  # rollout/logp_diff reads them (auto: off without TIS)
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "actor[megatron] ranks 0-1/2, ref[megatron] ranks 0-1/2, rollout[hf] ranks 0-1/2" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert row["rollout/logp_diff"] < 1e-5, row["rollout/logp_diff"]
        assert row["actor/skipped_step"] == 0.0 and row["actor/grad_norm"] > 0
    assert rows[-1]["actor/kl_loss"] > 0  # the actor moved away from the reference


def test_moe_quickstart_with_expert_parallel_megatron(tmp_path: Path) -> None:
    """The MoE quick start with expert parallelism 2: each rank's 4 experts reach both rollouts (the sync check and
    ``rollout/logp_diff`` find them the actor's) and the routers' loss is logged."""
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "train", "examples/quickstart-moe.yaml",
                           "roles.actor.backend=megatron", "roles.ref.backend=megatron",
                           "roles.actor.options={expert_parallel: 2}", "pools.main.devices_per_node=2",
                           "trainer.steps=3", "trainer.sync_check_every=1", f"trainer.out={out}",
                           "trainer.progress=false", "trainer.trackers=[jsonl]", "roles.rollout.log_probs=true"],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    for row in rows:
        assert row["rollout/logp_diff"] < 1e-5, row["rollout/logp_diff"]
        assert row["sync_check/off_argmax"] == 0 and row["sync_check/tokens"] > 0
        assert 1.5 < row["moe/aux_loss"] < 8.0
