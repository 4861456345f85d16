"""A plugin of user environments for the guarded pre-flight probe (``plugins=[_env_guard_helpers]``): each one's
``reset`` behaves as its name says."""

from __future__ import annotations

import os
import sys
import time

from hybridrl import hookimpl
from hybridrl.environments.base import Environment, EpisodeRow, ModelTurn, StepResult


class Echo(Environment):
    def reset(self, row: EpisodeRow):
        return row.prompt_ids

    def step(self, turn: ModelTurn) -> StepResult:
        return StepResult(done=True, reward={"answer": 0.0})


class HangsOnReset(Echo):
    def reset(self, row: EpisodeRow):
        time.sleep(600)


class ExitsOnReset(Echo):
    def reset(self, row: EpisodeRow):
        sys.exit(3)


class DiesOnReset(Echo):
    def reset(self, row: EpisodeRow):
        os._exit(5)


@hookimpl
def hybridrl_register_environments(registry) -> None:
    registry.add_environment("user_echo", "_env_guard_helpers:Echo")
    registry.add_environment("hangs_on_reset", "_env_guard_helpers:HangsOnReset")
    registry.add_environment("exits_on_reset", "_env_guard_helpers:ExitsOnReset")
    registry.add_environment("dies_on_reset", "_env_guard_helpers:DiesOnReset")
