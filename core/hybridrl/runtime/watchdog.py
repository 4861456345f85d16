"""``python -m hybridrl.runtime.watchdog DRIVER_PID SESSION_DIR``: stops what a run's local Ray started once
the run's driver is gone, however it went, and removes the Ray session folder of the run.

Ray's head processes die with a killed driver, but their children (the dashboard and runtime-env agents,
workers) used to stay for minutes, and the session folder for good. The driver starts this process in a
session of its own (a Ctrl-C in the terminal does not reach it) with a pipe on its stdin; it notes the
driver's descendants every second, and when the pipe closes (the driver exited, or was killed) it sends
SIGTERM to those still running, SIGKILL to what is left after a grace period, and removes the folder.
Processes are matched by pid and start time, so a reused pid is never signalled.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

POLL_S = 1.0
GRACE_S = 3.0


def _psutil() -> Any:
    try:
        import psutil
    except ImportError:  # Ray vendors it; import it from there without importing Ray
        import importlib.util

        spec = importlib.util.find_spec("ray")
        assert spec is not None and spec.submodule_search_locations, "ray is a core dependency"
        sys.path.append(os.path.join(list(spec.submodule_search_locations)[0], "thirdparty_files"))
        import psutil
    return psutil


def descendants(psutil: Any, pid: int) -> dict[int, float]:
    """pid -> start time of every living descendant of ``pid`` (this process left out)."""
    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    found = {}
    for child in children:
        try:
            if child.pid != os.getpid():
                found[child.pid] = child.create_time()
        except psutil.Error:
            continue
    return found


def stop(psutil: Any, known: dict[int, float], grace_s: float = GRACE_S) -> list[int]:
    """SIGTERM every process of ``known`` still running (same pid, same start time), SIGKILL after
    ``grace_s`` what did not exit. Returns the pids signalled."""
    alive = []
    for pid, started in known.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.Error:
            continue
    terminate_then_kill(psutil, alive, grace_s)
    return [p.pid for p in alive]


def terminate_then_kill(psutil: Any, procs: list[Any], grace_s: float) -> None:
    """SIGTERM ``procs`` (psutil processes), SIGKILL those still running after ``grace_s``; one that is gone
    already is no error."""
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(procs, timeout=grace_s)
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(left, timeout=grace_s)


def remove_session(session: Path) -> None:
    """The run's own session folder, and Ray's ``session_latest`` link when it points at it."""
    latest = session.parent / "session_latest"
    try:
        if latest.is_symlink() and Path(os.readlink(latest)).name == session.name:
            latest.unlink()
    except OSError:
        pass
    for _ in range(3):  # a process that was just stopped may still have been writing a log
        shutil.rmtree(session, ignore_errors=True)
        if not session.exists():
            return
        time.sleep(0.5)


def main(argv: list[str]) -> int:
    driver, session = int(argv[1]), Path(argv[2])
    psutil = _psutil()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe ends this process
    known: dict[int, float] = {}
    while True:
        known.update(descendants(psutil, driver))
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # the driver closed the pipe: it is done, or gone
    stop(psutil, known)
    remove_session(session)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
