"""Finding the final answer in a response: the last box, else the last number literal."""

import pytest

from keel.rewards.answers import final_answer, is_lone_number, last_boxed, split_percent


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("first 12, then 82", "82"),
        (r"\boxed{\frac{1}{3}} or \boxed{\frac{2}{3}}", r"\frac{2}{3}"),
        (r"\boxed{\frac{a}{b}", None),  # its brace never closes, and b is no number
        ("The answer is 82.", "82"),
        ("x^2", None),
        ("x ^ 2", None),
        ("3 * 4", None),
        ("3-5", None),
        ("x - 5", None),
        ("1+x", None),
        ("5 - 3", None),
        ("12 - not bad", "12"),
        ("so -5", "-5"),
        (r"3\sqrt{2}", None),
        ("12a", None),
        ("2.5.", "2.5"),
        (r"5\text{ cm}", "5"),
        (r"1\,000", "1000"),
        ("1,000", "1,000"),
        (r"$\frac{1}{2}$", r"\frac{1}{2}"),
        ("50%", "50%"),
        ("no number", None),
    ],
)
def test_final_answer(text, answer):
    assert final_answer(text) == answer


def test_last_boxed_balances_nested_braces():
    assert last_boxed(r"x \boxed{\frac{1}{\sqrt{2}}} y") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed("no box") is None


def test_is_lone_number():
    assert is_lone_number(" 82\n") and is_lone_number(r"\frac{1}{2}") and is_lone_number("-3")
    assert not is_lone_number("it is 82") and not is_lone_number(r"\boxed{82}")


def test_split_percent():
    assert split_percent(r"50\%") == ("50", True)
    assert split_percent("50") == ("50", False)
