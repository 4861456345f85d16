"""What a tool is to the core: a named callable on JSON arguments that returns text, never raises into the
rollout, and says whether it failed or ran out of time (the environment reports both as metrics).

A tool is registered by a plugin (``registry.add_tool(name, "module:Class")``) and built once per rollout call
with the options of ``environment.tool_options.<name>``; it may be called from several threads at once (the
per-request runner steps environments in a thread pool), so it keeps no per-call state.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One call the model asked for: the tool's name and its arguments (``raw``: the text it was parsed from)."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    raw: str = ""


@dataclass(frozen=True)
class ToolResult:
    """What a call gave back. ``content`` is what the model reads next (the error message itself when
    ``error``); ``timed_out`` implies ``error``."""

    content: str
    error: bool = False
    timed_out: bool = False

    @classmethod
    def failure(cls, message: str, timed_out: bool = False) -> ToolResult:
        return cls(message, error=True, timed_out=timed_out)


class Tool(ABC):
    """A tool the model can call. Subclasses set ``name``, ``description`` and ``parameters`` (a JSON schema
    of the arguments object, what a chat template's ``tools=`` renders for the model) and implement ``run``."""

    name: str = ""
    description: str = ""
    parameters: dict[str, Any] = {"type": "object", "properties": {}}

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema that chat templates (Qwen, Llama, Hermes ...) accept in ``tools=``."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    @abstractmethod
    def run(self, arguments: dict[str, Any]) -> ToolResult:
        """Do the call. Bad arguments and failures come back as ``ToolResult.failure(...)``."""

    def __call__(self, arguments: dict[str, Any]) -> ToolResult:
        """``run``, with any exception it lets through turned into an error result naming the tool (one bad
        call must not end the rollout of the whole batch)."""
        try:
            result = self.run(arguments)
        except Exception as exc:  # noqa: BLE001 - reported to the model and counted, never raised
            return ToolResult.failure(f"{self.name} failed: {type(exc).__name__}: {exc}")
        if not isinstance(result, ToolResult):
            return ToolResult.failure(f"{self.name} returned {type(result).__name__}, not a ToolResult")
        return result


def argument(arguments: dict[str, Any], key: str, tool: str) -> Any:
    """``arguments[key]``, or (for a model that passed the bare value) the only argument given; raises
    ``ValueError`` naming the tool and what it expected."""
    if key in arguments:
        return arguments[key]
    if len(arguments) == 1:
        return next(iter(arguments.values()))
    raise ValueError(f"{tool} expects an argument '{key}', got {json.dumps(sorted(arguments))}")
