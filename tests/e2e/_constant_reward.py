"""A reward that scores every response the same: every GRPO group is uninformative (``test_long_tail``)."""

from __future__ import annotations

from typing import Any


def zero(prompt: str, response: str, **fields: Any) -> float:
    return 0.0
