"""The validation loop's pieces without workers: when it runs, what it reports (mean@k, pass@k, best@k, per
source), the pre-flight checks of its keys, and ``hybridrl report``'s validation table."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_data_formats import QUICKSTART

from hybridrl.config import ConfigError, load_config
from hybridrl.data.loading import PromptRow
from hybridrl.engines import SamplingParams
from hybridrl.engines.batch import RESPONSE_IDS, RESPONSE_MASK, Batch
from hybridrl.placement.plan import ClusterSpec
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.preflight import prepare_run
from hybridrl.run.validation import Validator, metric_names


def _validator(tmp_path, k=1, **trainer):
    cfg = load_config(QUICKSTART, [f"trainer.out={tmp_path}", f"trainer.val_n={k}",
                                   *(f"trainer.{key}={value}" for key, value in trainer.items())])
    prompts = [PromptRow(f"p{i}", [1, 2], {"data_source": "a" if i < 2 else "b"}) for i in range(3)]
    return Validator(cfg, prompts, pad_id=0, sampling=SamplingParams(max_new_tokens=3))


def test_schedule(tmp_path):
    v = _validator(tmp_path, val_every=10, steps=25)
    assert [s for s in range(26) if v.due(s)] == [0, 10, 20, 25]
    v.last_step = 20
    assert not v.due(20)  # never twice for one step
    assert [s for s in range(26) if _validator(tmp_path, val_before_train="false", steps=25).due(s)] == [25]


def test_mean_pass_and_best_at_k_overall_and_per_source(tmp_path):
    v = _validator(tmp_path, k=2, val_temperature=1.0)
    # prompt 0 (a): 1.0, 0.0; prompt 1 (a): 0.2, 0.4; prompt 2 (b): 1.2, 1.0
    scores, index = [1.0, 0.0, 0.2, 0.4, 1.2, 1.0], [0, 0, 1, 1, 2, 2]
    metas = [{"data_source": "a"}] * 4 + [{"data_source": "b"}] * 2
    m = v.summarize(scores, index, metas, [1, 2, 3, 3, 1, 1])
    assert m["val/reward/mean"] == pytest.approx(3.8 / 6)
    assert m["val/pass@2"] == pytest.approx(2 / 3) and m["val/best@2"] == pytest.approx((1.0 + 0.4 + 1.2) / 3)
    assert m["val/a/reward/mean"] == pytest.approx(0.4) and m["val/a/pass@2"] == 0.5
    assert m["val/b/reward/mean"] == pytest.approx(1.1) and m["val/b/pass@2"] == 1.0
    assert m["val/response_length/mean"] == pytest.approx(11 / 6)
    assert set(m) == set(metric_names(2, {"a", "b"}))


def test_the_pass_threshold_is_configurable(tmp_path):
    v = _validator(tmp_path, val_pass_threshold=0.5)
    m = v.summarize([0.6, 0.4, 0.0], [0, 1, 2], [{}, {}, {}], [1, 1, 1])
    assert m["val/pass@1"] == pytest.approx(1 / 3)


def test_a_resumed_run_keeps_its_best_value(tmp_path):
    (tmp_path / "best").mkdir()
    (tmp_path / "best" / "best.json").write_text(json.dumps({"metric": "val/reward/mean", "value": 0.7, "step": 40}))
    v = _validator(tmp_path, keep_best="val/reward/mean")
    assert (v.best_value, v.best_step) == (0.7, 40)



class _Rollout:
    """The rollout group's one call validation makes, answered in the driver: a response of 2 tokens per row."""

    def __init__(self) -> None:
        self.calls: list[int | None] = []

    def call(self, role: str, method: str, batch: Batch, params: SamplingParams) -> SimpleNamespace:
        assert (role, method) == ("rollout", "generate")
        self.calls.append(params.seed)
        rows = len(batch)
        return SimpleNamespace(value=Batch.from_tensors({RESPONSE_IDS: torch.ones(rows, 2, dtype=torch.long),
                                                         RESPONSE_MASK: torch.ones(rows, 2, dtype=torch.long)}))


def _scorer(*scores: float):
    """Scores the i-th call's rows with ``scores[i]``."""
    left = list(scores)

    def score(batch: Batch) -> SimpleNamespace:
        value = left.pop(0)
        return SimpleNamespace(scores=torch.full((len(batch),), value), texts=["r"] * len(batch))

    return score


def test_validation_runs_when_due_and_keeps_the_best_through_values(tmp_path):
    rollout, saved = _Rollout(), []

    def save_copy(folder: Path, extra: dict) -> Path:
        saved.append((folder, extra))
        folder.mkdir(exist_ok=True)  # as a checkpoint's save makes it
        return folder / "checkpoints" / "step_x"

    v = Validator(load_config(QUICKSTART, [f"trainer.out={tmp_path}", "trainer.val_every=2", "trainer.steps=4",
                                           "trainer.keep_best=val/reward/mean", "trainer.seed=1"]),
                  [PromptRow("p", [1, 2], {})], 0, SamplingParams(), rollout, _scorer(0.2, 0.5, 0.1), None, False,
                  save_copy)
    assert v.maybe_run(1) == {}  # not due: nothing generated
    first = v.maybe_run(2)
    assert first["val/reward/mean"] == pytest.approx(0.2) and rollout.calls == [7_777]
    assert v.maybe_run(2) == {}  # never twice for one step
    assert saved == [(tmp_path / "best", {"best": {"metric": "val/reward/mean", "value": pytest.approx(0.2)}})]
    assert json.loads((tmp_path / "best" / "best.json").read_text())["step"] == 2
    assert v.maybe_run(4)["val/reward/mean"] == pytest.approx(0.5) and len(saved) == 2  # better: kept
    v.last_step = None
    assert v.maybe_run(4)["val/reward/mean"] == pytest.approx(0.1) and len(saved) == 2  # worse: not kept
    assert (v.best_value, v.best_step) == (pytest.approx(0.5), 4)


def _problems(tmp_path, overrides):
    cfg = load_config(QUICKSTART, [f"trainer.out={tmp_path / 'run'}", *overrides])
    with pytest.raises(ConfigError) as err:
        prepare_run(cfg, get_registry(), ClusterSpec(1, 2, "cpu"))
    return dict(err.value.problems)


@pytest.mark.parametrize("overrides, key, reason", [
    (["trainer.val_every=5"], "trainer.val_every", "needs validation data"),
    (["trainer.keep_best=val/reward/mean"], "trainer.keep_best", "needs validation data"),
    (["data.val=examples/data/reverse2.jsonl", "trainer.val_n=4"], "trainer.val_n",
     "4 greedy responses per prompt would all be the same"),
    (["data.val=examples/data/reverse2.jsonl", "trainer.keep_best=val/pass@4"], "trainer.keep_best",
     "'val/pass@4' is not a validation metric of this run (known: val/reward/mean, val/pass@1"),
    (["data.val=no/such.jsonl"], "data.val", "data file 'no/such.jsonl' not found"),
])
def test_validation_keys_are_checked_before_start(tmp_path, overrides, key, reason):
    found = _problems(tmp_path, overrides)
    assert reason in found.get(key, ""), found


def test_val_prompts_are_tokenised_like_the_training_ones(tmp_path):
    cfg = load_config(QUICKSTART, [f"trainer.out={tmp_path / 'run'}", "data.val=examples/data/reverse2.jsonl"])
    setup = prepare_run(cfg, get_registry(), ClusterSpec(1, 2, "cpu"))
    assert len(setup.val_prompts) == 100 and setup.val_prompts[0].token_ids == setup.prompts[0].token_ids


def test_report_shows_validation(tmp_path):
    from hybridrl.observe.report import render_summary, summarize

    rows = [{"step": 0, "val/reward/mean": 0.1, "val/pass@1": 0.0, "timing/val": 1.0},
            {"step": 1, "reward/mean": 0.2, "timing/step": 1.0},
            {"step": 2, "reward/mean": 0.3, "timing/step": 1.0, "val/reward/mean": 0.5, "val/pass@1": 0.25},
            {"step": 3, "reward/mean": 0.3, "timing/step": 1.0, "val/reward/mean": 0.4, "val/pass@1": 0.5}]
    s = summarize(rows, {})
    assert s.steps == 3  # the step-0 validation row is not a training step
    assert s.val["val/reward/mean"] == {"first": 0.1, "first_step": 0.0, "last": 0.4, "last_step": 3.0,
                                        "best": 0.5, "best_step": 2.0}
    text = render_summary(s, {}, {})
    assert "## Validation" in text
    assert "| val/reward/mean | 0.1000 (step 0) | 0.4000 (step 3) | 0.5000 (step 2) |" in text
    assert "| val/pass@1 |" in text
