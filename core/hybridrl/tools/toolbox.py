"""The tools of one rollout call, built once from the registry and shared by its episodes."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from hybridrl.tools.base import Tool, ToolCall, ToolResult


class ToolBox:
    """The named tools an environment may call. ``call`` never raises: an unknown tool or a failing one is an
    error result the model reads (and the environment counts)."""

    def __init__(self, tools: Mapping[str, Tool]) -> None:
        self.tools = dict(tools)

    @classmethod
    def build(cls, registry: Any, names: Sequence[str], options: Mapping[str, Mapping[str, Any]] | None = None
              ) -> "ToolBox":
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
        return cls(tools)

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
        return tool(call.arguments)
