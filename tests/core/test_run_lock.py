"""One run per folder: a live run's ``.lock`` refuses a second run, an ``--overwrite`` and an export, naming the
holder; the lock of a run that is gone is taken over, saying so. The holder is another process, as in life."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.run import checkpoint as ckpt
from hybridrl.run.export import ExportError, export_checkpoint
from hybridrl.run.run_folder import move_aside, plan_run_folder
from hybridrl.run.run_lock import LOCK_FILE, RunLocked, acquire, holder

HOLD = """
import sys, time
from hybridrl.run.run_lock import acquire
acquire(sys.argv[1])
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def hold(folder: Path, seconds: float = 60) -> subprocess.Popen:
    """Another process holding ``folder``'s lock (as a live run's driver does)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), str(seconds)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def live(tmp_path: Path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = hold(out)
    yield out, proc
    proc.kill()
    proc.wait()


def _problems(plan) -> str:
    return " ".join(reason for key, reason in plan.problems if key == "trainer.out")


def test_a_live_run_refuses_a_second_run_and_overwrite_naming_the_holder(live) -> None:
    out, proc = live
    found = holder(out)
    assert found is not None and found.pid == proc.pid and found.host == socket.gethostname()
    second = _problems(plan_run_folder(out, "auto"))
    assert f"pid {proc.pid}" in second and socket.gethostname() in second and "since" in second
    assert "in use by a live run" in second
    overwrite = plan_run_folder(out, "never", overwrite=True)
    assert overwrite.move_aside == [] and "--overwrite would move it aside" in _problems(overwrite)
    with pytest.raises(RunLocked, match=f"pid {proc.pid}"):  # the race after the pre-flight: refused too
        move_aside(out)
    assert out.is_dir() and (out / "metrics.jsonl").is_file()  # not moved under the live run's feet
    with pytest.raises(RunLocked, match=f"pid {proc.pid}"):
        acquire(out)


def test_export_of_or_into_a_live_run_is_refused(live, tmp_path: Path) -> None:
    out, proc = live
    with pytest.raises(ExportError, match=f"pid {proc.pid}"):
        export_checkpoint(out, tmp_path / "export")
    other = tmp_path / "other"
    other.mkdir()
    other_proc = hold(other)
    try:
        with pytest.raises(ExportError, match=f"pid {other_proc.pid}"):
            export_checkpoint(tmp_path / "nothing", other)
    finally:
        other_proc.kill()
        other_proc.wait()


def test_the_lock_of_a_killed_run_is_taken_over_saying_so(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = hold(out)
    os.kill(proc.pid, signal.SIGKILL)  # no chance to clean up: the file stays, the kernel drops the flock
    proc.wait()
    assert (out / LOCK_FILE).is_file() and holder(out) is None
    assert _problems(plan_run_folder(out, "auto")) == ""
    lock = acquire(out)
    try:
        assert lock.took_over is not None and lock.took_over.pid == proc.pid
        note = lock.note()
        assert note is not None and "\n" not in note and f"pid {proc.pid}" in note and "gone" in note
        record = json.loads((out / LOCK_FILE).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        assert acquire(out) is lock  # the driver checks again at start: its own lock
        assert oct(out.stat().st_mode & 0o777) == oct(0o700)
    finally:
        lock.release()


def test_a_fresh_folder_is_locked_without_a_note_and_the_lock_file_is_no_previous_run(tmp_path: Path) -> None:
    out = tmp_path / "new"
    lock = acquire(out)
    try:
        assert lock.took_over is None and lock.note() is None
        checkpoints = ckpt.checkpoints_root(out)
        assert not checkpoints.exists()
        plan = plan_run_folder(out, "auto")  # a folder holding only the lock holds no previous run
        assert plan.problems == [] and plan.resume_from is None
    finally:
        lock.release()
