"""``calculator``: arithmetic on numbers, evaluated by walking Python's syntax tree of the expression.

Nothing is ever ``eval``-ed: only number literals, ``+ - * / // % **``, unary signs and parentheses are
accepted (names, calls, attributes, subscripts and everything else are refused by name), and the sizes that
could make a short expression expensive are bounded (its length, its nesting, the exponent of ``**`` and the
digits of any integer it builds).
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from hybridrl.tools.base import Tool, ToolResult, argument

#: longest expression accepted (characters).
MAX_LENGTH = 200
#: largest |exponent| of ``**``, and most digits of an integer result, so ``9**9**9`` cannot stall a worker.
MAX_EXPONENT = 256
MAX_DIGITS = 100

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or is out of bounds."""


#: integers past this many bits have more than ``MAX_DIGITS`` digits (checked without printing them).
_MAX_BITS = int(MAX_DIGITS / math.log10(2)) + 1


def _number(value: Any) -> int | float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError(f"only numbers are allowed, got {value!r}")
    if isinstance(value, int) and value.bit_length() > _MAX_BITS:
        raise CalculatorError(f"a number of more than {MAX_DIGITS} digits")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    return value


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        return _number(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _number(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and left.bit_length() * abs(right) > 4 * _MAX_BITS:
            raise CalculatorError(f"a number of more than {MAX_DIGITS} digits")  # refused before computing it
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalculatorError("division by zero")
        try:
            return _number(_BINARY[type(node.op)](left, right))
        except OverflowError:
            raise CalculatorError("the result is too large") from None
    raise CalculatorError(f"'{type(node).__name__}' is not allowed (numbers, + - * / // % ** and parentheses only)")


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression; ``CalculatorError`` says why one is refused."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be a string, got {type(expression).__name__}")
    text = expression.strip().replace("^", "**")
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_LENGTH:
        raise CalculatorError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes
        raise CalculatorError(f"not an expression: {getattr(exc, 'msg', exc)}") from None
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None
    try:
        return _evaluate(tree)
    except RecursionError:
        raise CalculatorError("expression nested too deeply") from None


def format_number(value: int | float) -> str:
    """Integers (and floats holding one) without a decimal point, other floats to 12 significant digits."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.12g}"
    return str(value)


class Calculator(Tool):
    """Evaluate an arithmetic expression (``{"expression": "47+85"}``); the result as text, e.g. ``132``."""

    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses."
    parameters = {"type": "object",
                  "properties": {"expression": {"type": "string", "description": "for example 12*(3+4)"}},
                  "required": ["expression"]}

    def run(self, arguments: dict[str, Any]) -> ToolResult:
        try:
            return ToolResult(format_number(evaluate(argument(arguments, "expression", self.name))))
        except (CalculatorError, ValueError) as exc:
            return ToolResult.failure(f"error: {exc}")
