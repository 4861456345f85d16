"""``trainer.profile_step``: the workers profile the named engine calls of that step inside the real run and
write their top operators (kernels on a GPU) to ``<out>/profile/``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridrl.config import load_config
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.preflight import prepare_run
from hybridrl.run.trainer import Trainer
from hybridrl.runtime.cluster import detect_cluster

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["trainer.steps=2", "data.prompts_per_step=4", "algorithm.n_samples=4", "trainer.progress=false",
         "trainer.trackers=[jsonl]", "trainer.log_samples=0"]


def test_the_named_calls_of_the_chosen_step_are_profiled(tmp_path, ray_local):
    cfg = load_config(ROOT / "examples" / "quickstart.yaml",
                      [*SMALL, "trainer.profile_step=2", "trainer.profile_calls=[actor.update,rollout.generate]",
                       f"trainer.out={tmp_path}"])
    trainer = Trainer(prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster)))
    try:
        trainer.start()
        trainer.fit()
    finally:
        trainer.shutdown()
    written = sorted(p.name for p in (tmp_path / "profile").iterdir())
    assert written == ["step2_actor.update_rank0.json", "step2_rollout.generate_rank0.json"]  # step 2 only, once
    report = json.loads((tmp_path / "profile" / "step2_actor.update_rank0.json").read_text())
    assert report["call"] == "actor.update" and report["device"] == "cpu" and report["seconds"] > 0
    names = [row["name"] for row in report["top"]]
    assert any("mm" in name or "linear" in name for name in names)  # the update's matmuls are in it
    assert sum(row["share"] for row in report["top"]) <= 1.0 + 1e-9
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for row in rows:  # every step carries the collector's pauses of each engine call (hybridrl.observe.gc_pauses)
        assert row["gc/actor.update_s"] >= 0 and row["gc/rollout.generate_full"] >= 0


def test_profile_calls_must_name_a_role_and_method():
    with pytest.raises(ValueError, match="'actr.update' is not role.method"):
        load_config(ROOT / "examples" / "quickstart.yaml", ["trainer.profile_calls=[actr.update]"])
