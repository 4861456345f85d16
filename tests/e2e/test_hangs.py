"""Hangs have deadlines, and a run's local Ray opens nothing and leaves nothing behind.

* A worker stopped with SIGSTOP (as a deadlocked or hung one looks to the driver) is named within
  ``trainer.step_timeout_s``: the run ends with one sentence naming its role and rank and the intact
  checkpoint, and the stopped process is torn down.
* Ctrl-C while the engines start leaves no Ray process and no Ray session folder behind.
* Ray's token is the run's own (mode 0600) and gone after the run: nothing in ``~/.ray/auth_token``.
* The local Ray serves no HTTP but the runtime-env agent's, which the raylet needs and which wants the token.

The runs are ``hybridrl train`` subprocesses with a HOME of their own, in a session of their own; what is left
of them is killed when a test ends.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import time
from pathlib import Path
from typing import Any

from _live_run import catches, psutil, running, wait_for

from hybridrl.run import checkpoint as ckpt

STEP_TIMEOUT_S = 45  # long enough for a loaded machine's engine start-up, which the number also bounds


def of_sessions(sessions: list[Path]) -> list[str]:
    """Processes with one of ``sessions`` on their command line (Ray's head processes and agents)."""
    names = [str(s) for s in sessions]
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or ())
        if any(name in cmdline for name in names):
            found.append(f"{proc.info['pid']}: {cmdline[:120]}")
    return found


def named(procs: list[Any], prefix: str) -> list[Any]:
    found = []
    for proc in procs:
        try:
            if " ".join(proc.cmdline()).startswith(prefix):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def test_a_stopped_worker_is_named_within_the_step_timeout_and_torn_down(run_cli) -> None:
    run = run_cli("examples/quickstart.yaml", f"trainer.step_timeout_s={STEP_TIMEOUT_S}", "trainer.save_every=1",
                  own_home=True)
    wait_for(lambda: ckpt.latest_checkpoint(run.out) or run.proc.poll() is not None, 400, "a first checkpoint")
    assert run.proc.poll() is None, run.output()[-3000:]
    workers = named(run.tree(), "ray::RoleWorker")
    assert len(workers) == 1, [p.cmdline() for p in run.tree()]
    assert not (run.home / ".ray" / "auth_token").exists()  # not while it runs either
    os.kill(workers[0].pid, signal.SIGSTOP)
    stopped = time.monotonic()
    wait_for(lambda: "did not answer within" in run.output() or run.proc.poll() is not None,
             STEP_TIMEOUT_S + 30, "the sentence about the stopped worker")
    named_after = time.monotonic() - stopped
    assert run.proc.wait(timeout=120) == 1, run.output()[-3000:]
    text = run.output()
    line = next(line for line in text.splitlines() if "did not answer within" in line)
    assert re.search(r"hybridrl: role actor\+ref\+rollout \(pool 'main'\), rank 0 of 1 \([a-z_.]+\) did not answer "
                     rf"within {STEP_TIMEOUT_S}s \(trainer.step_timeout_s={STEP_TIMEOUT_S}(\.0)?\) during step \d+: "
                     "stopped, deadlocked or stuck in a collective", line), line
    assert re.search(r"The last checkpoint, \S+step_\d+, is intact: rerun the same command to resume from it", line)
    assert "Traceback" not in text
    assert named_after <= STEP_TIMEOUT_S + 15, f"{named_after:.1f}s"  # a dispatch started just before counts
    wait_for(lambda: not running(workers), 60, "the stopped worker to be torn down")
    wait_for(lambda: not running(list(run.seen.values())), 60, "the run's processes to end")
    assert run.sessions() == []
    assert not (run.home / ".ray" / "auth_token").exists()


def test_ctrl_c_while_the_engines_start_leaves_no_ray_process_and_no_session_folder(run_cli) -> None:
    # steps past any test's length: on a loaded machine the agents may be seen only once training runs, and the
    # Ctrl-C must still find the run alive (then it lands in a step, where the same promises hold)
    run = run_cli("examples/quickstart.yaml", "trainer.steps=100000", own_home=True)
    wait_for(lambda: "starting workers" in run.output() or run.proc.poll() is not None, 300, "start-up")
    wait_for(lambda: named(run.tree(), "ray::") or run.proc.poll() is not None, 300, "Ray's agents")
    sessions = run.sessions()
    run.tree()
    assert run.proc.poll() is not None or catches(run.proc.pid, signal.SIGINT), "the driver does not catch SIGINT"
    os.killpg(run.proc.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole foreground group
    try:
        run.proc.wait(timeout=120)
    finally:
        run.tree()
    assert run.proc.returncode == 130, run.output()[-3000:]
    assert "Traceback" not in run.output(), run.output()[-3000:]
    wait_for(lambda: not running(list(run.seen.values())), 30,
             f"the run's processes to end: {running(list(run.seen.values()))}")
    assert sessions and of_sessions(sessions) == []  # agents that left the driver's tree included
    assert run.sessions() == []
    assert not (run.home / ".ray" / "auth_token").exists()


def test_the_local_ray_serves_no_http_but_the_runtime_env_agent_s_which_wants_the_token(ray_local) -> None:
    import ray

    assert ray.get(ray.remote(lambda: 1).remote()) == 1  # the cluster works without its HTTP servers
    driver = psutil.Process()
    names = []
    http = {}
    for proc in driver.children(recursive=True):
        try:
            name, connections = " ".join(proc.cmdline())[:60], proc.net_connections(kind="inet")
        except psutil.Error:
            continue
        names.append(name)
        for c in connections:
            if c.status == psutil.CONN_LISTEN:
                answer = http_answer(c.laddr.ip, c.laddr.port)
                if answer.startswith("HTTP/"):
                    http[f"{name} on {c.laddr.port}"] = answer
    assert not any("dashboard/dashboard.py" in n or "monitor.py" in n for n in names), names
    assert all(where.startswith("ray::RuntimeEnvAgent") for where in http), http
    assert all(" 401 " in answer for answer in http.values()), http
    token = Path(os.environ["RAY_AUTH_TOKEN_PATH"])  # the run's own token, readable by its user only
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    assert not str(token).startswith(str(Path.home() / ".ray"))


def http_answer(host: str, port: int) -> str:
    try:
        with socket.create_connection((host.removeprefix("::ffff:"), port), timeout=3) as s:
            s.settimeout(3)
            s.sendall(b"GET / HTTP/1.0\r\nHost: localhost\r\n\r\n")
            return s.recv(64).decode(errors="replace")
    except OSError:
        return ""
