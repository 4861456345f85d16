"""The two backends that run the code on this machine: ``BwrapBackend`` (namespaces, the default) and
``UnconfinedBackend`` (``isolation: none``: the limits only, no namespaces; for a machine without bwrap, by the
user's explicit choice).

Both start ``python -I`` (isolated mode: no user site, no ``PYTHON*`` variables) with an empty environment and a
small bootstrap that sets the rlimits, reads the snippet from stdin (an anonymous memory file, so writing it
never blocks), points stdin at ``/dev/null`` and runs it (no ``preexec_fn``, unsafe in a threaded caller).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from functools import lru_cache

import hybridrl.tools.sandbox.bwrap as bw
from hybridrl.tools.base import ToolResult
from hybridrl.tools.sandbox.limits import SandboxLimits
from hybridrl.tools.sandbox.process import Outcome, run_child

log = logging.getLogger(__name__)

# argv: cpu seconds, address-space bytes, file-size bytes, open files, processes (0: not set).
_BOOTSTRAP = r"""
import os, resource, sys
cpu, mem, fsize, nofile, nproc = (int(a) for a in sys.argv[1:6])
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
                     (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_NPROC, nproc), (resource.RLIMIT_CORE, 0)):
    if value > 0 or limit == resource.RLIMIT_CORE:
        resource.setrlimit(limit, (value, value))
del sys.argv[1:6]
source = sys.stdin.buffer.read().decode("utf-8", "replace")
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0)
os.close(null)
sys.stdin = open(0, closefd=False)
del os, resource, cpu, mem, fsize, nofile, nproc, null
try:
    exec(compile(source, "<tool>", "exec"), {"__name__": "__main__"})
except SystemExit:
    raise
except BaseException as exc:  # the traceback without this bootstrap's own frame
    import traceback
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.exit(1)
"""


def code_fd(code: str) -> int:
    """An anonymous memory file holding ``code``, positioned at its start (the child's stdin)."""
    fd = os.memfd_create("hybridrl-tool-code", os.MFD_CLOEXEC)
    data = code.encode("utf-8", "replace")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def python_argv(limits: SandboxLimits, nproc: int) -> list[str]:
    return [sys.executable, "-I", "-c", _BOOTSTRAP, str(int(limits.cpu_s)), str(limits.memory_mb * 2**20),
            str(limits.file_mb * 2**20), str(limits.open_files), str(nproc)]


def to_result(outcome: Outcome, limits: SandboxLimits, signal_offset: int) -> ToolResult:
    """The model's view of an outcome. ``signal_offset``: 0 when a signal shows as a negative return code (a
    direct child), 128 when as 128 + the signal (bwrap reports its child's that way)."""
    text = outcome.output
    prefix = text + "\n" if text else ""
    if outcome.timed_out:
        return ToolResult.failure(prefix + f"timeout: the code ran longer than {limits.timeout_s:g} s", timed_out=True)
    if outcome.output_capped:
        return ToolResult.failure(prefix + f"stopped: the code printed more than {limits.output_limit_kb} KB")
    rc = outcome.returncode if outcome.returncode is not None else -signal.SIGKILL
    sig = -rc if rc < 0 else (rc - signal_offset if signal_offset and rc > signal_offset else 0)
    if sig in (signal.SIGXCPU, signal.SIGKILL):
        return ToolResult.failure(prefix + f"timeout: the CPU-time limit of {limits.cpu_s} s was reached",
                                  timed_out=True)
    if rc != 0:
        return ToolResult.failure(text or f"exited with status {rc}")
    return ToolResult(text)


class UnconfinedBackend:
    """``isolation: none``: the rlimits, the deadline and the bounded output, in a fresh host folder; the code
    runs as this user and sees this machine (files, network, processes). Never the default."""

    name = "none"

    def __init__(self, limits: SandboxLimits) -> None:
        self.limits = limits

    def describe(self) -> str:
        return "none (rlimits only: the code can read and write this user's files and reach the network)"

    def run(self, code: str) -> ToolResult:
        lim = self.limits
        workdir = tempfile.mkdtemp(prefix="hybridrl-sandbox-")
        stdin = code_fd(code)
        try:
            outcome = run_child(python_argv(lim, 0), stdin, lim.timeout_s, lim.max_output_chars,
                                lim.output_limit_kb * 1024, {}, workdir)
        finally:
            os.close(stdin)
            shutil.rmtree(workdir, ignore_errors=True)
        return to_result(outcome, lim, 0)


class BwrapBackend:
    """``isolation: bwrap``: each call in fresh namespaces (``hybridrl.tools.sandbox.bwrap``). Raises
    ``SandboxUnavailable`` when bwrap is missing or fails a trial run here."""

    name = "bwrap"

    def __init__(self, limits: SandboxLimits, bwrap: str | None = None, network: bool = False) -> None:
        from hybridrl.tools.sandbox.limits import SandboxUnavailable

        self.limits = limits
        self.network = network
        path = bw.resolve_bwrap(bwrap)
        if path is None:
            raise SandboxUnavailable(f"bwrap not found ({bwrap or bw.DEFAULT_BWRAP}: install the bubblewrap package)")
        self.bwrap = path
        problem = _probe(path, network)
        if problem is not None:
            raise SandboxUnavailable(f"bwrap at {path} does not work here: {problem}")
        self.cgroup_parent, self.user = _process_limit(path, network)
        self.processes_limited = os.geteuid() != 0 or self.cgroup_parent is not None or self.user is not None

    def describe(self) -> str:
        how = (", pids cgroup" if self.cgroup_parent else f", started as uid {self.user}" if self.user is not None
               else "" if os.geteuid() != 0 else ", processes not limited (root without a pids cgroup)")
        return f"bwrap ({self.bwrap}{', network shared' if self.network else ''}{how})"

    def run(self, code: str) -> ToolResult:
        outcome = run_in_bwrap(self.bwrap, code, self.limits, self.network, self.cgroup_parent, self.user)
        return to_result(outcome, self.limits, 128)


def run_in_bwrap(bwrap: str, code: str, lim: SandboxLimits, network: bool, cgroup_parent: str | None = None,
                 user: int | None = None) -> Outcome:
    """One call in fresh namespaces; with ``cgroup_parent``, in a pids cgroup of its own; with ``user``, bwrap
    started as that uid (so that ``RLIMIT_NPROC`` binds)."""
    passwd, group, stdin = bw.data_fd(bw.PASSWD), bw.data_fd(bw.GROUP), code_fd(code)
    cgroup = bw.PidsCgroup(cgroup_parent, lim.processes) if cgroup_parent else None
    try:
        argv = [*bw.bwrap_args(bwrap, lim.disk_mb, passwd, group, network), *python_argv(lim, lim.processes)]
        if cgroup is not None:
            argv = cgroup.wrap(argv)
        return run_child(argv, stdin, lim.timeout_s, lim.max_output_chars, lim.output_limit_kb * 1024, {}, "/",
                         pass_fds=(passwd, group), user=user)
    finally:
        for fd in (passwd, group, stdin):
            os.close(fd)
        if cgroup is not None:
            cgroup.remove()


def _process_limit(bwrap: str, network: bool) -> tuple[str | None, int | None]:
    """How the host's root limits a call's processes: a pids cgroup where one is writable, else bwrap started as
    the unprivileged uid 65534 where that works (the interpreter readable by it, unprivileged user namespaces
    allowed), else neither (None, None). Other users need neither: ``RLIMIT_NPROC`` binds them."""
    if os.geteuid() != 0:
        return None, None
    parent = bw.pids_cgroup_parent()
    if parent is not None and _probe(bwrap, network, cgroup_parent=parent) is None:
        return parent, None
    if _probe(bwrap, network, user=bw.UID) is None:
        return None, bw.UID
    return None, None


@lru_cache(maxsize=8)
def _probe(bwrap: str, network: bool, cgroup_parent: str | None = None, user: int | None = None) -> str | None:
    """None when a trivial program runs in the sandbox and prints what it should, else what went wrong."""
    lim = SandboxLimits(timeout_s=20)
    try:
        outcome = run_in_bwrap(bwrap, "import os; print(os.getuid(), os.getcwd())", lim, network, cgroup_parent,
                               user)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    expected = f"{bw.UID} {bw.WORKDIR}"
    if outcome.returncode != 0 or outcome.output.strip() != expected:
        why = "timed out" if outcome.timed_out else f"exit status {outcome.returncode}"
        return f"a trial run failed ({why}): {outcome.output.strip()[-300:] or 'no output'}"
    return None
