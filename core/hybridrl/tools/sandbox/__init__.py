"""``python``: run model-written Python somewhere it cannot reach the run, and return what it prints.

The interface is ``Sandbox(limits, isolation, ...)`` with ``run(code) -> ToolResult`` (never raises for what the
code does) and ``describe()``; ``PythonTool`` is the tool the environments call. Isolation
(``environment.tool_options.python.isolation``):

* ``bwrap`` (the default): Linux namespaces through bubblewrap (``bwrap``), see ``sandbox.bwrap``: no network,
  nothing of the host writable but a fresh tmpfs, no run folder visible, a non-root user, its own pid namespace
  (nothing outlives the call), limits on processes, memory, file size and CPU time. Where bwrap is missing or
  fails a trial run, building the tool fails (a pre-flight error naming the key): it never falls back silently;
* ``http``: a sandbox service speaking SandboxFusion's ``run_code`` API (``url``), see ``sandbox.http``;
* ``none``: only the rlimits, the deadline and the bounded output (``sandbox.local.UnconfinedBackend``); the
  code can read and write this user's files and reach the network. Printed as a warning with the device map.

Every local call has a hard wall-clock deadline (``timeout_s``) that no process of the code can stretch, and its
output is read in bounded chunks (``sandbox.process``). The tool runner adds its own deadline per call
(``hybridrl.tools.toolbox``), so a hang in any tool fails that call, not the step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from hybridrl.tools.base import Tool, ToolResult, argument
from hybridrl.tools.sandbox.limits import SandboxLimits, SandboxUnavailable
from hybridrl.tools.sandbox.process import shorten

__all__ = ["ISOLATIONS", "KEY", "PythonTool", "Sandbox", "SandboxLimits", "SandboxUnavailable",
           "isolation_warnings", "shorten"]

ISOLATIONS = ("bwrap", "http", "none")
#: where the isolation is configured (what errors and warnings name).
KEY = "environment.tool_options.python.isolation"


class Backend(Protocol):
    name: str

    def describe(self) -> str: ...

    def run(self, code: str) -> ToolResult: ...


class Sandbox:
    """Runs Python snippets under one isolation (see the module docstring). ``bwrap``: the bubblewrap binary
    (a path or a name on PATH; default ``bwrap``); ``url``: the service of ``isolation='http'``; ``network``:
    ``allow`` shares the host's network with a ``bwrap`` sandbox (default ``block``)."""

    def __init__(self, limits: SandboxLimits | None = None, isolation: str = "bwrap", bwrap: str | None = None,
                 url: str | None = None, network: str = "block") -> None:
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}, got '{isolation}' ({KEY})")
        if network not in ("block", "allow"):
            raise ValueError(f"network must be 'block' or 'allow', got '{network}'")
        if url is not None and isolation != "http":
            raise ValueError(f"url is only read with isolation 'http' (isolation is '{isolation}', {KEY})")
        self.limits = limits = limits if limits is not None else SandboxLimits()
        self.isolation = isolation
        self.network = network
        self.backend: Backend
        if isolation == "bwrap":
            from hybridrl.tools.sandbox.local import BwrapBackend

            try:
                self.backend = BwrapBackend(limits, bwrap, network == "allow")
            except SandboxUnavailable as exc:
                raise SandboxUnavailable(
                    f"python tool: no working sandbox on this machine: {exc}. Install bubblewrap (Debian/Ubuntu: "
                    f"apt-get install bubblewrap), or set {KEY}: http (with url, a SandboxFusion service), or "
                    f"{KEY}: none to run model-written code unconfined (rlimits only)") from exc
        elif isolation == "http":
            from hybridrl.tools.sandbox.http import HttpBackend

            self.backend = HttpBackend(limits, url)
        else:
            from hybridrl.tools.sandbox.local import UnconfinedBackend

            self.backend = UnconfinedBackend(limits)

    def describe(self) -> str:
        return self.backend.describe()

    def run(self, code: str) -> ToolResult:
        """Run ``code``: its output (start and end kept) as the result; an error when it exits non-zero, is
        stopped for printing too much, or (``timed_out``) runs past ``timeout_s`` or its CPU time."""
        return self.backend.run(code)


def isolation_warnings(tools: Sequence[str], tool_options: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Warnings to print with the device map: the python tool configured without isolation."""
    if "python" in tools and dict(tool_options.get("python") or {}).get("isolation") == "none":
        return [f"{KEY}: none: the python tool runs model-written code unconfined (rlimits only): it can read and "
                "write this user's files, the run folder included, and reach the network"]
    return []


class PythonTool(Tool):
    """Run Python code (``{"code": "print(2**10)"}``) in the sandbox; what it prints is the result.

    Options (``environment.tool_options.python``): ``isolation`` (``bwrap``, ``http``, ``none``), ``url`` (with
    ``http``), ``bwrap`` (the binary), ``network`` (``block`` or ``allow``), and the limits of ``SandboxLimits``
    (``timeout_s``, ``cpu_s``, ``memory_mb``, ``file_mb``, ``disk_mb``, ``open_files``, ``processes``,
    ``max_output_chars``, ``output_limit_kb``)."""

    name = "python"
    description = "Run a Python program and return what it prints (no network, a few seconds, limited memory)."
    parameters = {"type": "object",
                  "properties": {"code": {"type": "string", "description": "the program; print the result"}},
                  "required": ["code"]}

    def __init__(self, isolation: str = "bwrap", url: str | None = None, bwrap: str | None = None,
                 network: str = "block", **limits: Any) -> None:
        known = set(SandboxLimits.__dataclass_fields__)
        unknown = set(limits) - known
        if unknown:
            raise ValueError(f"python tool: unknown option(s) {sorted(unknown)} "
                             f"(known: isolation, url, bwrap, network, {', '.join(sorted(known))})")
        self.sandbox = Sandbox(SandboxLimits(**limits), isolation, bwrap, url, network)
        #: the tool runner abandons a call after this (the sandbox's own deadline, plus start-up and kill).
        self.deadline_s = self.sandbox.limits.timeout_s + 10.0

    def run(self, arguments: dict[str, Any]) -> ToolResult:
        code = argument(arguments, "code", self.name)
        if not isinstance(code, str):
            return ToolResult.failure(f"error: code must be a string, got {type(code).__name__}")
        return self.sandbox.run(code)
