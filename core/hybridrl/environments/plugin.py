"""The core's environments, tools and tool-call parsers (registered directly by the host,
``plugins.discovery.CORE_PLUGINS``); a plugin adds its own through the same hook."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridrl.plugins.hookspecs import hookimpl

if TYPE_CHECKING:
    from hybridrl.plugins.registry import Registry


@hookimpl
def hybridrl_register_environments(registry: Registry) -> None:
    registry.add_environment("single_turn", "hybridrl.environments.single_turn:SingleTurnEnvironment")
    registry.add_environment("tools", "hybridrl.environments.tool_env:ToolEnvironment")
    registry.add_tool("calculator", "hybridrl.tools.calculator:Calculator")
    registry.add_tool("python", "hybridrl.tools.sandbox:PythonTool")
    registry.add_tool_parser("hermes", "hybridrl.tools.parsers:hermes")
