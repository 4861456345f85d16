"""``python -m hybridrl.runtime.watchdog DRIVER_PID RAY_TEMP_ROOT [TOKEN_DIR]``: stops what a run's local Ray
started once the run's driver is gone, however it went, and removes the run's Ray session folder and token.

Ray's head processes die with a killed driver, but their children (the dashboard and runtime-env agents,
workers) used to stay for minutes, and the session folder for good. The driver starts this process in a
session of its own (a Ctrl-C in the terminal does not reach it) with a pipe on its stdin; it notes the
driver's descendants twice a second, and when the pipe closes (the driver exited, or was killed) it sends
SIGTERM to those still running, SIGKILL to what is left after a grace period, and removes the folder.
Processes are matched by pid and start time, so a reused pid is never signalled.

The driver starts it before ``ray.init``, so a Ctrl-C while Ray starts is covered too: the run's session
folders are those named after the driver's pid (``session_<date>_<pid>``) made since, and a Ray process that
left the driver's tree (an agent whose raylet died first) is still found: by the session folder on its command
line, or by the run's token path in its environment.
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

POLL_S = 0.5
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


def run_sessions(ray_root: Path, driver: int, since: float) -> list[Path]:
    """The session folders of the run: named after the driver's pid, made after ``since`` (an older one of a
    reused pid is left alone)."""
    found = []
    for path in ray_root.glob(f"session_*_{driver}"):
        try:
            if path.is_dir() and not path.is_symlink() and path.stat().st_mtime >= since:
                found.append(path)
        except OSError:
            continue
    return found


def marked(psutil: Any, sessions: list[Path], token: str | None, spare: set[int]) -> dict[int, float]:
    """pid -> start time of every process (but ``spare``) with one of ``sessions`` on its command line or the
    run's token path ``token`` in its environment: Ray's processes of the run, also those no longer below the
    driver."""
    names = [str(s) for s in sessions]
    marker = f"RAY_AUTH_TOKEN_PATH={token}" if token else None
    found = {}
    for proc in psutil.process_iter(["pid", "cmdline", "create_time"]):
        if proc.info["pid"] in spare:
            continue
        cmdline = " ".join(proc.info["cmdline"] or ())
        hit = any(name in cmdline for name in names)
        if not hit and marker is not None:
            try:
                hit = proc.environ().get("RAY_AUTH_TOKEN_PATH") == token
            except (psutil.Error, OSError):
                hit = False
        if hit and proc.info["create_time"] is not None:
            found[proc.info["pid"]] = proc.info["create_time"]
    return found


def main(argv: list[str]) -> int:
    driver, ray_root = int(argv[1]), Path(argv[2])
    token_dir = Path(argv[3]) if len(argv) > 3 else None
    token = str(token_dir / "auth_token") if token_dir is not None else None
    since = time.time() - 2.0
    psutil = _psutil()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the pipe ends this process
    known: dict[int, float] = {}
    while True:
        known.update(descendants(psutil, driver))
        ready, _, _ = select.select([sys.stdin], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            break  # the driver closed the pipe: it is done, or gone
    sessions = run_sessions(ray_root, driver, since)
    known.update(marked(psutil, sessions, token, {os.getpid(), driver}))
    known.pop(driver, None)
    stop(psutil, known)
    for session in sessions:
        remove_session(session)
    if token_dir is not None:
        shutil.rmtree(token_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
