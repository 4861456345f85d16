"""A plugin module (loaded by name through ``plugins``, as a user's own would be) for the environment kit's
tests: a tool-call format of its own, and two environments that break the contract on purpose."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from hybridrl.environments.base import ModelTurn, StepResult
from hybridrl.environments.tool_env import ToolEnvironment
from hybridrl.plugins.hookspecs import hookimpl
from hybridrl.tools.base import ToolCall
from hybridrl.tools.parsers import ParsedTurn

if TYPE_CHECKING:
    from hybridrl.plugins.registry import Registry

_COLON_CALL = re.compile(r"^\s*([a-z_]+):(.*)$")


def colon(text: str) -> ParsedTurn:
    """``calculator: 12+30``: the tool's name, a colon and its one argument (a compact format without JSON, in
    the kit tokenizer's characters); any other turn is an answer."""
    match = _COLON_CALL.match(text)
    if match is None:
        return ParsedTurn([], [], text.strip())
    return ParsedTurn([ToolCall(match.group(1), {"expression": match.group(2).strip()}, text)], [], "")


class NaNReward(ToolEnvironment):
    """Rewards every answer with NaN (the kit must say its rewards are not finite)."""

    def final_reward(self, turn, parsed):
        return {"answer": float("nan")}


class MisremembersResults(ToolEnvironment):
    """Sends the tool's result as the observation but keeps another text in its conversation (the kit's round
    trip must catch that the row and the environment's history disagree)."""

    def step(self, turn: ModelTurn) -> StepResult:
        result = super().step(turn)
        if result.observation:
            self.messages[-1] = {**self.messages[-1], "content": self.messages[-1]["content"] + "0"}
        return result


@hookimpl
def hybridrl_register_environments(registry: Registry) -> None:
    registry.add_tool_parser("colon", "_env_kit_plugin:colon")
    registry.add_environment("nan_reward", "_env_kit_plugin:NaNReward")
    registry.add_environment("misremembers_results", "_env_kit_plugin:MisremembersResults")
