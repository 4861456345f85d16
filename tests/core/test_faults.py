"""Faults without workers: SIGTERM handled like Ctrl-C (and a second signal stopping at once), signals held
while the run shuts down, a disk fault told apart from other errors, a cluster address that does not answer
found with one short try."""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridrl.run.faults import (
    DiskError,
    Terminated,
    disk_problem,
    explain_failure,
    signals_deferred,
    signals_raise,
    stop_on_interrupt,
)

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.yaml"


@pytest.mark.parametrize("signum, second", [(signal.SIGTERM, Terminated), (signal.SIGINT, KeyboardInterrupt)])
def test_the_first_signal_asks_for_a_stop_and_the_second_stops_at_once(signum: int, second: type) -> None:
    with stop_on_interrupt() as stop:
        os.kill(os.getpid(), signum)
        time.sleep(0.01)  # the handler runs between bytecodes
        assert stop.requested and stop.signum == signum
        with pytest.raises(second):
            os.kill(os.getpid(), signum)
            time.sleep(1)
    handler = signal.getsignal(signal.SIGTERM)
    assert handler in (signal.SIG_DFL, signal.SIG_IGN) or callable(handler)


def test_sigterm_outside_the_loop_unwinds_and_signals_are_held_during_shutdown() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with signals_raise():
        with pytest.raises(Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        with signals_deferred(note=lambda s: None) as held:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)  # neither raises: the shutdown goes on
        assert held == [signal.SIGINT, signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_disk_fault_is_told_from_other_errors(tmp_path: Path) -> None:
    full, read_only = OSError(errno.ENOSPC, "No space left on device"), OSError(errno.EROFS, "Read-only file system")
    assert disk_problem(tmp_path, full).startswith("no space left on device")
    assert disk_problem(tmp_path, read_only) == "not writable (read-only file system)"
    remote = RuntimeError("ray::RoleWorker.call() ... OSError: [Errno 28] No space left on device: '/x/__0_0.distcp'")
    assert disk_problem(tmp_path, remote).startswith("no space left on device")
    assert disk_problem(tmp_path, ValueError("shapes do not match")) is None  # not the disk's doing
    assert disk_problem(tmp_path, RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos")) is None
    failure = explain_failure(OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "metrics.jsonl")),
                              {}, "cpu", "during step 3", tmp_path, "The last checkpoint, X, is intact.")
    assert isinstance(failure, DiskError)
    assert f"cannot write {tmp_path / 'metrics.jsonl'} during step 3: no space left on device" in str(failure)
    assert explain_failure(ValueError("a bug"), {}, "cpu", "during step 3", tmp_path, "") is None


def test_a_cluster_address_that_does_not_answer_is_reported_without_a_traceback() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "hybridrl.cli", "plan", str(QUICKSTART),
                           f"cluster.address=127.0.0.1:{port}"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"cluster.address: the address '127.0.0.1:{port}' does not answer (connection refused)" in proc.stderr
    assert "Traceback" not in proc.stderr  # Ray's own client retried for about 25 s, then raised


def test_a_worker_that_died_while_its_engine_started_is_explained_as_such():
    """Ray reports a worker the kernel killed (host memory exhausted) as ``ActorDiedError`` with no Python error
    of the engine's: the one line names the role and backend and says what most likely happened and what to do."""
    from ray.exceptions import ActorDiedError

    from hybridrl.runtime.launch import engine_start_error

    died = str(engine_start_error("ref", "fsdp", ActorDiedError()))
    assert died.startswith("roles.ref: the 'fsdp' engine did not start: ActorDiedError")
    assert "host runs out of memory" in died and "cluster.host_memory_gb" in died
    refused = str(engine_start_error("actor", "fsdp", ValueError("roles.actor.options.head: 'tail' is not a head")))
    assert "host" not in refused and refused.endswith("'tail' is not a head")
