"""Calling one rule reward on one response: the arguments it takes, and what counts as a valid score.

Two calling conventions are understood, so functions written for verl work unchanged:

- hybridrl's: ``fn(prompt, response, **fields)`` where ``fields`` are the row's other fields plus
  ``ground_truth`` and ``data_source`` (``hybridrl.data.fields``); a function without ``**kwargs`` gets only
  the fields it names;
- verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``: recognised by its
  ``solution_str`` parameter.

A score is a finite real number (Python's, NumPy's, a one-element tensor). Anything else raised or returned is
a ``RewardFailure`` with a one-line reason; the runner counts it and scores the response 0.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any

from hybridrl.errors import HybridRLError


class RewardFailure(Exception):
    """One reward call failed: it raised, or returned something that is not a finite number."""


class RewardError(HybridRLError, RuntimeError):
    """The run cannot go on scoring: most of a batch's rewards failed, or the reward pool cannot work."""


def is_number(value: Any) -> bool:
    """A real number: Python's, NumPy's, or a one-element tensor (never a string, a bool or None)."""
    if isinstance(value, (str, bytes, bool)) or value is None:
        return False
    if isinstance(value, numbers.Real):
        return True
    numel = getattr(value, "numel", None) or getattr(value, "size", None)
    try:
        count = numel() if callable(numel) else numel
        return count == 1 and isinstance(float(value), float)
    except (TypeError, ValueError):
        return False


def checked_score(value: Any) -> float:
    """``value`` as a float, or ``RewardFailure`` saying what it was."""
    if not is_number(value):
        text = repr(value)
        raise RewardFailure(f"returned {type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}, "
                            "not a number")
    score = float(value)
    if not math.isfinite(score):
        raise RewardFailure(f"returned {score}, not a finite number")
    return score


class RewardCall:
    """``fn`` bound to its calling convention; ``__call__(prompt, response, fields, **args)`` returns what
    ``fn`` returns (unchecked) and lets its exceptions through."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):  # a builtin or C callable: pass everything
            params = {}
        self.takes_all = not params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        self.names = {n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        self.verl_style = "solution_str" in params

    def __call__(self, prompt: str, response: str, fields: dict[str, Any], **args: Any) -> Any:
        if self.verl_style:
            kwargs = {"data_source": fields.get("data_source"), "solution_str": response,
                      "ground_truth": fields.get("ground_truth"), "extra_info": fields.get("extra_info"), **args}
            return self.fn(**self._accepted(kwargs))
        kwargs = {**fields, **args}
        if not self.takes_all:
            kwargs = {k: v for k, v in kwargs.items() if k in self.names and k not in ("prompt", "response")}
        return self.fn(prompt, response, **kwargs)

    def _accepted(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return kwargs if self.takes_all else {k: v for k, v in kwargs.items() if k in self.names}


def describe_exception(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"raised {type(exc).__name__}" + (f": {text[:200]}" if text else "")
