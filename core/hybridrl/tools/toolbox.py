"""The tools of one rollout call, built once from the registry and shared by its episodes, and called so that a
hang cannot stall the step: each call runs in a thread of its own that the caller waits on for at most its
deadline (``environment.tool_deadline_s``, or the tool's own ``deadline_s`` when shorter); a call past it is
abandoned and comes back as a timed-out failure (counted in the episode's ``tool_timeouts``)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from hybridrl.tools.base import Tool, ToolCall, ToolResult

log = logging.getLogger(__name__)
DEFAULT_DEADLINE_S = 60.0


class ToolBox:
    """The named tools an environment may call. ``call`` never raises: an unknown tool or a failing one is an
    error result the model reads (and the environment counts)."""

    def __init__(self, tools: Mapping[str, Tool], deadline_s: float = DEFAULT_DEADLINE_S) -> None:
        if not deadline_s > 0:
            raise ValueError(f"environment.tool_deadline_s must be > 0, got {deadline_s}")
        self.tools = dict(tools)
        self.deadline_s = float(deadline_s)

    @classmethod
    def build(cls, registry: Any, names: Sequence[str], options: Mapping[str, Mapping[str, Any]] | None = None,
              deadline_s: float = DEFAULT_DEADLINE_S) -> ToolBox:
        """``registry.get("tool", name)(**options[name])`` for each name (``environment.tools`` and
        ``environment.tool_options``)."""
        options = dict(options or {})
        unused = set(options) - set(names)
        if unused:
            raise ValueError(f"environment.tool_options names tool(s) not in environment.tools: {sorted(unused)}")
        tools: dict[str, Tool] = {}
        for name in names:
            factory = registry.get("tool", name)
            tool = factory(**dict(options.get(name, {})))
            if not isinstance(tool, Tool):
                raise TypeError(f"tool '{name}' built a {type(tool).__name__}, not a hybridrl.tools.base.Tool")
            tools[name] = tool
        return cls(tools, deadline_s)

    def __bool__(self) -> bool:
        return bool(self.tools)

    def names(self) -> list[str]:
        return list(self.tools)

    def schemas(self) -> list[dict[str, Any]]:
        """Function schemas of every tool (a chat template's ``tools=``)."""
        return [tool.schema() for tool in self.tools.values()]

    def call(self, call: ToolCall) -> ToolResult:
        tool = self.tools.get(call.name)
        if tool is None:
            available = ", ".join(self.tools) or "none"
            return ToolResult.failure(f"error: unknown tool '{call.name}' (available: {available})")
        return self.call_with_deadline(tool, call.arguments)

    def deadline_for(self, tool: Tool) -> float:
        own = getattr(tool, "deadline_s", None)
        return min(self.deadline_s, float(own)) if isinstance(own, (int, float)) and own > 0 else self.deadline_s

    def call_with_deadline(self, tool: Tool, arguments: dict[str, Any]) -> ToolResult:
        """``tool(arguments)`` in a daemon thread, waited on for at most the tool's deadline."""
        deadline = self.deadline_for(tool)
        box: list[ToolResult] = []
        thread = threading.Thread(target=lambda: box.append(tool(arguments)), name=f"hybridrl-tool-{tool.name}",
                                  daemon=True)
        thread.start()
        thread.join(deadline)
        if thread.is_alive() or not box:
            log.warning("tool '%s' did not answer within %g s: the call is failed and left behind", tool.name,
                        deadline)
            return ToolResult.failure(f"timeout: the tool '{tool.name}' did not answer within {deadline:g} s",
                                      timed_out=True)
        return box[0]
