"""masked_sum / masked_mean / masked_whiten (docs/algorithms.md §0, §3 whitening)."""

import functools
import math

import pytest
import torch

from keel.algo import masked_explained_variance, masked_mean, masked_sum, masked_whiten

assert_close = functools.partial(torch.testing.assert_close, atol=1e-5, rtol=1e-4)
NAN = float("nan")

# Row 0: 1 + 2 + 3 = 6 over 3 tokens; row 1: 4 over 1 token (NaN garbage after it).
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, NAN, NAN]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_masked_sum_total_and_per_row_ignore_nan_outside_mask():
    assert_close(masked_sum(VALUES, MASK), torch.tensor(10.0))
    assert_close(masked_sum(VALUES, MASK, dim=1), torch.tensor([6.0, 4.0]))


def test_masked_mean_total_and_per_row_ignore_nan_outside_mask():
    assert_close(masked_mean(VALUES, MASK), torch.tensor(10.0 / 4))
    assert_close(masked_mean(VALUES, MASK, dim=1), torch.tensor([2.0, 4.0]))


def test_masked_mean_of_fully_masked_row_is_zero_not_nan():
    values = torch.tensor([[1.0, 2.0], [NAN, NAN]])
    mask = torch.tensor([[1, 1], [0, 0]])
    assert_close(masked_mean(values, mask, dim=1), torch.tensor([1.5, 0.0]))


def test_masked_sum_gradient_is_zero_outside_mask_even_for_nan_values():
    values = VALUES.clone().requires_grad_()
    masked_sum(values, MASK).backward()
    assert_close(values.grad, MASK.float())


def test_masked_whiten_uses_unbiased_variance():
    """x = [1, 2, 3, 4]: μ = 2.5, σ² = (2.25 + 0.25 + 0.25 + 2.25)/3 = 5/3 (Bessel)."""
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    sd = math.sqrt(5.0 / 3.0 + 1e-8)
    expected = torch.tensor([[-1.5, -0.5], [0.5, 1.5]]) / sd
    assert_close(masked_whiten(values, torch.ones(2, 2)), expected)


def test_masked_whiten_ignores_nan_outside_mask_and_returns_zero_there():
    values = torch.tensor([[1.0, 2.0, NAN], [3.0, 4.0, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    sd = math.sqrt(5.0 / 3.0 + 1e-8)
    expected = torch.tensor([[-1.5, -0.5, 0.0], [0.5, 1.5, 0.0]]) / sd
    assert_close(masked_whiten(values, mask), expected)


def test_masked_whiten_result_has_zero_mean_and_unit_unbiased_variance():
    torch.manual_seed(0)
    values = torch.randn(4, 6) * 3.0 + 2.0
    mask = (torch.rand(4, 6) > 0.3).int()
    out = masked_whiten(values, mask)
    valid = out[mask.bool()]
    assert_close(valid.mean(), torch.tensor(0.0))
    assert_close(valid.var(unbiased=True), torch.tensor(1.0))


@pytest.mark.parametrize("n_valid", [0, 1])
def test_masked_whiten_with_fewer_than_two_valid_values_raises(n_valid):
    mask = torch.zeros(2, 3)
    mask.view(-1)[:n_valid] = 1
    with pytest.raises(ValueError):
        masked_whiten(torch.randn(2, 3), mask)


def test_explained_variance_by_hand_and_masked_positions_ignored():
    targets = torch.tensor([[1.0, 2.0, 3.0, 99.0], [4.0, 5.0, 6.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])
    preds = torch.tensor([[1.5, 2.0, 2.5, -7.0], [4.0, 5.5, 6.0, float("nan")]])
    # valid targets 1..6: biased var 35/12; residuals -.5 0 .5 0 -.5 0: mean -1/12
    res = [-0.5, 0.0, 0.5, 0.0, -0.5, 0.0]
    mu = sum(res) / 6
    var_res = sum((r - mu) ** 2 for r in res) / 6
    expected = 1 - var_res / (35 / 12)
    got = masked_explained_variance(preds, targets, mask)
    assert math.isclose(float(got), expected, rel_tol=1e-6)
    assert float(masked_explained_variance(targets, targets, mask)) == 1.0
    mean_pred = torch.full_like(targets, 3.5)
    assert abs(float(masked_explained_variance(mean_pred, targets, mask))) < 1e-6


def test_explained_variance_of_constant_targets_is_nan():
    t = torch.ones(2, 3)
    assert math.isnan(float(masked_explained_variance(torch.zeros(2, 3), t, torch.ones(2, 3))))
