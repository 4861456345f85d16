"""The bundled tool task: add two numbers by calling the calculator, then copy its result.

Prompt ``47+85``. The tiny model cannot add, but it can learn a fixed short syntax: its first turn calls the
calculator by writing the expression followed by ``=`` (``47+85=``, read by the ``arith`` parser: a turn that is
an arithmetic expression ending in ``=`` is a calculator call), the result comes back as a tool message
(`` 132 `` with the example's plain template), and its next turn, ``132``, is the answer, which ends the
episode. The character vocabulary has no ``<``, ``{`` or ``"``, so the Hermes JSON format cannot be written.

Rewards (environment reward parts, summed): ``call``: up to 0.3 for the first turn against the expected call,
position by position: 0.25 for its digits (copied from the prompt), 0.05 for the ``+`` and ``=`` (a dense credit
like the reverse task's, which gives a randomly initialised policy a gradient towards the call; the constant
characters weigh little, else a policy that writes ``+`` everywhere, right at one place for every prompt,
settles there and stops exploring); ``answer``: 0.7 for the exact sum in the final turn,
else, in an episode that called the calculator, up to 0.3 for its digits in the right positions (the credit
for copying the tool's result; without the condition a policy that answers ``1..`` to every prompt, right in the
first digit of most sums, earns it without ever calling). Calling and copying scores 1.0; a policy that never
calls the tool scores almost nothing (it cannot add).

Option ``call_syntax`` (``environment.options``): ``expression`` (the default, above), or ``bare``: the first
turn calls the calculator on the question itself by writing ``=`` alone (``7+8`` -> ``=`` -> `` 15 `` -> ``15``);
its ``call`` credit is up to 0.3 for ``=`` position by position (a longer turn earns less). A randomly initialised
tiny policy finds one fixed character far sooner than it learns to copy the prompt, so on CPU this is the variant
whose reward and tool use rise within a few hundred steps; an expression call is still read (and runs).

Regenerate a data file with::

    python -m hybridrl.tasks.calc --digits 2 --count 2000 --out examples/data/calc2.jsonl
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from dataclasses import replace
from typing import Any

from hybridrl.environments.base import EnvironmentContext, ModelTurn, StepResult
from hybridrl.environments.tool_env import ToolEnvironment
from hybridrl.tasks.reverse import write_jsonl
from hybridrl.tools.base import ToolCall
from hybridrl.tools.parsers import ParsedTurn

CALL_WEIGHT = 0.3  # the bare call's credit
CALL_DIGITS_WEIGHT = 0.25
CALL_FORMAT_WEIGHT = 0.05
ANSWER_WEIGHT = 0.7
PARTIAL_WEIGHT = 0.3
CALL_SUFFIX = "="
CALL_SYNTAXES = ("expression", "bare")

_CALL = re.compile(r"^\s*([0-9][0-9+\-. ]*?)\s*=\s*$")


def arith(text: str) -> ParsedTurn:
    """The ``arith`` tool-call format: a turn that is an arithmetic expression of digits, ``+``, ``-`` and
    ``.`` followed by ``=`` calls the calculator with it; any other turn is content (an answer)."""
    match = _CALL.match(text)
    if match is None:
        return ParsedTurn(content=text.strip())
    return ParsedTurn(calls=[ToolCall("calculator", {"expression": match.group(1)}, text)])


def make_calc_rows(n_digits: int = 2, count: int | None = 2000, seed: int = 0) -> list[dict[str, str]]:
    """Rows ``{"prompt": "47+85", "answer": "132"}`` of two ``n_digits``-digit numbers (no leading zeros),
    ``count`` of them drawn by ``seed`` (``None``: every pair, in order)."""
    if n_digits <= 0:
        raise ValueError(f"n_digits must be positive, got {n_digits}")
    low, high = (0 if n_digits == 1 else 10 ** (n_digits - 1)), 10 ** n_digits
    if count is None:
        pairs = [(a, b) for a in range(low, high) for b in range(low, high)]
    else:
        if count <= 0:
            raise ValueError(f"count must be positive, got {count}")
        rng = random.Random(seed)
        pairs = [(rng.randrange(low, high), rng.randrange(low, high)) for _ in range(count)]
    return [{"prompt": f"{a}+{b}", "answer": str(a + b)} for a, b in pairs]


def positional_match(got: str, expected: str) -> float:
    """Share of positions where ``got`` and ``expected`` agree, over the longer of the two (so extra
    characters cost as much as missing ones)."""
    longest = max(len(got), len(expected))
    return sum(a == b for a, b in zip(got, expected)) / longest if longest else 1.0


def call_credit(got: str, expected: str) -> float:
    """The ``call`` reward part of a first turn: its digits that match the expected call's digits position by
    position (``CALL_DIGITS_WEIGHT``), and its other characters likewise, extra length counting against it
    (``CALL_FORMAT_WEIGHT``)."""
    digits = [i for i, c in enumerate(expected) if c.isdigit()]
    others = [i for i, c in enumerate(expected) if not c.isdigit()]

    def hits(positions: list[int]) -> int:
        return sum(i < len(got) and got[i] == expected[i] for i in positions)

    extra = max(0, len(got) - len(expected))
    credit = CALL_DIGITS_WEIGHT * hits(digits) / len(digits) if digits else 0.0
    return credit + CALL_FORMAT_WEIGHT * hits(others) / (len(others) + extra) if others or extra else credit


class CalcEnvironment(ToolEnvironment):
    """The ``calc`` task (see the module docstring): the tool environment with the calculator and the task's
    reward parts. Its rows carry ``answer``; the expected call is the prompt followed by ``=`` (``call_syntax:
    bare``: ``=`` alone)."""

    def __init__(self, context: EnvironmentContext, call_syntax: str = "expression", **options: Any) -> None:
        if call_syntax not in CALL_SYNTAXES:
            raise ValueError(f"call_syntax must be one of {CALL_SYNTAXES}, got {call_syntax!r}")
        if call_syntax == "bare" and context.parser is not None:  # '=' alone asks for the question's value
            context = replace(context, parser=self._bare_or(context.parser))
        super().__init__(context, **options)
        if "calculator" not in context.tools.names():
            raise ValueError("the calc environment needs the calculator: set environment.tools: [calculator]")
        self.call_syntax = call_syntax
        self.called = False  # a calculator call ran in this episode

    def _bare_or(self, parser: Any) -> Any:
        def parse(text: str) -> ParsedTurn:
            if text.strip() == CALL_SUFFIX and self.row is not None:
                return ParsedTurn(calls=[ToolCall("calculator", {"expression": str(self.row.prompt).strip()}, text)])
            return parser(text)
        return parse

    def call_reward(self, turn: ModelTurn, parsed: ParsedTurn, results: list) -> dict[str, float]:
        self.called = True
        return {}

    def step(self, turn: ModelTurn) -> StepResult:
        result = super().step(turn)
        if turn.index == 0 and self.call_syntax == "bare":
            result.reward["call"] = CALL_WEIGHT * positional_match(turn.text.strip(), CALL_SUFFIX)
        elif turn.index == 0:
            expected = str(self.row.prompt).strip() + CALL_SUFFIX
            result.reward["call"] = call_credit(turn.text.strip(), expected)
        return result

    def final_reward(self, turn: ModelTurn, parsed: ParsedTurn) -> dict[str, float]:
        answer = str(self.row.meta.get("answer", "")).strip()
        got = turn.text.strip()
        if got == answer:
            return {"answer": ANSWER_WEIGHT}
        return {"answer": PARTIAL_WEIGHT * positional_match(got, answer) if self.called else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridrl.tasks.calc",
                                     description="Write calculator-task prompt rows as jsonl.")
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    path = write_jsonl(make_calc_rows(args.digits, args.count, args.seed), args.out)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
