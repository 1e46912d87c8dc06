"""Built-in verifiers: numeric_match and exact_match."""

from fractions import Fraction

import pytest

from keel.rewards import exact_match, extract_final_number, numeric_match


@pytest.mark.parametrize(
    ("response", "answer", "score"),
    [
        ("first 12, then 82", "82", 1.0),
        ("82, not 12", "82", 0.0),
        ("The answer is 82.", "82", 1.0),
        ("1,000", "1000", 1.0),
        ("-3", "-3.0", 1.0),
        ("0.5", "1/2", 1.0),
        ("x = 5/2", "2.50", 1.0),
        ("no number here", "82", 0.0),
    ],
)
def test_numeric_match_compares_final_number(response, answer, score):
    assert numeric_match("p", response, answer) == score


def test_numeric_match_strict_requires_only_the_number():
    assert numeric_match("p", " 82\n", "82", strict=True) == 1.0
    assert numeric_match("p", "it is 82", "82", strict=True) == 0.0
    assert numeric_match("p", "it is 82", "82", strict=False) == 1.0


def test_numeric_match_strict_still_compares_the_value():
    assert numeric_match("p", "83", "82", strict=True) == 0.0


def test_numeric_match_ignores_unknown_kwargs():
    assert numeric_match("p", "7", "7", unused=True) == 1.0


def test_numeric_match_without_answer_raises():
    with pytest.raises(ValueError, match="reference answer"):
        numeric_match("p", "82", None)


def test_extract_final_number():
    assert extract_final_number("a 1 then 3/4.") == Fraction(3, 4)
    assert extract_final_number("none") is None


@pytest.mark.parametrize(
    ("response", "answer", "score"),
    [(" abc \n", "abc", 1.0), ("abc", "abd", 0.0), ("ABC", "abc", 0.0), ("82", 82, 1.0)],
)
def test_exact_match(response, answer, score):
    assert exact_match("p", response, answer) == score


def test_exact_match_without_answer_raises():
    with pytest.raises(ValueError, match="reference answer"):
        exact_match("p", "x", None)


@pytest.mark.parametrize(
    ("response", "score"),
    [("82", 1.0), (" 40\n", 1.0), ("0", 1.0), ("-14", 1.0), ("81", 0.0), ("8a", 0.0), ("", 0.0),
     ("4.2", 0.0)],
)  # fmt: skip
def test_even_answer(response, score):
    from keel.rewards.verifiers import even_answer

    assert even_answer("1+1=", response, None) == score
