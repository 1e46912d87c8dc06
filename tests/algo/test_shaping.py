"""DAPO's soft overlong punishment and dynamic-sampling group filter (docs/algorithms.md §5)."""

import functools

import pytest
import torch

from keel.algo import overlong_penalty, varied_groups

assert_close = functools.partial(torch.testing.assert_close, atol=1e-5, rtol=1e-4)


def test_soft_overlong_punishment_by_hand():
    """L_max = 6, L_cache = 2: |y| ≤ 4 → 0; 5 → (4 − 5)/2 = −0.5; 6 → −1; factor scales it."""
    lengths = torch.tensor([1, 3, 4, 5, 6])
    out = overlong_penalty(lengths, max_length=6, buffer_length=2)
    assert_close(out, torch.tensor([0.0, 0.0, 0.0, -0.5, -1.0]))
    half = overlong_penalty(lengths, max_length=6, buffer_length=2, penalty_factor=0.5)
    assert_close(half, out * 0.5)


def test_paper_setting_expected_length_and_beyond():
    """Paper: L_max 20480, L_cache 4096. 16384 → 0; 18432 → −0.5; 20480 → −1; longer → −1."""
    out = overlong_penalty(
        torch.tensor([16384, 18432, 20480, 30000]), max_length=20480, buffer_length=4096
    )
    assert_close(out, torch.tensor([0.0, -0.5, -1.0, -1.0]))


@pytest.mark.parametrize("buffer", [0, 7])
def test_buffer_longer_than_the_budget_or_empty_is_an_error(buffer):
    with pytest.raises(ValueError, match="overlong buffer"):
        overlong_penalty(torch.tensor([1]), max_length=6, buffer_length=buffer)


def test_groups_with_all_equal_scores_are_dropped_singletons_kept():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([0, 0, 0, 1, 1, 2, 2, 3])
    keep = varied_groups(scores, groups)
    assert keep.tolist() == [False, False, False, True, True, False, False, True]
