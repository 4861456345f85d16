"""Reward functions for the reward-runner tests, importable by name in the pool's processes
(``_reward_helpers:flaky``). Each behaves by the response it is given."""

from __future__ import annotations

import math
import os
import time
from typing import Any


def flaky(prompt: str, response: str, **fields: Any) -> Any:
    """The length of the response; fails in the way the response names."""
    if response == "hang":
        time.sleep(600)
    if response == "raise":
        raise KeyError("missing")
    if response == "text":
        return "1.0"
    if response == "nan":
        return math.nan
    if response == "inf":
        return -math.inf
    if response == "none":
        return None
    if response == "die":
        os._exit(3)
    return float(len(response))


def late_failure(prompt: str, response: str, **fields: Any) -> Any:
    """Passes the pre-flight probe (empty response) and fails on every real response (issue 21)."""
    if response == "":
        return 0.0
    if len(response) % 2:
        return "oops"
    raise ValueError("cannot parse the response")


def verl_style(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> float:
    return float(solution_str.strip() == ground_truth) + (0.5 if data_source == "b" else 0.0)


def strict_signature(prompt: str, response: str, answer: str) -> float:
    return float(response == answer)
