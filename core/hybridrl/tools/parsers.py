"""Tool-call parsers: the text of one model turn -> the calls it asks for.

A parser is a callable ``parse(text) -> ParsedTurn`` registered under a name (``registry.add_tool_parser``);
the built-in one is ``hermes``, the format of Hermes and Qwen 2.5/3 (and what most open chat templates
render for ``tools=``)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "47+85"}}
    </tool_call>

A plugin adds another format by registering its own callable. Calls that cannot be read (bad JSON, no name)
are returned as ``errors`` rather than dropped, so the environment can tell the model and count them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hybridrl.tools.base import ToolCall


@dataclass(frozen=True)
class ParsedTurn:
    """The calls of one turn, the messages of the calls that could not be read, and the rest of the text."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    content: str = ""

    @property
    def asks_for_tools(self) -> bool:
        """Whether the turn tried to call a tool (readably or not): the episode goes on."""
        return bool(self.calls or self.errors)


ToolParser = Callable[[str], ParsedTurn]

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def _call_from_json(text: str) -> ToolCall:
    """``{"name": ..., "arguments": {...}}`` (arguments may also be a JSON string, as some models write them)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the tool call is not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"the tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("the tool call has no \"name\"")
    arguments: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise ValueError(f"the arguments of '{name}' are a string that is not JSON") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"the arguments of '{name}' must be a JSON object, got {type(arguments).__name__}")
    return ToolCall(name, arguments, text)


def hermes(text: str) -> ParsedTurn:
    """Every ``<tool_call>{json}</tool_call>`` block of the turn (an unclosed last block is read to the end
    of the turn: the model may have stopped on its end-of-turn token right after the JSON)."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    for match in _HERMES_BLOCK.finditer(text):
        body = match.group(1).strip()
        try:
            calls.append(_call_from_json(body))
        except ValueError as exc:
            errors.append(str(exc))
    content = _HERMES_BLOCK.sub("", text).strip()
    return ParsedTurn(calls, errors, content)
