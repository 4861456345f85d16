"""``hybridrl train`` as a live subprocess, for the tests that stop it from outside (signals, hangs): its own
session (process group), optionally its own HOME, its process tree noted as it runs, and whatever is left of
it killed by ``cleanup()``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridrl.runtime.watchdog import _psutil

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["trainer.steps=500", "data.prompts_per_step=4", "algorithm.n_samples=4", "trainer.progress=false",
         "trainer.log_samples=0"]
RAY_TEMP = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray"
psutil = _psutil()


def _as_from_a_terminal() -> None:
    """In the child before exec: SIGINT and SIGTERM as a terminal's foreground job gets them (default, unblocked),
    whatever this test process inherited (an ignored SIGINT survives exec, and Python then installs no handler)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` that is neither ignored nor blocked (/proc status)."""
    masks = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("SigBlk", "SigIgn", "SigCgt"):
            masks[key] = int(value.strip(), 16)
    bit = 1 << (signum - 1)
    return bool(masks["SigCgt"] & bit) and not masks["SigIgn"] & bit and not masks["SigBlk"] & bit


class LiveRun:
    """``hybridrl train CONFIG`` with the quick overrides; ``own_home`` gives it a HOME of its own and no Ray
    token settings from this environment (what a user's fresh shell has)."""

    def __init__(self, tmp_path: Path, config: str, *overrides: str, own_home: bool = False) -> None:
        self.out = tmp_path / "run"
        self.log = tmp_path / "train.log"
        env = dict(os.environ)
        if own_home:
            self.home = tmp_path / "home"
            self.home.mkdir()
            env["HOME"] = str(self.home)
            for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
                env.pop(key, None)
        self.proc = subprocess.Popen([sys.executable, "-m", "hybridrl.cli", "train", config, f"trainer.out={self.out}",
                                      *QUICK, *overrides], stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     cwd=ROOT, env=env, start_new_session=True, preexec_fn=_as_from_a_terminal)
        self.seen: dict[int, Any] = {}

    def tree(self) -> list[Any]:
        """The driver and its descendants now (each noted, so that ``cleanup`` finds them later)."""
        try:
            driver = psutil.Process(self.proc.pid)
            procs = [driver, *driver.children(recursive=True)]
        except psutil.Error:
            return []
        self.seen.update({p.pid: p for p in procs})
        return procs

    def output(self) -> str:
        return self.log.read_text()

    def steps_logged(self) -> int:
        path = self.out / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.is_file() else 0

    def sessions(self) -> list[Path]:
        return sorted(RAY_TEMP.glob(f"session_*_{self.proc.pid}"))  # Ray names a session after its driver's pid

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        for proc in running(list(self.seen.values())):
            try:
                proc.kill()
            except psutil.Error:
                pass


def running(procs: list[Any]) -> list[Any]:
    alive = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc)
        except psutil.Error:
            continue
    return alive


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f}s: {what}")
        time.sleep(0.2)
