"""User code called once in a spawned child with a deadline (``hybridrl.run.guarded_call``): its value comes
back; a hang, ``sys.exit``, ``os._exit``, a SIGKILL of its own process or an exception each become one reason,
and a hang is cut at its deadline (plus the child's start)."""

from __future__ import annotations

import time

import _user_code_helpers as helpers
import pytest

from hybridrl.run.guarded_call import ChildFailure, call_in_child, describe_exit


def test_a_value_comes_back():
    assert call_in_child(helpers.constant, (), timeout_s=30) == 1.5


@pytest.mark.parametrize("fn, reason", [
    (helpers.exit_3, "called sys.exit(3)"),
    (helpers.hard_exit, "ended its process with exit status 4"),
    (helpers.kill_self, "was killed by signal 9 (SIGKILL)"),
    (helpers.raises, "raised KeyError: 'score'"),
])
def test_each_way_out_of_the_call_is_one_reason(fn, reason):
    with pytest.raises(ChildFailure) as err:
        call_in_child(fn, (), timeout_s=30)
    assert err.value.reason == reason


def test_a_hang_is_cut_at_its_deadline():
    start = time.monotonic()
    with pytest.raises(ChildFailure) as err:
        call_in_child(helpers.hang, (), timeout_s=1.0)
    took = time.monotonic() - start
    assert err.value.reason == "timed out after 1s"
    assert took < 1.0 + 2.0 + 1.0, took  # the deadline, the child's start (about 1 s here) and a margin


def test_exit_codes_are_described():
    assert describe_exit(-15) == "was killed by signal 15 (SIGTERM)"
    assert describe_exit(0) == "ended its process with exit status 0"
