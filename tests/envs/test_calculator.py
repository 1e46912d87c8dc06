"""The calculator tool: arithmetic evaluated node by node, everything else refused by name."""

from __future__ import annotations

import pytest

from keel.envs.calculator import CalculatorTool, evaluate_arithmetic, format_number
from keel.envs.tool import ToolError


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("37*58", "2146"),
        ("2 + 3 * 4", "14"),
        ("(2 + 3) * 4", "20"),
        ("-2**2", "-4"),
        ("(-2)**2", "4"),
        ("-3 - -4", "1"),
        ("+5", "5"),
        ("7 / 2", "3.5"),
        ("8 / 2", "4.0"),
        ("7 // 2", "3"),
        ("-7 % 3", "2"),
        ("0.1 + 0.2", "0.30000000000000004"),
        ("2 ** -1", "0.5"),
        ("10 ** 100", "1" + "0" * 100),
        ("1_000 * 3", "3000"),
    ],
)
def test_the_calculator_evaluates_arithmetic(expression, value):
    assert CalculatorTool()({"expression": expression}) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('echo hi')", "a function call"),
        ("x + 1", "a name"),
        ("(1).real", "an attribute"),
        ("'a' * 3", "a constant"),
        ("[1, 2]", "List"),
        ("True + 1", "a constant"),
        ("2 ** 101", "exponents above 100"),
        ("9 ** 9 ** 9", "exponents above 100"),
        ("(10 ** 100) ** 100", "more than 1000 digits"),
        ("(10 ** 99 * 10 ** 99) ** 2 * (10 ** 99) ** 7", "more than 1000 digits"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("1e308 * 10", "not finite"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 1001, "longer than 1000"),
        ("-" * 990 + "1", "nested too deeply"),
    ],
)
def test_the_calculator_refuses_anything_else(expression, message):
    with pytest.raises(ToolError, match=message):
        CalculatorTool()({"expression": expression})


def test_the_calculator_checks_its_argument():
    with pytest.raises(ToolError, match="'expression' must be a string"):
        CalculatorTool()({"expr": "1+1"})
    assert CalculatorTool()({"expression": 12}) == "12"


def test_numbers_print_as_integers_or_floats():
    assert format_number(evaluate_arithmetic("6 * 7")) == "42"
    assert format_number(evaluate_arithmetic("1e20")) == "1e+20"
