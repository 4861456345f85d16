"""Pre-flight resolves the run once into a ``RunPlan``: the config as given, the one the run uses, the
algorithm, and every decision with its reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridrl.algorithms import objective
from hybridrl.config import load_config
from hybridrl.placement.plan import ClusterSpec
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.preflight import prepare_run

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
SPLIT = ROOT / "examples" / "quickstart-split.yaml"
CPU2 = ClusterSpec(1, 2, "cpu", declared=True)


def test_prepare_run_resolves_the_algorithm_once_and_keeps_both_configs(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    resolve = objective.resolve_algorithm

    def counted(cfg, registry):
        calls.append(cfg.name)
        return resolve(cfg, registry)

    monkeypatch.setattr(objective, "resolve_algorithm", counted)
    cfg = load_config(SPLIT, [f"trainer.out={tmp_path / 'run'}", "trainer.pipelined=true"])
    setup = prepare_run(cfg, get_registry(), CPU2)
    plan = setup.run_plan
    assert plan is not None
    # pre-flight resolves once; the memory plan's log-prob readers once more (hybridrl.placement.auto)
    assert len(calls) <= 2, calls
    assert plan.given is cfg and plan.config is setup.cfg
    assert "tis_cap" not in plan.given.algorithm.model_fields_set
    assert plan.config.algorithm.tis_cap == plan.algorithm.config.tis_cap == 2.0
    assert any("tis_cap" in note for note in plan.notes)
    record = json.loads(json.dumps(plan.record()))
    assert "tis_cap" not in record["given"].get("algorithm", {})
    assert record["resolved"]["algorithm"]["tis_cap"] == 2.0
    assert record["algorithm"]["advantage"] == plan.algorithm.advantage
    assert [a["key"] for a in record["auto"]] == [c.key for c in plan.auto]
    assert all(a["reason"] for a in record["auto"])


def test_the_trainer_reads_the_plans_algorithm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hybridrl.run import trainer as trainer_module

    cfg = load_config(QUICKSTART, [f"trainer.out={tmp_path / 'run'}"])
    setup = prepare_run(cfg, get_registry(), CPU2)

    def refuse(*_args, **_kwargs):
        raise AssertionError("the trainer resolved the algorithm again")

    monkeypatch.setattr(trainer_module, "resolve_algorithm", refuse)
    monkeypatch.setattr(objective, "resolve_algorithm", refuse)
    trainer = trainer_module.Trainer(setup)
    assert trainer.algo is setup.run_plan.algorithm
