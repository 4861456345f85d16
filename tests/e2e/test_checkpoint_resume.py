"""Checkpoints end to end on CPU with Ray, PPO with an adaptive KL controller (actor, critic, reference,
rollout and driver state all matter): an interrupted and resumed run logs exactly the metrics of an
uninterrupted one; the export loads in transformers with the actor's logits; NaN steps are skipped, reported
and stop the run; a dead worker is named, and the checkpoint survives.

Runs are shared between tests (each Ray run costs seconds): the module's fixtures run them once, and the
last two tests continue the resumed run, in file order.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _folder_state import folder_state
from _mounts import fill, read_only, small_disk

from hybridrl.config import load_config
from hybridrl.observe.tracking import build_trackers
from hybridrl.plugins.discovery import get_registry
from hybridrl.run.checkpoint import LATEST, checkpoints_root, is_complete, latest_checkpoint
from hybridrl.run.faults import BadStepsError, WorkerDiedError
from hybridrl.run.preflight import prepare_run
from hybridrl.run.trainer import Trainer
from hybridrl.runtime.cluster import detect_cluster

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"
STEPS = 4
RUN = [f"trainer.steps={STEPS}", "data.prompts_per_step=4", "algorithm.n_samples=4", "trainer.progress=false",
       "trainer.trackers=[jsonl]", "trainer.log_samples=0", "algorithm.name=ppo", "algorithm.critic_warmup=1",
       "roles.critic.lr=1e-3", "algorithm.kl.as=reward", "algorithm.kl.estimator=k1",
       "algorithm.kl.controller=adaptive", "algorithm.kl.target=0.5", "algorithm.kl.horizon=100"]
#: metrics that measure the machine (time, memory, bytes moved), not the computation.
MACHINE = ("timing/", "compute/", "perf/", "memory/", "reshard/", "gc/", "device/")


def make_trainer(out: Path, *overrides: str) -> Trainer:
    cfg = load_config(QUICKSTART, [*RUN, *overrides, f"trainer.out={out}"])
    trainer = Trainer(prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster)))
    trainer.start()
    return trainer


def computed(metrics: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if not k.startswith(MACHINE)}


def rows(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(ray_local, tmp_path_factory) -> dict[str, Any]:
    """4 uninterrupted steps, a checkpoint every 2 keeping 1."""
    out = tmp_path_factory.mktemp("full")
    trainer = make_trainer(out, "trainer.save_every=2", "trainer.keep_checkpoints=1")
    try:
        history = trainer.fit()
        weights = trainer.groups["actor"].call_all("weights", "actor")[0]
    finally:
        trainer.shutdown()
    return {"out": out, "history": history, "weights": weights, "model_path": trainer.setup.model_path}


@pytest.fixture(scope="module")
def resumed_run(ray_local, tmp_path_factory):
    """Ctrl-C after step 2 (no periodic saves), then a new trainer on the same folder resumes (auto)."""
    out = tmp_path_factory.mktemp("resumed")
    first = make_trainer(out)
    step = first.train_step

    def interrupted_step() -> dict[str, float]:
        metrics = step()
        if first.step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends; the handler lets the step finish
        return metrics

    first.train_step = interrupted_step  # type: ignore[method-assign]
    try:
        before = first.fit()
    finally:
        first.shutdown()
    state = {"out": out, "before": before, "interrupted": first.interrupted,
             "checkpoints": sorted(p.name for p in checkpoints_root(out).iterdir())}
    second = make_trainer(out)
    try:
        state.update(trainer=second, resumed_from=second.checkpointer.resumed_from, start_step=second.step,
                     after=second.fit())
        yield state
    finally:
        second.shutdown()


def test_ctrl_c_saves_and_auto_resume_repeats_the_uninterrupted_run(full_run, resumed_run) -> None:
    out = resumed_run["out"]
    assert resumed_run["interrupted"] and len(resumed_run["before"]) == 2
    assert resumed_run["checkpoints"] == [LATEST, "step_000002"]  # nothing temporary left behind
    assert resumed_run["resumed_from"] == checkpoints_root(out) / "step_000002" and resumed_run["start_step"] == 2
    full = [computed(m) for m in full_run["history"]]
    joined = [computed(m) for m in resumed_run["before"] + resumed_run["after"]]
    assert len(full) == len(joined) == STEPS
    assert full[2]["actor/grad_norm"] > 0 and full[2]["kl/coef"] != full[0]["kl/coef"]  # trains, KL moves
    for step, (a, b) in enumerate(zip(full, joined), start=1):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-6), f"step {step}: {key}"
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4]  # appended after the resume, no duplicates


def test_periodic_saves_keep_the_newest(full_run) -> None:
    root = checkpoints_root(full_run["out"])
    assert sorted(p.name for p in root.iterdir()) == [LATEST, "step_000004"]
    assert latest_checkpoint(full_run["out"]) == root / "step_000004" and is_complete(root / "step_000004")
    assert sorted(p.name for p in (root / "step_000004").iterdir()) == ["actor", "critic", "driver.json", "driver.pt",
                                                                       "manifest.json"]


def test_export_loads_in_transformers_with_the_actors_logits(full_run, tmp_path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybridrl.model.tokenizer import load_tokenizer

    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "export", str(full_run["out"]), "--out", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    actor = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(full_run["model_path"]), dtype=torch.float32)
    missing, _ = actor.load_state_dict(full_run["weights"], strict=False)
    assert set(missing) <= {"lm_head.weight"}
    actor.tie_weights()
    actor.eval()
    tokenizer = load_tokenizer(out)
    ids = torch.tensor([tokenizer("reverse 12 ->")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, actor(ids).logits, atol=1e-6, rtol=0)
        initial = AutoModelForCausalLM.from_pretrained(full_run["model_path"], dtype=torch.float32).eval()
        assert (initial(ids).logits - actor(ids).logits).abs().max() > 1e-4  # the trained weights, not the initial


def test_export_of_a_missing_step_names_the_steps_there(full_run, tmp_path, capsys) -> None:
    from hybridrl.cli import main

    assert main(["export", str(full_run["out"]), "--step", "3", "--out", str(tmp_path / "none")]) == 2
    assert "no checkpoint of step 3" in capsys.readouterr().err and not (tmp_path / "none").exists()


def copy_of(run: Path, tmp_path: Path) -> Path:
    """A copy of a finished run's folder, for the tests that try to damage one."""
    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    return out


def test_export_refuses_the_run_folder_and_leaves_it_intact(full_run, capsys) -> None:
    from hybridrl.cli import main

    out = full_run["out"]
    before = folder_state(out)
    for target, extra in ((out, []), (out, ["--force"]), (out.parent, ["--force"]),
                          (out / "checkpoints" / "step_000004", ["--force"])):
        assert main(["export", str(out), "--out", str(target), *extra]) == 2, target
        err = capsys.readouterr().err
        assert "export to a folder of its own" in err or "holds no previous export" in err, err
    assert main(["export", str(out / "checkpoints" / "step_000004"), "--out", str(out)]) == 2
    assert "is the run folder" in capsys.readouterr().err
    assert folder_state(out) == before  # checkpoint, metrics, config, initial model: all as they were


def test_export_replaces_a_previous_export_only_with_force(full_run, tmp_path, capsys) -> None:
    from hybridrl.cli import main

    hf, other = tmp_path / "hf", tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    assert main(["export", str(full_run["out"]), "--out", str(other), "--force"]) == 2
    assert "not empty and holds no previous export" in capsys.readouterr().err
    assert folder_state(other) == {"keep.txt": (4, hashlib.sha256(b"mine").hexdigest())}
    assert main(["export", str(full_run["out"]), "--out", str(hf)]) == 0
    first = folder_state(hf)
    assert "model.safetensors" in first
    assert main(["export", str(full_run["out"]), "--out", str(hf)]) == 2
    assert "pass --force to replace it" in capsys.readouterr().err
    (hf / "stale.txt").write_text("from an older export")
    assert main(["export", str(full_run["out"]), "--out", str(hf), "--force"]) == 0
    assert folder_state(hf) == first  # replaced as a whole: the stale file is gone, the export is the same


def test_a_resume_with_another_model_shape_is_refused_before_anything_is_written(full_run, tmp_path) -> None:
    from hybridrl.config import ConfigError

    out = copy_of(full_run["out"], tmp_path)
    before = folder_state(out)
    cfg = load_config(QUICKSTART, [*RUN, "trainer.steps=8", "model.tiny.hidden_size=64", f"trainer.out={out}"])
    with pytest.raises(ConfigError) as err:
        prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster))
    found = dict(err.value.problems)
    assert "another shape" in found["trainer.resume"] and "hidden_size 128 there, 64 here" in found["trainer.resume"]
    assert folder_state(out) == before  # init_model and config.json untouched: the checkpoint still exports
    cfg = load_config(QUICKSTART, [*RUN, "trainer.steps=8", f"trainer.out={out}"])
    setup = prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster))
    assert setup.resume_from == checkpoints_root(out) / "step_000004"  # the unchanged model resumes it
    assert {k: v for k, v in folder_state(out).items() if k != ".lock"} == \
        {k: v for k, v in before.items() if k != ".lock"}  # the .lock now names this process (run_lock)


def test_resume_never_refuses_a_run_folder_and_overwrite_moves_it_aside(full_run, tmp_path) -> None:
    from hybridrl.config import ConfigError

    out = copy_of(full_run["out"], tmp_path)
    before = folder_state(out)
    cfg = load_config(QUICKSTART, [*RUN, "trainer.resume=never", f"trainer.out={out}"])
    with pytest.raises(ConfigError) as err:
        prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster))
    reason = dict(err.value.problems)["trainer.out"]
    assert "holds a previous run (checkpoints/ (latest, step_000004), metrics.jsonl (4 rows)" in reason, reason
    assert "--overwrite" in reason
    assert folder_state(out) == before
    setup = prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster), overwrite=True)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(aside) == 1 and folder_state(aside[0]) == before  # the old run, whole, where the note says
    assert any(str(aside[0]) in note for note in setup.notes), setup.notes
    assert setup.resume_from is None and sorted(p.name for p in out.iterdir()) == [".lock", "init_model"]  # fresh


def test_a_new_run_never_replaces_a_run_that_has_no_checkpoint(full_run, tmp_path) -> None:
    from hybridrl.config import ConfigError

    out = copy_of(full_run["out"], tmp_path)
    shutil.rmtree(out / "checkpoints")
    before = folder_state(out)
    cfg = load_config(QUICKSTART, [*RUN, f"trainer.out={out}"])  # resume=auto, but nothing to resume from
    with pytest.raises(ConfigError) as err:
        prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster))
    assert "it has no checkpoint to resume from" in dict(err.value.problems)["trainer.out"]
    assert folder_state(out) == before


@pytest.mark.parametrize("damage", ["truncate the actor's shard", "random bytes in driver.pt"])
def test_a_damaged_checkpoint_is_found_before_start_up_and_left_as_it_is(full_run, tmp_path, damage) -> None:
    from hybridrl.config import ConfigError

    out = copy_of(full_run["out"], tmp_path)
    folder = checkpoints_root(out) / "step_000004"
    if damage.startswith("truncate"):
        shard = next((folder / "actor").rglob("*.distcp"))
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
        expected = f"{shard.relative_to(folder).as_posix()} is {shard.stat().st_size} bytes"
    else:
        state = folder / "driver.pt"
        state.write_bytes(os.urandom(state.stat().st_size))
        expected = "driver.pt has other contents than when saved"
    before = folder_state(out)
    cfg = load_config(QUICKSTART, [*RUN, "trainer.steps=8", f"trainer.out={out}"])
    with pytest.raises(ConfigError) as err:
        prepare_run(cfg, get_registry(), detect_cluster(cfg.cluster))
    reason = dict(err.value.problems)["trainer.resume"]
    assert "every checkpoint under" in reason and f"step_000004: {expected}" in reason, reason
    assert folder_state(out) == before


def test_a_failed_save_leaves_the_previous_checkpoint_loadable(full_run, resumed_run, monkeypatch) -> None:
    import errno

    from hybridrl.run import checkpoint

    trainer: Trainer = resumed_run["trainer"]
    root = checkpoints_root(resumed_run["out"])

    def disk_full(folder: Path, state: dict) -> None:  # after the workers wrote their shards
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "save_driver_state", disk_full)
        full = r"step \d+ in .*checkpoints.: no space left on device"
        with pytest.raises(checkpoint.CheckpointError, match=full) as err:
            trainer.save()
        assert f"The previous checkpoint, {root / 'step_000002'}, is intact" in str(err.value)
    assert sorted(p.name for p in root.iterdir()) == [LATEST, "step_000002"]
    assert (root / LATEST).read_text() == "step_000002"
    # the previous checkpoint loads into the running workers
    trainer.checkpointer.restore(root / "step_000002", trainer, trainer.groups)
    trainer.sync_weights()
    assert trainer.step == 2
    again = computed(trainer.train_step())  # and step 3 comes out as in the uninterrupted run
    expected = {k: v for k, v in computed(full_run["history"][2]).items() if not k.startswith("trainer/")}
    assert again.keys() == expected.keys()  # (fit adds trainer/bad_step*, a bare train_step does not)
    assert all(again[k] == pytest.approx(v, rel=1e-6, abs=1e-6) for k, v in expected.items())


def test_a_full_disk_during_a_save_is_named_and_the_previous_checkpoint_kept(resumed_run, tmp_path) -> None:
    from hybridrl.run.checkpoint import CheckpointError

    trainer: Trainer = resumed_run["trainer"]
    before = folder_state(checkpoints_root(resumed_run["out"]))
    original = trainer.checkpointer.out
    with small_disk(tmp_path / "disk", 4) as disk:  # smaller than one PPO checkpoint (actor and critic, Adam)
        trainer.checkpointer.out = disk
        try:
            with pytest.raises(CheckpointError) as err:
                trainer.save()  # the workers write their shards onto the full disk (torch: 'enforce fail ...')
        finally:
            trainer.checkpointer.out = original
        message = str(err.value)
        assert f"in '{disk / 'checkpoints'}': no space left on device" in message, message
        assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == []  # nothing half-written left
    assert folder_state(checkpoints_root(resumed_run["out"])) == before


def test_a_read_only_checkpoints_folder_is_named_and_left_as_it_was(resumed_run) -> None:
    from hybridrl.run.checkpoint import CheckpointError

    trainer: Trainer = resumed_run["trainer"]
    root = checkpoints_root(resumed_run["out"])
    before = folder_state(root)
    with read_only(root):
        with pytest.raises(CheckpointError, match=r"not writable \(read-only file system\)") as err:
            trainer.save()
        assert f"'{root}'" in str(err.value)
    assert folder_state(root) == before


def test_metrics_on_a_full_disk_end_the_run_with_the_file_named(resumed_run, tmp_path) -> None:
    from hybridrl.observe.tracking import JsonlTracker
    from hybridrl.run.faults import DiskError

    trainer: Trainer = resumed_run["trainer"]
    steps = trainer.cfg.trainer.steps
    with small_disk(tmp_path / "disk", 1) as disk:
        trainer.trackers = [JsonlTracker(str(disk))]
        fill(disk)
        trainer.cfg.trainer.steps = trainer.step + 1
        try:
            with pytest.raises(DiskError) as err:
                trainer.fit()
        finally:
            trainer.cfg.trainer.steps = steps
            trainer.trackers = []
    message = str(err.value)
    assert "during step" in message and "no space left on device" in message and "metrics.jsonl" in message, message
    assert "step_000002" in message  # the checkpoint to resume from


def test_nan_steps_are_skipped_reported_and_stop_the_run(resumed_run) -> None:
    trainer: Trainer = resumed_run["trainer"]
    weights = trainer.groups["actor"].call_all("weights", "actor")[0]
    start = trainer.step
    trainer.cfg.trainer.steps = start + 5
    trainer.guard.bad.max_bad = 2
    trainer.scorer.rule_scores = lambda batch, texts: (torch.full((len(batch),), float("nan")), [])  # a NaN loss
    trainer.trackers = build_trackers(trainer.registry, trainer.cfg.trainer.trackers, trainer.cfg.trainer.out,
                                      {}, resume=True)  # fit closed them; a resumed run's append
    try:
        with pytest.raises(BadStepsError, match=r"2 bad steps in a row .*trainer.max_bad_steps=2"):
            trainer.fit()
    finally:
        del trainer.scorer.rule_scores  # the class method again
    logged = rows(resumed_run["out"])[-2:]
    assert [r["step"] for r in logged] == [start + 1, start + 2]
    for row in logged:
        assert row["trainer/bad_step"] == 1.0 and row["actor/skipped_step"] == 1.0 and row["reward/mean"] is None
    assert logged[-1]["trainer/bad_steps_in_row"] == 2.0
    after = trainer.groups["actor"].call_all("weights", "actor")[0]
    assert all(torch.equal(after[n], t) for n, t in weights.items())  # the skipped updates changed nothing


def test_dead_worker_is_named_and_the_checkpoint_survives(resumed_run) -> None:
    import ray

    trainer: Trainer = resumed_run["trainer"]
    out = resumed_run["out"]
    trainer.guard.bad.in_row = 0
    trainer.trackers = []
    ray.kill(trainer.groups["actor"].workers[0])
    with pytest.raises(WorkerDiedError) as err:
        trainer.fit()
    message = str(err.value)
    assert "actor" in message and "rank 0 of 1" in message and "node0:0" in message, message
    assert "step_000002" in message and "intact" in message
    assert latest_checkpoint(out) == checkpoints_root(out) / "step_000002"
    assert json.loads((checkpoints_root(out) / "step_000002" / "driver.json").read_text())["step"] == 2
