"""RewardScorer: row-by-row scoring under on_error=raise / fallback."""

import math

import pytest

from keel.rewards import RewardError, RewardScorer, numeric_match


def fails_on_b(prompt, response, answer, **kwargs):
    if response == "b":
        raise KeyError("no b")
    return 1.0


def test_scores_every_row_with_kwargs():
    scorer = RewardScorer(numeric_match, kwargs={"strict": True})
    assert scorer.score(["p"] * 3, ["7", "x 7", "8"], ["7", "7", "7"]) == ([1.0, 0.0, 0.0], 0)


def test_on_error_raise_names_function_and_row():
    scorer = RewardScorer(fails_on_b, on_error="raise", name="my.py:fn")
    with pytest.raises(RewardError, match=r"my\.py:fn failed on row 1") as info:
        scorer.score(["p0", "p1"], ["a", "b"], [None, None])
    assert isinstance(info.value.__cause__, KeyError)


def test_on_error_fallback_scores_and_counts():
    scorer = RewardScorer(fails_on_b, on_error="fallback", fallback_score=-1.0)
    assert scorer.score(["p"] * 3, ["b", "a", "b"], [None] * 3) == ([-1.0, 1.0, -1.0], 2)


@pytest.mark.parametrize("bad", [math.nan, math.inf, "not a number", None])
def test_non_finite_or_non_numeric_return_is_an_error(bad):
    scorer = RewardScorer(lambda *a, **k: bad, on_error="fallback", fallback_score=0.5)
    assert scorer.score(["p"], ["r"], ["a"]) == ([0.5], 1)


def test_nan_return_raises_under_raise_policy():
    scorer = RewardScorer(lambda *a, **k: math.nan)
    with pytest.raises(RewardError, match="non-finite"):
        scorer.score(["p"], ["r"], ["a"])
