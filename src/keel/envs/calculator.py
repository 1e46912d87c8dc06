"""The `calculator` tool: a safe arithmetic evaluator (parsed with `ast` and evaluated node by
node, never `eval`ed), with bounds on the expression, exponents and digits."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from keel.envs.tool import ToolError

# `Any` here: what Python's operators give for the parsed expression, before it is checked.

MAX_EXPRESSION_CHARS = 1000
MAX_EXPONENT = 100
MAX_DIGITS = 1000
_MAX_BITS = math.ceil(MAX_DIGITS * math.log2(10))

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression: numbers, + - * / // % **, unary + and -, and
    parentheses, nothing else (no names, calls or attributes: it is parsed with `ast` and
    evaluated node by node, never `eval`ed). Raises ToolError for anything else, for division by
    zero, exponents above MAX_EXPONENT, results above MAX_DIGITS digits or not finite."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"not an arithmetic expression: {exc.msg}") from None
    except (ValueError, RecursionError, MemoryError) as exc:
        raise ToolError(f"not an arithmetic expression: {exc}") from None
    try:
        return _evaluate(tree.body)
    except RecursionError:
        raise ToolError("expression nested too deeply") from None


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("result too large") from None
    raise ToolError(
        f"only numbers, + - * / // % ** and parentheses are allowed, not {_describe(node)}"
    )


def _describe(node: ast.AST) -> str:
    kinds = {
        ast.Name: "a name",
        ast.Call: "a function call",
        ast.Attribute: "an attribute",
        ast.Constant: "a constant",
    }
    return f"{kinds.get(type(node), type(node).__name__)}: {ast.unparse(node)[:40]!r}"


def _check_power(base: int | float, exponent: int | float) -> None:
    if exponent > MAX_EXPONENT:
        raise ToolError(f"exponents above {MAX_EXPONENT} are not allowed")
    if not (isinstance(base, int) and isinstance(exponent, int)):
        return  # a float power overflows to an error of its own, it does not grow unbounded
    if exponent > 0 and (abs(base).bit_length() - 1) * exponent > _MAX_BITS:
        raise ToolError(f"result would have more than {MAX_DIGITS} digits")


def _checked(value: Any) -> int | float:
    if isinstance(value, complex):
        raise ToolError("result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise ToolError("result is not finite")
    # the bit length says "maybe" cheaply, the decimal digits decide
    if (
        isinstance(value, int)
        and value.bit_length() > _MAX_BITS - 4
        and len(str(value)) > (MAX_DIGITS + (value < 0))
    ):
        raise ToolError(f"result has more than {MAX_DIGITS} digits")
    return value


def format_number(value: int | float) -> str:
    """An integer as an integer ("2146"), a float as Python's repr ("0.1", "4.0", "1e+20")."""
    return str(value) if isinstance(value, int) else repr(value)


class CalculatorTool:
    """`calculator`: evaluates {"expression": "..."} with evaluate_arithmetic."""

    name = "calculator"
    description = (
        "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses. "
        "Returns the value."
    )

    def __init__(self) -> None:
        self.parameters: dict[str, Any] = {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "for example (37 + 5) * 58 / 2"}
            },
            "required": ["expression"],
        }

    def __call__(self, arguments: dict[str, Any]) -> str:
        expression = arguments.get("expression")
        if isinstance(expression, (int, float)) and not isinstance(expression, bool):
            expression = repr(expression)
        if not isinstance(expression, str):
            raise ToolError("argument 'expression' must be a string, e.g. \"37*58\"")
        return format_number(evaluate_arithmetic(expression))
