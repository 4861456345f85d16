"""User code that misbehaves, for the guarded-call and reward-deadline tests (imported by name in child
processes: ``roles.reward.fn=_user_code_helpers:hang``)."""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any


def hang(prompt: str = "", response: str = "", **fields: Any) -> float:
    time.sleep(600)
    return 0.0


def exit_3(prompt: str = "", response: str = "", **fields: Any) -> float:
    sys.exit(3)


def hard_exit(prompt: str = "", response: str = "", **fields: Any) -> float:
    os._exit(4)


def kill_self(prompt: str = "", response: str = "", **fields: Any) -> float:
    os.kill(os.getpid(), signal.SIGKILL)
    return 0.0


def raises(prompt: str = "", response: str = "", **fields: Any) -> float:
    raise KeyError("score")


def constant(prompt: str = "", response: str = "", **fields: Any) -> float:
    return 1.5


def late_hang(prompt: str, response: str, **fields: Any) -> float:
    """Passes the pre-flight probe (an empty response), then hangs on every real response."""
    if response:
        time.sleep(600)
    return 0.0


def late_exit(prompt: str, response: str, **fields: Any) -> float:
    """Passes the pre-flight probe (an empty response), then calls sys.exit on every real response."""
    if response:
        sys.exit(3)
    return 0.0
