"""``python``: run a snippet of model-written Python in a child process with limits, and return its output.

What confines the child, all without root where the kernel allows it:

* **time**: a CPU-time limit (``RLIMIT_CPU``) and a wall-clock timeout after which its whole process group is
  killed (a snippet that sleeps uses no CPU);
* **memory and files**: ``RLIMIT_AS`` (address space), ``RLIMIT_FSIZE`` (no file larger than a few MB),
  ``RLIMIT_NOFILE``, ``RLIMIT_CORE`` = 0; it starts in a fresh empty folder that is deleted afterwards, with an
  empty environment and Python's isolated mode (``-I``: no user site, no ``PYTHON*`` variables);
* **network**: a new, empty network namespace (``unshare --user --map-root-user --net``: only a loopback that
  is down) where the kernel allows unprivileged user namespaces; and, where ``libseccomp`` is present, a seccomp
  filter that makes ``socket()`` fail with ``EPERM`` (both, when both are there).

What it is not: a security boundary against a determined attacker. The child runs as the same user and sees
the same filesystem (read and, within ``RLIMIT_FSIZE``, write); a kernel without user namespaces or libseccomp
leaves the network open (``Sandbox.isolation()`` says which layers are active and the tool's results report
it). For untrusted code at scale use a container or VM sandbox behind a tool of your own.

The limits are set by a small bootstrap that runs first in the child (no ``preexec_fn``, which is unsafe in a
threaded parent such as the per-request runner); the snippet comes on stdin.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from hybridrl.tools.base import Tool, ToolResult, argument

log = logging.getLogger(__name__)

# Runs in the child before the snippet: resource limits, then (optionally) the seccomp filter, then the code.
# argv: cpu seconds, address-space bytes, file-size bytes, open files, seccomp on/off.
_BOOTSTRAP = r"""
import resource, sys
cpu, mem, fsize, nofile, seccomp = (int(a) for a in sys.argv[1:6])
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, mem), (resource.RLIMIT_FSIZE, fsize),
                     (resource.RLIMIT_NOFILE, nofile), (resource.RLIMIT_CORE, 0)):
    if value > 0 or limit == resource.RLIMIT_CORE:
        resource.setrlimit(limit, (value, value))
if seccomp:
    import ctypes, ctypes.util
    lib = ctypes.CDLL(ctypes.util.find_library("seccomp"), use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ALLOW, ERRNO_EPERM = 0x7FFF0000, 0x00050000 | 1
    ctx = lib.seccomp_init(ALLOW)
    for name in (b"socket", b"socketpair"):
        number = lib.seccomp_syscall_resolve_name(name)
        if number >= 0 and lib.seccomp_rule_add(ctx, ERRNO_EPERM, number, 0) != 0:
            raise SystemExit("sandbox: seccomp_rule_add failed")
    if lib.seccomp_load(ctx) != 0:
        raise SystemExit("sandbox: seccomp_load failed")
del sys.argv[1:6]
source = sys.stdin.read()
sys.stdin = open("/dev/null")
try:
    exec(compile(source, "<tool>", "exec"), {"__name__": "__main__"})
except SystemExit:
    raise
except BaseException as exc:  # the traceback without this bootstrap's own frame
    import traceback
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.exit(1)
"""


@dataclass(frozen=True)
class Isolation:
    """Which network confinement layers the sandbox applies on this machine."""

    network_namespace: bool
    seccomp: bool

    @property
    def network_blocked(self) -> bool:
        return self.network_namespace or self.seccomp


@lru_cache(maxsize=1)
def _unshare_prefix() -> tuple[str, ...]:
    """``unshare --user --map-root-user --net`` when it works here (a user namespace can be made), else ()."""
    exe = shutil.which("unshare")
    if exe is None:
        return ()
    prefix = (exe, "--user", "--map-root-user", "--net")
    try:
        probe = subprocess.run([*prefix, sys.executable, "-I", "-c", "pass"], capture_output=True, timeout=10,
                               env={}, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return prefix if probe.returncode == 0 else ()


@lru_cache(maxsize=1)
def _seccomp_available() -> bool:
    name = ctypes.util.find_library("seccomp")
    if name is None:
        return False
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return False
    return all(hasattr(lib, f) for f in ("seccomp_init", "seccomp_rule_add", "seccomp_load",
                                         "seccomp_syscall_resolve_name"))


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0  # wall clock
    cpu_s: int = 5
    memory_mb: int = 512  # address space (a Python interpreter alone needs ~30 MB)
    file_mb: int = 4
    open_files: int = 64
    max_output_chars: int = 2000

    def __post_init__(self) -> None:
        """Every limit must be a positive number (0 or less would switch the rlimit off, or time out at once);
        whole numbers where the kernel takes whole numbers."""
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            whole = name != "timeout_s"
            if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)) or value <= 0:
                kind = "a whole number" if whole else "a number"
                raise ValueError(f"{name} must be {kind} > 0, got {value!r}")


class Sandbox:
    """Runs Python snippets in confined child processes (see the module docstring)."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), network: str = "block") -> None:
        if network not in ("block", "allow"):
            raise ValueError(f"network must be 'block' or 'allow', got '{network}'")
        self.limits = limits
        self.network = network

    def isolation(self) -> Isolation:
        if self.network == "allow":
            return Isolation(False, False)
        return Isolation(network_namespace=bool(_unshare_prefix()), seccomp=_seccomp_available())

    def command(self) -> list[str]:
        lim, iso = self.limits, self.isolation()
        prefix = list(_unshare_prefix()) if iso.network_namespace else []
        return [*prefix, sys.executable, "-I", "-c", _BOOTSTRAP, str(int(lim.cpu_s)), str(lim.memory_mb * 2**20),
                str(lim.file_mb * 2**20), str(lim.open_files), "1" if iso.seccomp else "0"]

    def run(self, code: str) -> ToolResult:
        """Run ``code``; its stdout and stderr (truncated) as the result, an error when it exits non-zero,
        a timeout when it runs past ``timeout_s`` (its process group is killed)."""
        lim = self.limits
        workdir = tempfile.mkdtemp(prefix="hybridrl-sandbox-")
        try:
            proc = subprocess.Popen(self.command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, cwd=workdir, env={}, start_new_session=True)
            try:
                out, _ = proc.communicate(code.encode("utf-8", "replace"), timeout=lim.timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.communicate()
                return ToolResult.failure(f"timeout: the code ran longer than {lim.timeout_s:g} s", timed_out=True)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        text = shorten(out.decode("utf-8", "replace"), lim.max_output_chars)
        if proc.returncode == -signal.SIGXCPU or proc.returncode == -signal.SIGKILL:
            return ToolResult.failure((text + "\n" if text else "") +
                                      f"timeout: the CPU-time limit of {lim.cpu_s} s was reached", timed_out=True)
        if proc.returncode != 0:
            return ToolResult.failure(text or f"exited with status {proc.returncode}")
        return ToolResult(text)


def shorten(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters, keeping its start and its end (where a traceback's message is)."""
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    return f"{text[:head]}\n... ({len(text) - limit} characters left out) ...\n{text[-tail:]}"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


class PythonTool(Tool):
    """Run Python code (``{"code": "print(2**10)"}``) in the sandbox; what it prints is the result.

    Options (``environment.tool_options.python``): ``timeout_s``, ``cpu_s``, ``memory_mb``, ``file_mb``,
    ``max_output_chars``, ``network`` (``block``, the default, or ``allow``)."""

    name = "python"
    description = "Run a Python program and return what it prints (no network, a few seconds, limited memory)."
    parameters = {"type": "object",
                  "properties": {"code": {"type": "string", "description": "the program; print the result"}},
                  "required": ["code"]}

    def __init__(self, network: str = "block", **limits: Any) -> None:
        known = set(SandboxLimits.__dataclass_fields__)
        unknown = set(limits) - known
        if unknown:
            raise ValueError(f"python tool: unknown option(s) {sorted(unknown)} "
                             f"(known: network, {', '.join(sorted(known))})")
        self.sandbox = Sandbox(SandboxLimits(**limits), network)
        iso = self.sandbox.isolation()
        if network == "block" and not iso.network_blocked:
            log.warning("python tool: neither a network namespace nor seccomp is available here: the sandboxed "
                        "code can reach the network")

    def run(self, arguments: dict[str, Any]) -> ToolResult:
        code = argument(arguments, "code", self.name)
        if not isinstance(code, str):
            return ToolResult.failure(f"error: code must be a string, got {type(code).__name__}")
        return self.sandbox.run(code)
