"""GRPO outcome advantage (ALGORITHMS.md §4): Â_i = (R_i − mean_g)/(std_g + ε), ε = 1e-6."""

import functools
import math

import pytest
import torch

from keel.algo import grpo_outcome_advantage

assert_close = functools.partial(torch.testing.assert_close, atol=1e-5, rtol=1e-4)
EPS = 1e-6


def _adv(scores, group_ids, mask=None, **kwargs):
    scores = torch.tensor(scores)
    mask = torch.ones(len(scores), 2) if mask is None else mask
    return grpo_outcome_advantage(scores, mask, torch.tensor(group_ids), **kwargs)


def test_hand_computed_group_of_four_with_std():
    """R = [1, 2, 3, 6]: mean 3, centred [-2, -1, 0, 3], unbiased var (4+1+0+9)/3 = 14/3."""
    std = math.sqrt(14 / 3)
    expected = torch.tensor([-2.0, -1.0, 0.0, 3.0]) / (std + EPS)
    assert_close(_adv([1.0, 2.0, 3.0, 6.0], [0, 0, 0, 0])[:, 0], expected)


def test_hand_computed_group_of_four_without_std():
    out = _adv([1.0, 2.0, 3.0, 6.0], [0, 0, 0, 0], norm_by_std=False)
    assert_close(out[:, 0], torch.tensor([-2.0, -1.0, 0.0, 3.0]))


def test_hand_computed_group_of_three_with_std():
    """R = [0, 0, 1]: mean 1/3, centred [-1/3, -1/3, 2/3], unbiased var (1/9+1/9+4/9)/2 = 1/3."""
    std = math.sqrt(1 / 3)
    expected = torch.tensor([-1 / 3, -1 / 3, 2 / 3]) / (std + EPS)
    assert_close(_adv([0.0, 0.0, 1.0], [5, 5, 5])[:, 0], expected)


def test_advantage_is_broadcast_to_every_token_of_the_response():
    out = _adv([1.0, 2.0, 3.0, 6.0], [0, 0, 0, 0])
    assert torch.equal(out[:, 0], out[:, 1])


@pytest.mark.parametrize(
    ("value", "group_size"), [(1.0, 4), (0.0, 3), (-2.5, 8), (0.1, 7), (0.9, 64)]
)
def test_all_equal_group_gives_exactly_zero(value, group_size):
    """Spec §4: all-equal group ⇒ Â = 0/(0 + ε) = 0, for any float score (e.g. 0.9 x 64)."""
    out = _adv([value] * group_size, [0] * group_size)
    worst = out.abs().max().item()
    assert worst == 0.0, f"all-equal group of {group_size} x {value} gave |Â| = {worst}, not 0"


def test_singleton_group_uses_mean_zero_std_one():
    out = _adv([5.0, 1.0, 3.0], [0, 1, 1])
    assert_close(out[0], torch.full((2,), 5.0 / (1.0 + EPS)))


def test_interleaved_group_ids():
    """Group 7 = R[0,2,4] = [1, 2, 3]: mean 2, std 1. Group 3 = R[1,3] = [10, 20]: mean 15,
    std sqrt(50)."""
    out = _adv([1.0, 10.0, 2.0, 20.0, 3.0], [7, 3, 7, 3, 7])
    s50 = math.sqrt(50.0) + EPS
    expected = torch.tensor([-1 / (1 + EPS), -5 / s50, 0.0, 5 / s50, 1 / (1 + EPS)])
    assert_close(out[:, 0], expected)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_advantages_have_zero_mean_within_each_group(norm_by_std):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(24, generator=gen) * 3.0
    group_ids = torch.randint(0, 5, (24,), generator=gen) * 11
    out = grpo_outcome_advantage(scores, torch.ones(24, 1), group_ids, norm_by_std=norm_by_std)
    for g in group_ids.unique():
        in_group = group_ids == g
        if in_group.sum() > 1:
            assert_close(out[in_group, 0].mean(), torch.tensor(0.0))


def test_output_is_zero_outside_response_mask():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    out = _adv([1.0, 2.0, 6.0], [0, 0, 0], mask=mask)
    adv = (torch.tensor([-2.0, -1.0, 3.0]) / (math.sqrt(7.0) + EPS))[:, None].expand(3, 3)
    assert_close(out, torch.where(mask.bool(), adv, torch.zeros(())))
    assert (out[~mask.bool()] == 0).all()
