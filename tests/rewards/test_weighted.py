"""Several reward functions with weights: Σ weight · score per row, a mean per function, each
function under the error policy as a single reward.fn."""

import pickle

import pytest

from keel.rewards import RewardError, RewardScorer, Scorer, WeightedPart, WeightedRewardScorer
from keel.rewards.verifiers import numeric_match


def length(prompt, response, answer, **kwargs):
    return float(len(response)) * kwargs.get("scale", 1.0)


def fails_on_b(prompt, response, answer, **kwargs):
    if response == "b":
        raise RuntimeError("cannot score b")
    return 1.0


def scorer(parts, **policy):
    return WeightedRewardScorer(
        [WeightedPart(name, w, RewardScorer(fn, name=name, **policy)) for name, w, fn in parts]
    )


ROWS = (["p"] * 4, ["7", "12", "7", "abc"], ["7", "7", "12", "7"])


def test_the_reward_is_the_weighted_sum_and_each_function_has_its_mean():
    both = scorer([("accuracy", 1.0, numeric_match), ("length", -0.5, length)])
    scores, errors, metrics = both.score_parts(*ROWS)
    assert scores == [1.0 - 0.5, 0.0 - 1.0, 0.0 - 0.5, 0.0 - 1.5]
    assert errors == 0
    assert metrics == {"reward/accuracy": 0.25, "reward/length": pytest.approx(7 / 4)}
    assert both.score(*ROWS) == (scores, 0)


def test_each_function_gets_its_own_kwargs():
    parts = [
        WeightedPart("short", 1.0, RewardScorer(length, kwargs={"scale": 1.0})),
        WeightedPart("long", 1.0, RewardScorer(length, kwargs={"scale": 10.0})),
    ]
    _, _, metrics = WeightedRewardScorer(parts).score_parts(["p"], ["ab"], [None])
    assert metrics == {"reward/short": 2.0, "reward/long": 20.0}


def test_a_failing_function_falls_back_alone_and_is_counted():
    both = scorer(
        [("ok", 2.0, length), ("flaky", 1.0, fails_on_b)], on_error="fallback", fallback_score=-1.0
    )
    scores, errors, metrics = both.score_parts(["p"] * 3, ["a", "b", "cc"], [None] * 3)
    assert scores == [2.0 + 1.0, 2.0 - 1.0, 4.0 + 1.0]  # only flaky's row b fell back
    assert errors == 1
    assert metrics == {"reward/ok": pytest.approx(4 / 3), "reward/flaky": pytest.approx(1 / 3)}


def test_a_failing_function_under_raise_is_named():
    both = scorer([("ok", 1.0, length), ("flaky", 1.0, fails_on_b)])
    with pytest.raises(RewardError, match="reward function flaky failed on row 1"):
        both.score(["p"] * 2, ["a", "b"], [None] * 2)


def test_names_must_be_unique():
    with pytest.raises(ValueError, match="unique"):
        scorer([("a", 1.0, length), ("a", 1.0, length)])


def test_pickles_for_ray_workers():
    both = pickle.loads(pickle.dumps(scorer([("length", 1.0, length)])))
    assert both.score_parts(["p"], ["abc"], [None])[2] == {"reward/length": 3.0}
    assert both.hung_calls() == 0 and both.pop_warnings() == []


def test_both_scorers_are_scorers():
    assert isinstance(scorer([("length", 1.0, length)]), Scorer)
    assert isinstance(RewardScorer(length), Scorer)
