"""``isolation: http``: the code runs on a sandbox service speaking SandboxFusion's ``run_code`` API (the one
verl's tools call): ``POST url`` with ``{"code", "language": "python", "run_timeout", "compile_timeout",
"memory_limit_MB"}``, answered by ``{"status": "Success" | "Failed" | "SandboxError", "message",
"run_result": {"status": "Finished" | "TimeLimitExceeded" | "Error", "return_code", "stdout", "stderr"}}``.

The service does the confining; this client bounds what it waits for (``timeout_s`` plus ``grace_s`` per socket
operation; the tool runner's per-call deadline bounds the whole call) and what it reads (``output_limit_kb``).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any
from urllib.parse import urlparse

from hybridrl.tools.base import ToolResult
from hybridrl.tools.sandbox.limits import SandboxLimits
from hybridrl.tools.sandbox.process import shorten


class HttpBackend:
    name = "http"

    def __init__(self, limits: SandboxLimits, url: str | None, grace_s: float = 5.0) -> None:
        if not url:
            raise ValueError("python tool: isolation 'http' needs a url (environment.tool_options.python.url, "
                             "the service's run_code endpoint, e.g. http://127.0.0.1:8080/run_code)")
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"python tool: url must be an http(s) address, got '{url}' "
                             "(environment.tool_options.python.url)")
        self.limits = limits
        self.url = url
        self.grace_s = float(grace_s)

    def describe(self) -> str:
        return f"http ({self.url})"

    def request(self, code: str) -> dict[str, Any]:
        lim = self.limits
        return {"code": code, "language": "python", "run_timeout": lim.timeout_s, "compile_timeout": lim.timeout_s,
                "memory_limit_MB": lim.memory_mb, "stdin": "", "files": {}, "fetch_files": []}

    def run(self, code: str) -> ToolResult:
        lim = self.limits
        body = json.dumps(self.request(code)).encode()
        req = urllib.request.Request(self.url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
        cap = lim.output_limit_kb * 1024
        try:
            with urllib.request.urlopen(req, timeout=lim.timeout_s + self.grace_s) as response:
                raw = response.read(cap + 1)
        except urllib.error.HTTPError as exc:
            return ToolResult.failure(f"sandbox service error: HTTP {exc.code} {exc.reason}")
        except TimeoutError:
            return ToolResult.failure(f"timeout: the sandbox service did not answer within "
                                      f"{lim.timeout_s + self.grace_s:g} s", timed_out=True)
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                return ToolResult.failure(f"timeout: the sandbox service did not answer within "
                                          f"{lim.timeout_s + self.grace_s:g} s", timed_out=True)
            return ToolResult.failure(f"sandbox service unreachable at {self.url}: {reason}")
        if len(raw) > cap:
            return ToolResult.failure(f"stopped: the sandbox service's answer is larger than {lim.output_limit_kb} KB")
        try:
            answer = json.loads(raw)
        except ValueError:
            return ToolResult.failure(f"sandbox service answered something that is not JSON: {raw[:200]!r}")
        return self.result(answer)

    def result(self, answer: Any) -> ToolResult:
        """A ``run_code`` answer as a tool result."""
        lim = self.limits
        if not isinstance(answer, dict):
            return ToolResult.failure(f"sandbox service answered {type(answer).__name__}, not an object")
        run = answer.get("run_result") or {}
        if answer.get("status") == "SandboxError" or not isinstance(run, dict):
            return ToolResult.failure(f"sandbox service error: {answer.get('message') or answer.get('status')}")
        text = shorten(f"{run.get('stdout') or ''}{run.get('stderr') or ''}", lim.max_output_chars)
        prefix = text + "\n" if text else ""
        if run.get("status") == "TimeLimitExceeded":
            return ToolResult.failure(prefix + f"timeout: the code ran longer than {lim.timeout_s:g} s",
                                      timed_out=True)
        code = run.get("return_code")
        if answer.get("status") != "Success" or code not in (0, None):
            return ToolResult.failure(text or f"exited with status {code} ({run.get('status')})")
        return ToolResult(text)
