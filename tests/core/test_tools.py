"""Tools: the calculator (arithmetic only, bounded), the Hermes call parser, the toolbox, and the Python
sandbox's limits (time, CPU, memory, file size, environment, network); its containment is in test_sandbox."""

from __future__ import annotations

import json
import socket

import pytest

from hybridrl.plugins.discovery import get_registry
from hybridrl.tools.base import Tool, ToolCall, ToolResult
from hybridrl.tools.calculator import Calculator, CalculatorError, evaluate, format_number
from hybridrl.tools.parsers import hermes
from hybridrl.tools.sandbox import PythonTool, Sandbox, SandboxLimits
from hybridrl.tools.toolbox import ToolBox


# --- calculator -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("expression,value", [("47+85", 132), ("2*(3+4)", 14), ("7/2", 3.5), ("7//2", 3),
                                              ("-3**2", -9), ("2^10", 1024), ("10 % 4", 2), (" 1.5+1.5 ", 3.0)])
def test_calculator_evaluates_arithmetic(expression, value):
    assert evaluate(expression) == value


@pytest.mark.parametrize("expression,reason", [
    ("__import__('os').system('true')", "not allowed"), ("open('/etc/passwd')", "not allowed"),
    ("x + 1", "not allowed"), ("(1).__class__", "not allowed"), ("[1, 2]", "not allowed"), ("'a' * 3", "only numbers"),
    ("True + 1", "only numbers"), ("9**9**9", "exponent"), ("1/0", "division by zero"), ("1 +", "not an expression"),
    ("", "empty"), ("1+" * 200 + "1", "longer than"), ("(" * 150 + "1" + ")" * 150, "nested|longer"),
    ("(10**99)**99", "digits"), ("1e308*10", "finite"),
])
def test_calculator_refuses_everything_else(expression, reason):
    with pytest.raises(CalculatorError, match=reason):
        evaluate(expression)


def test_calculator_tool_results_and_errors():
    tool = Calculator()
    assert tool({"expression": "47+85"}) == ToolResult("132")
    assert tool({"expr": "6*7"}) == ToolResult("42")  # a lone argument under another name is taken
    bad = tool({"expression": "os.getcwd()"})
    assert bad.error and not bad.timed_out and "not allowed" in bad.content
    assert tool({}).error
    assert format_number(2.0) == "2" and format_number(1 / 3) == "0.333333333333"


# --- parser -----------------------------------------------------------------------------------------------
def test_hermes_parses_calls_keeps_content_and_reports_bad_ones():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'
            '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
            '<tool_call>{"name": broken}</tool_call><tool_call>{"arguments": {}}</tool_call>')
    parsed = hermes(text)
    assert [c.name for c in parsed.calls] == ["calculator", "python"]
    assert parsed.calls[0].arguments == {"expression": "1+1"} and parsed.calls[1].arguments == {"code": "print(1)"}
    assert len(parsed.errors) == 2 and "not valid JSON" in parsed.errors[0] and "no \"name\"" in parsed.errors[1]
    assert parsed.content == "Let me compute." and parsed.asks_for_tools


def test_hermes_reads_an_unclosed_last_call_and_plain_answers():
    parsed = hermes('<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}')
    assert [c.arguments for c in parsed.calls] == [{"expression": "2"}]
    answer = hermes("The answer is 4.")
    assert not answer.asks_for_tools and answer.content == "The answer is 4."


# --- toolbox ----------------------------------------------------------------------------------------------
class Exploding(Tool):
    name = "boom"

    def run(self, arguments):
        raise RuntimeError("kaput")


def test_toolbox_builds_from_the_registry_and_never_raises():
    box = ToolBox.build(get_registry(), ["calculator", "python"], {"python": {"timeout_s": 3}})
    assert box.names() == ["calculator", "python"]
    assert [s["function"]["name"] for s in box.schemas()] == ["calculator", "python"]
    assert json.dumps(box.schemas())  # JSON-serialisable for a chat template
    assert box.call(ToolCall("calculator", {"expression": "2+2"})).content == "4"
    unknown = box.call(ToolCall("search", {}))
    assert unknown.error and "unknown tool 'search'" in unknown.content and "calculator" in unknown.content
    failing = ToolBox({"boom": Exploding()}).call(ToolCall("boom", {}))
    assert failing.error and "RuntimeError: kaput" in failing.content
    with pytest.raises(ValueError, match="not in environment.tools"):
        ToolBox.build(get_registry(), ["calculator"], {"python": {}})
    with pytest.raises(ValueError, match="unknown option"):
        ToolBox.build(get_registry(), ["python"], {"python": {"timeout": 3}})


# --- sandbox ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def python_tool() -> PythonTool:
    return PythonTool(timeout_s=4, cpu_s=1, memory_mb=256, file_mb=1, max_output_chars=200)


def test_sandbox_runs_code_and_reports_failures(python_tool):
    assert python_tool({"code": "print(sum(range(10)))"}) == ToolResult("45\n")
    failed = python_tool({"code": "raise ValueError('boom')"})
    assert failed.error and "ValueError: boom" in failed.content and "<tool>" in failed.content
    assert "_BOOTSTRAP" not in failed.content and "resource.setrlimit" not in failed.content
    long = python_tool({"code": "print('a' * 1000 + 'z')"})
    assert len(long.content) < 300 and "characters left out" in long.content
    assert long.content.startswith("aaa") and long.content.endswith("z\n")


def test_sandbox_enforces_time_memory_and_files(python_tool):
    slept = python_tool({"code": "import time; time.sleep(30)"})
    assert slept.timed_out and slept.error and "ran longer than 4 s" in slept.content
    spun = python_tool({"code": "while True: pass"})
    assert spun.timed_out  # the CPU limit (1 s) or the wall clock, whichever the shared machine hits first
    memory = python_tool({"code": "x = bytearray(1024 * 2**20)"})
    assert memory.error and "MemoryError" in memory.content
    big = python_tool({"code": "open('f', 'wb').write(b'x' * (4 * 2**20))"})
    assert big.error and "File too large" in big.content


def test_sandbox_starts_empty_and_isolated(python_tool, tmp_path):
    env = python_tool({"code": "import os; print(sorted(k for k in os.environ if k not in ('LC_CTYPE', 'PWD')))"})
    assert env.content.strip() == "[]"
    where = python_tool({"code": "import os; print(os.getcwd()); print(os.listdir('.'))"}).content.split("\n")
    assert where[0] == "/sandbox" and where[1] == "[]"
    code = ("import socket\nfor host in ('127.0.0.1', '1.1.1.1'):\n    try:\n"
            "        socket.create_connection((host, 80), timeout=2)\n        print('connected', host)\n"
            "    except OSError as exc:\n        print(host, exc)")
    net = python_tool({"code": code})
    assert "connected" not in net.content and not net.error
    assert all(any(e in line for e in ("Connection refused", "Network is unreachable"))
               for line in net.content.strip().splitlines()), net.content


def test_sandbox_options_are_checked():
    with pytest.raises(ValueError, match="network must be"):
        Sandbox(SandboxLimits(), network="maybe")
    with pytest.raises(ValueError, match="isolation must be one of"):
        Sandbox(SandboxLimits(), isolation="chroot")
    allowed = PythonTool(network="allow")
    assert "network shared" in allowed.sandbox.describe()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    try:  # the host's loopback is reachable only when the network is shared
        code = f"import socket; socket.create_connection(('127.0.0.1', {server.getsockname()[1]}), timeout=2)"
        assert not allowed({"code": code}).error
        assert "ConnectionRefusedError" in PythonTool()({"code": code}).content
    finally:
        server.close()


@pytest.mark.parametrize("limits,reason", [({"timeout_s": 0}, "timeout_s must be a number > 0"),
                                           ({"cpu_s": -1}, "cpu_s must be a whole number > 0"),
                                           ({"memory_mb": 0}, "memory_mb"), ({"file_mb": 1.5}, "file_mb"),
                                           ({"open_files": True}, "open_files"),
                                           ({"max_output_chars": "many"}, "max_output_chars")])
def test_sandbox_limits_must_be_positive(limits, reason):
    # 0 would switch an rlimit off in the child (unlimited), not forbid everything
    with pytest.raises(ValueError, match=reason):
        SandboxLimits(**limits)
    assert SandboxLimits(timeout_s=0.5).timeout_s == 0.5
