"""The built-in arithmetic task: seeded, disjoint splits with correct answers."""

import pytest

from keel.data import arithmetic_splits


def prompts(examples) -> list[str]:
    return [ex.prompt for ex in examples]


def test_same_seed_gives_same_splits():
    assert arithmetic_splits(9, "+", 10, seed=3) == arithmetic_splits(9, "+", 10, seed=3)


def test_different_seeds_hold_out_different_problems():
    _, held_a = arithmetic_splits(9, "+", 10, seed=0)
    _, held_b = arithmetic_splits(9, "+", 10, seed=1)
    assert prompts(held_a) != prompts(held_b)


def test_train_and_held_out_are_disjoint_and_cover_every_problem():
    train, held = arithmetic_splits(9, "+", 10, seed=0)
    assert len(held) == 10
    assert not set(prompts(train)) & set(prompts(held))
    assert len(set(prompts(train)) | set(prompts(held))) == 100  # (0..9)²


def test_answers_are_correct():
    train, held = arithmetic_splits(6, "+-*", 20, seed=0)
    for ex in train + held:
        assert ex.prompt.endswith("=")
        assert int(ex.answer) == eval(ex.prompt[:-1])
        assert ex.response == ex.answer


def test_all_three_operators_are_drawn():
    train, held = arithmetic_splits(5, "+-*", 5, seed=0)
    ops = {next(c for c in ex.prompt if c in "+-*") for ex in train + held}
    assert ops == {"+", "-", "*"}
    assert len(train) + len(held) == 3 * 6 * 6


def test_repeated_operator_does_not_duplicate_problems():
    train, held = arithmetic_splits(3, "++", 2, seed=0)
    assert len(train) + len(held) == 16


def test_eval_size_not_smaller_than_problem_count_raises():
    with pytest.raises(ValueError, match="eval_size"):
        arithmetic_splits(9, "+", 100, seed=0)
