"""``trainer.out`` without workers: which folders a new run may use, what a resume needs, ``--overwrite``
moving the old run aside whole, and folders that cannot be written (found before anything starts)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from hybridrl.run import checkpoint as ckpt
from hybridrl.run.run_folder import move_aside, not_writable, plan_run_folder, previous_run


def a_run(out: Path, steps: int = 2, checkpoint: bool = True) -> Path:
    """What a run of ``steps`` steps leaves: config, metrics, samples, a checkpoint."""
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"model": {}, "data": {}, "trainer": {}}))
    (out / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, steps + 1)))
    (out / "samples.jsonl").write_text("")
    (out / "init_model").mkdir()
    if checkpoint:
        def write(tmp: Path) -> dict:
            ckpt.save_driver_state(tmp, {"step": steps})
            return {"roles": {"actor": "fsdp"}}
        ckpt.save_checkpoint(out, steps, write, keep=0)
    return out


def reasons(plan) -> dict[str, str]:
    return dict(plan.problems)


@pytest.mark.parametrize("resume", ["auto", "never"])
def test_a_new_run_may_use_an_absent_empty_or_start_up_only_folder(tmp_path: Path, resume: str) -> None:
    assert plan_run_folder(tmp_path / "absent", resume).problems == []
    (tmp_path / "empty").mkdir()
    assert plan_run_folder(tmp_path / "empty", resume).problems == []
    started = a_run(tmp_path / "started", checkpoint=False)
    (started / "metrics.jsonl").write_text("")  # a run that failed before its first step
    assert previous_run(started) == []
    assert plan_run_folder(started, resume).problems == []


def test_never_refuses_a_run_and_auto_resumes_it(tmp_path: Path) -> None:
    out = a_run(tmp_path / "r1")
    reason = reasons(plan_run_folder(out, "never"))["trainer.out"]
    assert "holds a previous run (checkpoints/ (latest, step_000002), metrics.jsonl (2 rows))" in reason
    assert "trainer.resume=never starts a new run" in reason and "--overwrite" in reason and "r1.old-" in reason
    plan = plan_run_folder(out, "auto")
    assert plan.problems == [] and plan.resume_from == out / "checkpoints" / "step_000002"
    assert plan_run_folder(out, str(out / "checkpoints" / "step_000002")).problems == []  # its own checkpoint


def test_a_run_is_never_mixed_with_another_runs_checkpoint_or_foreign_files(tmp_path: Path) -> None:
    other = a_run(tmp_path / "other")
    out = a_run(tmp_path / "r1", checkpoint=False)
    reason = reasons(plan_run_folder(out, str(other)))["trainer.out"]
    assert "names another run's checkpoint" in reason
    assert "no checkpoint to resume from" in reasons(plan_run_folder(out, "auto"))["trainer.out"]
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.json").write_text('{"name": "not a run"}')
    (project / "notes.txt").write_text("mine")
    assert previous_run(project) == ["config.json (not a run's)", "notes.txt (not a run's)"]
    assert "trainer.out" in reasons(plan_run_folder(project, "auto"))


def test_overwrite_moves_the_old_run_aside_whole(tmp_path: Path) -> None:
    out = a_run(tmp_path / "r1")
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    plan = plan_run_folder(out, "never", overwrite=True)
    assert plan.problems == [] and plan.resume_from is None and plan.move_aside
    assert plan_run_folder(out, "auto", overwrite=True).resume_from is None  # --overwrite: a new run
    assert "trainer.resume" in reasons(plan_run_folder(out, str(out / "checkpoints"), overwrite=True))
    moved = move_aside(out)
    assert moved.parent == tmp_path and moved.name.startswith("r1.old-") and not out.exists()
    moved_entries = sorted(p.relative_to(moved).as_posix() for p in moved.rglob("*"))
    assert moved_entries == sorted([*before, ".lock"])  # held while it was moved (hybridrl.run.run_lock)
    out.mkdir()
    assert move_aside(out) != moved  # a second one in the same second gets a name of its own


def test_a_damaged_latest_checkpoint_is_passed_over_with_a_note(tmp_path: Path) -> None:
    out = a_run(tmp_path / "r1")
    def write(tmp: Path) -> dict:
        ckpt.save_driver_state(tmp, {"step": 4})
        return {"roles": {"actor": "fsdp"}}
    ckpt.save_checkpoint(out, 4, write, keep=0)
    (out / "checkpoints" / "step_000004" / "driver.pt").write_bytes(b"garbage")
    plan = plan_run_folder(out, "auto")
    assert plan.problems == [] and plan.resume_from == out / "checkpoints" / "step_000002"
    assert plan.notes[0].startswith(f"skipped the damaged checkpoint {out / 'checkpoints' / 'step_000004'}: driver.pt")


@pytest.fixture
def read_only_folder(tmp_path: Path):
    """A folder nothing can be created in: a read-only bind mount when this runs as root (root ignores
    permission bits), else one without write permission."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if os.geteuid() != 0:
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    mounted = subprocess.run(["mount", "--bind", "-o", "ro", str(folder), str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot make a read-only folder as root here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_folder_that_cannot_be_written_is_found_before_anything_starts(read_only_folder: Path) -> None:
    why = not_writable(read_only_folder / "run")
    assert why is not None and str(read_only_folder) in why
    assert ("read-only file system" if os.geteuid() == 0 else "permission denied") in why
    reason = reasons(plan_run_folder(read_only_folder / "run", "auto"))["trainer.out"]
    assert "is not writable" in reason
    assert not_writable(read_only_folder.parent) is None


def test_the_device_map_of_a_start_is_nothing_to_lose(tmp_path: Path) -> None:
    from hybridrl.run.run_folder import previous_run
    from hybridrl.runtime.device_map import DEVICE_MAP_FILE

    (tmp_path / DEVICE_MAP_FILE).write_text("[]")
    assert previous_run(tmp_path) == []
    (tmp_path / "notes.txt").write_text("mine")
    assert previous_run(tmp_path) == ["notes.txt (not a run's)"]


def test_a_folder_the_checks_cannot_see_into_is_refused_by_its_key(capsys: pytest.CaptureFixture[str]) -> None:
    """/proc takes no folders, though as root access() says it is writable: pre-flight tries one, and the run
    ends with one sentence naming trainer.out, not a traceback from creating it."""
    from hybridrl.cli import main

    out = f"/proc/hybridrl-{os.getpid()}"
    quickstart = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
    assert main(["train", str(quickstart), f"trainer.out={out}", "trainer.steps=1"]) == 2
    err = capsys.readouterr().err
    assert "trainer.out: '/proc' is not writable" in err and "Traceback" not in err
    assert not Path(out).exists()


def test_an_export_into_a_folder_the_checks_cannot_see_into_is_refused_first(tmp_path: Path) -> None:
    """The same place as --out: refused with the reason before any checkpoint is read (the run folder here is
    empty, so reading one would fail with another sentence)."""
    from hybridrl.run.export import ExportError, export_checkpoint

    with pytest.raises(ExportError, match=r"--out '/proc/hybridrl-export': '/proc' is not writable"):
        export_checkpoint(tmp_path, "/proc/hybridrl-export")
