"""``trainer.step_timeout_s``: the deadline of the driver's waits on workers, from the setting and the steps seen."""

from __future__ import annotations

import pytest

from hybridrl.config import ConfigError, load_config
from hybridrl.runtime.deadline import FLOOR_S, STARTUP_S, CallDeadline, Silent, WorkersNotAnswering

QUICKSTART = "examples/quickstart.yaml"


def test_auto_allows_start_up_then_ten_times_the_slowest_step_with_a_floor() -> None:
    deadline = CallDeadline("auto")
    assert deadline.timeout_s() == STARTUP_S == 1800
    deadline.observe_step(3.0)
    assert deadline.timeout_s() == FLOOR_S == 600
    deadline.observe_step(90.0)
    deadline.observe_step(20.0)  # the slowest step counts, not the last
    assert deadline.timeout_s() == 900


def test_a_number_is_used_for_every_wait() -> None:
    deadline = CallDeadline(5.0)
    assert deadline.timeout_s() == 5.0
    deadline.observe_step(100.0)
    assert deadline.timeout_s() == 5.0


def test_the_key_is_checked_before_any_work() -> None:
    assert load_config(QUICKSTART, []).trainer.step_timeout_s == "auto"
    assert load_config(QUICKSTART, ["trainer.step_timeout_s=30"]).trainer.step_timeout_s == 30.0
    with pytest.raises(ConfigError, match="trainer.step_timeout_s"):
        load_config(QUICKSTART, ["trainer.step_timeout_s=0"])


def test_the_sentence_names_role_pool_ranks_call_and_setting() -> None:
    exc = WorkersNotAnswering([Silent(("rollout",), "gen", (0, 2), 4, "rollout.receive_weights")], 30.0, "30.0")
    assert str(exc) == ("role rollout (pool 'gen'), ranks 0, 2 of 4 (rollout.receive_weights) did not answer "
                        "within 30s (trainer.step_timeout_s=30.0)")
