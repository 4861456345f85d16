"""The Python tool's sandbox, tested for what it promises: one test per escape attempt (host files read or
written, processes that outlive the call, a grandchild holding stdout past the deadline, a fork bomb, endless
output, a memory hog, the network), each asserting containment; the refusal where bwrap cannot work and the
warning of ``isolation: none``; the HTTP backend against a SandboxFusion-like server on 127.0.0.1; the tool
runner's own deadline per call."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
import time
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hybridrl.tools.base import Tool, ToolCall, ToolResult
from hybridrl.tools.sandbox import KEY, PythonTool, Sandbox, SandboxLimits, SandboxUnavailable, isolation_warnings
from hybridrl.tools.toolbox import ToolBox

#: what a loaded machine may add to a call's end (starting and reaping processes); the failures these tests guard
#: against stretch a call to the 30 s its code sleeps, or hang
SLACK_S = 8.0
LIMITS = SandboxLimits(timeout_s=2, cpu_s=2, memory_mb=256, file_mb=2, disk_mb=8, processes=16,
                       max_output_chars=2000, output_limit_kb=256)


@pytest.fixture(scope="module")
def box() -> Sandbox:
    try:
        return Sandbox(LIMITS)
    except SandboxUnavailable as exc:  # CI installs bubblewrap; a machine without it cannot test containment
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def roomy_box(box: Sandbox) -> Sandbox:
    """``LIMITS`` with a wall-clock limit well past ``SLACK_S``: a call that should end with its program proves it
    by ending within the slack, not by beating a 2 s limit that a loaded machine's process start-up can reach."""
    return Sandbox(dataclasses.replace(LIMITS, timeout_s=int(3 * SLACK_S)))


@pytest.fixture
def run_folder(tmp_path: Path) -> Path:
    """A stand-in for a run's folder: a secret and a checkpoint shard the code must neither read nor touch."""
    folder = tmp_path / "run"
    (folder / "checkpoints" / "step_1").mkdir(parents=True)
    (folder / "secret.txt").write_text("TOKEN-1234")
    (folder / "checkpoints" / "step_1" / "shard.bin").write_bytes(b"weights" * 100)
    (folder / "checkpoints" / "latest").symlink_to("step_1")
    for path in [folder, *folder.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o777 if path.is_dir() else 0o666)  # even world-writable: the namespace must hide it
    return folder


def host_processes_with(token: str) -> list[int]:
    """Host pids whose command line holds ``token``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def timed(box: Sandbox, code: str) -> tuple[ToolResult, float]:
    start = time.monotonic()
    result = box.run(code)
    return result, time.monotonic() - start


# --- files --------------------------------------------------------------------------------------------------
def test_host_files_are_not_readable(roomy_box, run_folder):
    code = f"""
import os
for path in ('/etc/passwd', '/etc/shadow', '/etc/hostname', {str(run_folder / 'secret.txt')!r}, '/root/.bashrc'):
    try:
        print(path, repr(open(path).read()))
    except OSError as exc:
        print(path, type(exc).__name__)
print(sorted(os.listdir('/')))
print(sorted(os.listdir('/etc')))
"""
    result = roomy_box.run(code)
    assert not result.error, result.content
    assert "TOKEN-1234" not in result.content and "root:" not in result.content
    lines = result.content.splitlines()
    assert lines[0] == "/etc/passwd 'sandbox:x:65534:65534:sandbox:/sandbox:/usr/sbin/nologin\\n'"
    assert all(line.endswith("FileNotFoundError") for line in lines[1:5]), lines
    top = set(eval(lines[5]))
    assert not top & {"home", "work", "tmp", "mnt", "opt", "srv", "var"} and "sandbox" in top, top
    assert {"passwd", "group"} <= set(eval(lines[6])) <= {"passwd", "group", "ld.so.cache"}


def test_writes_outside_the_tmpfs_fail(roomy_box, run_folder):
    shard = run_folder / "checkpoints" / "step_1" / "shard.bin"
    before = shard.read_bytes()
    targets = [str(shard), str(run_folder / "new.txt"), "/usr/x", "/x", "/etc/passwd", "/dev/shm/x", "/dev/x",
               "/proc/x"]
    code = f"""
import os
for path in {targets!r}:
    try:
        open(path, 'w').write('pwned')
        print('WROTE', path)
    except OSError as exc:
        print('refused', path, type(exc).__name__)
open('here.txt', 'w').write('ok')
print(open('here.txt').read(), os.getcwd())
"""
    result = roomy_box.run(code)
    assert not result.error, result.content
    assert "WROTE" not in result.content, result.content
    assert result.content.rstrip().endswith("ok /sandbox")
    assert shard.read_bytes() == before and (run_folder / "checkpoints" / "latest").is_symlink()
    assert not (run_folder / "new.txt").exists() and not Path("/x").exists() and not Path("/usr/x").exists()


def test_the_writable_folder_is_small_and_fresh(roomy_box):
    fill = ("import os\nn = 0\ntry:\n    while True:\n        open(f'f{n}', 'wb').write(b'x' * 2**20)\n"
            "        n += 1\nexcept OSError as exc:\n    print(n, exc.strerror)")
    result = roomy_box.run(fill)
    n, why = result.content.split(" ", 1)
    assert int(n) <= LIMITS.disk_mb and "No space left" in why, result.content
    assert roomy_box.run("import os; print(os.listdir('.'))").content.strip() == "[]"  # nothing kept between calls


# --- processes ----------------------------------------------------------------------------------------------
def test_subprocesses_and_daemons_die_with_the_call(roomy_box):
    token = f"{time.time_ns() % 10**6}.0417"
    code = f"""
import os, subprocess
subprocess.Popen(['sleep', '{token}'], start_new_session=True, stdout=subprocess.DEVNULL)
if os.fork() == 0:  # a classic double-fork daemon
    os.setsid()
    if os.fork() == 0:
        os.execv('/bin/sleep', ['sleep', '{token}'])
    os._exit(0)
print('started')
"""
    result, seconds = timed(roomy_box, code)
    assert result.content.strip() == "started" and not result.error and seconds < SLACK_S, (result, seconds)
    time.sleep(0.2)
    assert host_processes_with(token) == []


def test_a_grandchild_holding_stdout_cannot_stretch_the_deadline(box, roomy_box):
    token = f"{time.time_ns() % 10**6}.0833"
    held = f"import subprocess, time\nsubprocess.Popen(['sleep', '{token}'], start_new_session=True)\ntime.sleep(30)"
    result, seconds = timed(box, held)
    assert result.timed_out and "ran longer than 2 s" in result.content
    assert seconds < LIMITS.timeout_s + SLACK_S, seconds
    # the program exits at once but leaves a process holding the pipe: the call ends with the program
    left, seconds = timed(roomy_box, f"import subprocess\nsubprocess.Popen(['sleep', '{token}'])\nprint('bye')")
    assert left.content.strip() == "bye" and not left.error and seconds < SLACK_S, (left, seconds)
    time.sleep(0.2)
    assert host_processes_with(token) == []


def test_processes_are_limited(roomy_box):
    if not roomy_box.backend.processes_limited:
        pytest.skip(f"no process limit on this machine: {roomy_box.describe()}")
    token = f"{time.time_ns() % 10**6}.0311"
    count = f"""
import os
n = 0
try:
    while True:
        if os.fork() == 0:
            os.execv('/bin/sleep', ['sleep', '{token}'])
        n += 1
except OSError as exc:
    print(n, exc.strerror)
"""
    result, _ = timed(roomy_box, count)
    n, why = result.content.split(" ", 1)
    assert int(n) < LIMITS.processes and "Resource temporarily unavailable" in why, result.content
    time.sleep(0.2)
    assert host_processes_with(token) == []


def test_a_fork_bomb_is_contained(box):
    bomb, seconds = timed(box, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert bomb.timed_out and seconds < LIMITS.timeout_s + SLACK_S, seconds
    assert box.run("print('after')").content == "after\n"  # nothing of the bomb is left to starve the next call


# --- output, memory, network -----------------------------------------------------------------------------
def test_endless_output_is_capped_and_memory_bounded(box):
    tracemalloc.start()
    try:
        result, seconds = timed(box, "while True:\n    print('x' * 1000)")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.error and "printed more than 256 KB" in result.content
    assert len(result.content) < LIMITS.max_output_chars + 200 and "bytes left out" in result.content
    assert seconds < LIMITS.timeout_s and peak < 2 * 2**20, (seconds, peak)


def test_a_memory_hog_is_contained(roomy_box):
    """The memory limit, not the clock, ends both: filling 256 MB in 10 MB steps took past 2 s under CI's load."""
    at_once = roomy_box.run("x = bytearray(2**30)")
    assert at_once.error and "MemoryError" in at_once.content
    growing = roomy_box.run("chunks = []\nwhile True:\n    chunks.append(bytearray(10 * 2**20))")
    assert growing.error and "MemoryError" in growing.content


def test_the_network_is_unreachable(roomy_box):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = f"""
import socket
for host, port in (('127.0.0.1', {port}), ('1.1.1.1', 80)):
    try:
        socket.create_connection((host, port), timeout=1)
        print('CONNECTED', host)
    except OSError as exc:
        print(host, type(exc).__name__)
"""
    try:
        result = roomy_box.run(code)
    finally:
        server.close()
    assert not result.error and "CONNECTED" not in result.content, result.content
    assert len(result.content.strip().splitlines()) == 2


def test_runs_as_an_unprivileged_user(roomy_box):
    result = roomy_box.run("import os; print(os.getuid(), os.getgid(), "
                     "open('/proc/self/status').read().count('0000000000000000'))")
    uid, gid, zero_caps = result.content.split()
    assert (uid, gid) == ("65534", "65534") and int(zero_caps) >= 3  # inheritable, permitted, effective: none


# --- where there is no sandbox ------------------------------------------------------------------------------
def test_refuses_without_a_working_bwrap(tmp_path):
    with pytest.raises(SandboxUnavailable, match=f"bwrap not found.*{KEY}: none"):
        PythonTool(bwrap=str(tmp_path / "missing" / "bwrap"))
    broken = tmp_path / "bwrap"
    broken.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    broken.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match="trial run failed.*No permissions"):
        PythonTool(bwrap=str(broken))


def test_refusal_is_a_preflight_error_naming_the_key(tmp_path):
    from hybridrl.environments.checks import tool_option_problems
    from hybridrl.plugins.discovery import get_registry

    problems = tool_option_problems(["python"], {"python": {"bwrap": str(tmp_path / "no-bwrap")}}, get_registry())
    assert [key for key, _ in problems] == ["environment.tool_options.python"]
    assert KEY in problems[0][1] and "bwrap not found" in problems[0][1]


def test_isolation_none_runs_unconfined_and_is_a_warning(tmp_path):
    tool = PythonTool(isolation="none", bwrap=str(tmp_path / "missing"), timeout_s=2)
    assert tool({"code": "print(6 * 7)"}) == ToolResult("42\n")
    assert "none" in tool.sandbox.describe()
    warnings = isolation_warnings(["calculator", "python"], {"python": {"isolation": "none"}})
    assert len(warnings) == 1 and warnings[0].startswith(f"{KEY}: none") and "unconfined" in warnings[0]
    assert isolation_warnings(["python"], {}) == [] and isolation_warnings(["calculator"], {}) == []
    with pytest.raises(ValueError, match="isolation must be one of bwrap, http, none"):
        PythonTool(isolation="docker")
    # even unconfined, the deadline holds against a grandchild that keeps stdout open
    start = time.monotonic()
    held = tool({"code": "import subprocess, time\nsubprocess.Popen(['sleep', '3'])\ntime.sleep(30)"})
    assert held.timed_out and time.monotonic() - start < 3.0


# --- the HTTP backend -------------------------------------------------------------------------------------
class FusionLike(BaseHTTPRequestHandler):
    """``POST /run_code`` as SandboxFusion answers it, for a few programs the test knows."""

    requests: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 - the http.server hook's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FusionLike.requests.append(body)
        code = body["code"]
        if code == "slow":
            time.sleep(3)
        if code == "huge":
            answer = {"status": "Success", "run_result": {"stdout": "x" * 400_000, "return_code": 0}}
        elif code == "sleep":
            answer = {"status": "Failed", "run_result": {"status": "TimeLimitExceeded", "stdout": "", "stderr": ""}}
        elif code == "broken":
            answer = {"status": "SandboxError", "message": "no runner for python"}
        elif code == "raise":
            answer = {"status": "Failed", "run_result": {"status": "Finished", "return_code": 1, "stdout": "",
                                                         "stderr": "ValueError: boom\n"}}
        else:
            answer = {"status": "Success", "compile_result": None,
                      "run_result": {"status": "Finished", "return_code": 0, "stdout": f"ran {code}\n", "stderr": ""}}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        try:
            self.wfile.write(data)
        except BrokenPipeError:  # the client gave up waiting (the slow case)
            pass

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def fusion(monkeypatch):
    for name in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY"):
        monkeypatch.delenv(name, raising=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), FusionLike)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    FusionLike.requests = []
    yield f"http://127.0.0.1:{server.server_address[1]}/run_code"
    server.shutdown()
    server.server_close()


def test_http_backend_speaks_run_code(fusion):
    tool = PythonTool(isolation="http", url=fusion, timeout_s=1, memory_mb=128, output_limit_kb=64)
    assert tool({"code": "print(1)"}) == ToolResult("ran print(1)\n")
    sent = FusionLike.requests[0]
    assert sent["language"] == "python" and sent["run_timeout"] == 1 and sent["memory_limit_MB"] == 128
    timed_out = tool({"code": "sleep"})
    assert timed_out.timed_out and "ran longer than 1 s" in timed_out.content
    failed = tool({"code": "raise"})
    assert failed.error and not failed.timed_out and "ValueError: boom" in failed.content
    assert "no runner for python" in tool({"code": "broken"}).content
    assert "larger than 64 KB" in tool({"code": "huge"}).content


def test_http_backend_bounds_the_wait_and_checks_its_url(fusion):
    from hybridrl.tools.sandbox.http import HttpBackend

    slow = HttpBackend(SandboxLimits(timeout_s=0.5), fusion, grace_s=0.5)
    start = time.monotonic()
    result = slow.run("slow")
    assert result.timed_out and time.monotonic() - start < 2.5
    gone = socket.socket()
    gone.bind(("127.0.0.1", 0))
    port = gone.getsockname()[1]
    gone.close()
    unreachable = PythonTool(isolation="http", url=f"http://127.0.0.1:{port}/run_code")({"code": "1"})
    assert unreachable.error and "unreachable" in unreachable.content
    with pytest.raises(ValueError, match="needs a url"):
        PythonTool(isolation="http")
    with pytest.raises(ValueError, match="http\\(s\\) address"):
        PythonTool(isolation="http", url="file:///etc/passwd")
    with pytest.raises(ValueError, match="only read with isolation 'http'"):
        PythonTool(isolation="none", url=fusion)


# --- the tool runner's deadline ---------------------------------------------------------------------------
class Hangs(Tool):
    name = "hangs"

    def __init__(self) -> None:
        self.release = threading.Event()

    def run(self, arguments):
        self.release.wait(30)
        return ToolResult("late")


def test_a_hanging_tool_fails_its_call_not_the_step():
    from hybridrl.environments.base import EnvironmentContext, EpisodeLimits, EpisodeRow, ModelTurn
    from hybridrl.environments.tool_env import ToolEnvironment
    from hybridrl.tools.parsers import hermes

    hangs = Hangs()
    tools = ToolBox({"hangs": hangs}, deadline_s=0.3)
    env = ToolEnvironment(EnvironmentContext(None, None, EpisodeLimits(3, 100), tools, hermes, 0),
                          render_prompt=False)
    env.reset(EpisodeRow(0, "p", [1, 2]))
    turn = ModelTurn([1], '<tool_call>{"name": "hangs", "arguments": {}}</tool_call>', True, 0, False)
    start = time.monotonic()
    result = env.step(turn)
    assert time.monotonic() - start < 1.5
    assert result.metrics["tool_timeouts"] == 1.0 and result.metrics["tool_errors"] == 1.0
    assert "did not answer within 0.3 s" in result.observation[0]["content"]
    hangs.release.set()
    # a tool's own shorter deadline wins; the python tool's is its timeout plus start-up
    assert ToolBox({}, deadline_s=60).deadline_for(PythonTool(isolation="none", timeout_s=2)) == 12.0
    with pytest.raises(ValueError, match="tool_deadline_s must be > 0"):
        ToolBox({}, deadline_s=0)
    assert tools.call(ToolCall("nope")).error


def test_plan_prints_the_unconfined_tool_as_a_warning(capsys):
    from hybridrl.cli import main

    config = Path(__file__).resolve().parents[2] / "examples" / "tool-calc.yaml"
    assert main(["plan", str(config), "--cluster", "1x2", "--device", "cpu", "environment.tools=[calculator,python]",
                 "environment.tool_options={python: {isolation: none}}"]) == 0
    out = capsys.readouterr().out
    assert f"WARNING: {KEY}: none" in out and out.index("WARNING") > out.index("cluster:")
