"""Megatron checkpoints through a real run (on demand: ``HYBRIDRL_SLOW=1``, minutes of CPU): a tensor-parallel-2
actor saved at step 2 and resumed in another run folder repeats step 3 of the uninterrupted run exactly; the
export refuses, with the reason, a layout that one CPU rank cannot hold."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _mg_markers import needs_megatron

pytestmark = [*needs_megatron, pytest.mark.slow,
              pytest.mark.skipif(not os.environ.get("HYBRIDRL_SLOW"), reason="minutes of CPU: set HYBRIDRL_SLOW=1")]

ROOT = Path(__file__).resolve().parents[2]
RUN = ["roles.actor.backend=megatron", "roles.ref.backend=megatron", "roles.actor.options.tensor_parallel=2",
       "pools.main.devices_per_node=2", "trainer.steps=3", "trainer.progress=false", "trainer.trackers=[jsonl]",
       "data.prompts_per_step=4", "algorithm.n_samples=4"]
MACHINE = ("timing/", "compute/", "perf/", "memory/", "reshard/", "gc/")


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hybridrl.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=900)


def test_tensor_parallel_megatron_resumes_exactly(tmp_path: Path) -> None:
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    proc = cli("train", "examples/quickstart.yaml", *RUN, f"trainer.out={full}", "trainer.save_every=2",
               "trainer.keep_checkpoints=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = cli("train", "examples/quickstart.yaml", *RUN, f"trainer.out={resumed}",
               f"trainer.resume={full}/checkpoints/step_000002")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    a = [json.loads(line) for line in (full / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(line) for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in a] == [1, 2, 3] and [r["step"] for r in b] == [3]
    assert a[2]["actor/grad_norm"] > 0
    for key, value in a[2].items():
        if not key.startswith(MACHINE):
            assert b[0][key] == pytest.approx(value, rel=1e-6, abs=1e-6), key
    proc = cli("export", str(full), "--out", str(tmp_path / "hf"))
    assert proc.returncode == 2 and "cannot be built on one CPU rank" in proc.stderr
