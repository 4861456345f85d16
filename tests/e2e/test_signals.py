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
from typing import Any

from _live_run import psutil, running, wait_for

from hybridrl.run import checkpoint as ckpt


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
