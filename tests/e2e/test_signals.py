"""``hybridrl train`` stopped from outside, as a scheduler and a user stop it, and what it leaves running.

* SIGTERM (what job schedulers send) is handled like Ctrl-C: the step finishes, a checkpoint is saved, the
  exit status is 143; while it ran, nothing of the run listened beyond the loopback address.
* A second Ctrl-C landing in the shutdown ends without a traceback and leaves no Ray process behind.
* A driver killed with SIGKILL leaves no Ray process (agents, workers) and no Ray session folder behind.

Each test runs the CLI in a process group of its own and kills whatever of it is left when it ends.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hybridrl.run import checkpoint as ckpt
from hybridrl.runtime.watchdog import _psutil

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["trainer.steps=500", "data.prompts_per_step=4", "algorithm.n_samples=4", "trainer.progress=false",
         "trainer.log_samples=0"]
RAY_TEMP = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray"
psutil = _psutil()


class Run:
    """``hybridrl train`` in its own session; ``tree()`` notes its processes, ``cleanup()`` kills what is left."""

    def __init__(self, tmp_path: Path, config: str, *overrides: str) -> None:
        self.out = tmp_path / "run"
        self.log = tmp_path / "train.log"
        self.proc = subprocess.Popen([sys.executable, "-m", "hybridrl.cli", "train", config, f"trainer.out={self.out}",
                                      *QUICK, *overrides], stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     cwd=ROOT, start_new_session=True)
        self.seen: list[Any] = []

    def tree(self) -> list[Any]:
        driver = psutil.Process(self.proc.pid)
        procs = [driver, *driver.children(recursive=True)]
        self.seen += procs
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
        for proc in running(self.seen):
            proc.kill()


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
        time.sleep(0.5)


def exposed_sockets(procs: list[Any]) -> list[str]:
    """Listening sockets of ``procs`` on any address but the loopback one."""
    found = []
    for proc in procs:
        try:
            connections = proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        for c in connections:
            if c.status == psutil.CONN_LISTEN:
                ip = ipaddress.ip_address(c.laddr.ip.split("%")[0])
                ip = ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip
                if not ip.is_loopback:
                    found.append(f"{proc.name()} (pid {proc.pid}) on {c.laddr.ip}:{c.laddr.port}")
    return found


@pytest.fixture
def run_cli(tmp_path: Path):
    runs: list[Run] = []

    def start(config: str, *overrides: str) -> Run:
        runs.append(Run(tmp_path, config, *overrides))
        return runs[-1]

    yield start
    for run in runs:
        run.cleanup()


def test_sigterm_finishes_the_step_saves_and_exits_143_and_the_run_listened_on_loopback_only(run_cli) -> None:
    run = run_cli("examples/quickstart-split.yaml")  # split pools: the weight broadcast's group listens too
    wait_for(lambda: run.steps_logged() >= 1 or run.proc.poll() is not None, 400, "a first step")
    procs = run.tree()
    assert exposed_sockets(procs) == []
    run.proc.send_signal(signal.SIGTERM)
    assert run.proc.wait(timeout=300) == 143, run.output()[-3000:]
    text = run.output()
    step = int(re.search(r"stopped at step (\d+) on SIGTERM", text).group(1))
    latest = ckpt.latest_checkpoint(run.out)
    assert latest == ckpt.checkpoints_root(run.out) / ckpt.step_dir_name(step) and ckpt.damage(latest) is None
    assert [json.loads(line)["step"] for line in (run.out / "metrics.jsonl").read_text().splitlines()] == \
        list(range(1, step + 1))
    assert "Traceback" not in text
    wait_for(lambda: not running(procs), 60, f"the run's processes to end: {running(procs)}")
    assert run.sessions() == []


def test_a_second_ctrl_c_during_the_shutdown_leaves_no_traceback_and_no_ray_process(run_cli) -> None:
    run = run_cli("examples/quickstart.yaml")
    wait_for(lambda: run.steps_logged() >= 1 or run.proc.poll() is not None, 400, "a first step")
    procs = run.tree()
    os.killpg(run.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole foreground group
    wait_for(lambda: "stopped at step" in run.output() or run.proc.poll() is not None, 300, "the stop after the step")
    if run.proc.poll() is None:
        os.killpg(run.proc.pid, signal.SIGINT)  # the second lands while the workers and Ray are being stopped
    assert run.proc.wait(timeout=300) == 130, run.output()[-3000:]
    text = run.output()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    wait_for(lambda: not running(procs), 60, f"the run's processes to end: {running(procs)}")
    assert run.sessions() == []


def test_a_killed_driver_leaves_no_ray_process_and_no_session_folder(run_cli) -> None:
    run = run_cli("examples/quickstart.yaml")
    wait_for(lambda: run.steps_logged() >= 1 or run.proc.poll() is not None, 400, "a first step")
    procs = run.tree()
    assert run.sessions() and len(procs) > 5
    run.proc.kill()
    run.proc.wait(timeout=30)
    wait_for(lambda: not running(procs), 60, f"the run's processes to end: {running(procs)}")  # were ~2 minutes
    wait_for(lambda: not run.sessions(), 30, "the Ray session folder to be removed")
