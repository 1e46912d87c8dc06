"""Loss aggregation agg(L, m, mode) and micro-batch invariance (docs/algorithms.md §1).

Hand-computed example (3x4, row 2 fully masked):
    L = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    m = [[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    row sums 3 (n=2), 26 (n=4); row 2 excluded; |S| = 2, 6 valid tokens.
    token-mean 29/6; token-sum 29; seq-mean-token-mean (3/2 + 26/4)/2 = 4;
    seq-mean-token-sum (3 + 26)/2 = 14.5; seq-mean-token-sum-norm (3/K + 26/K)/2 = 29/(2K), K = 4.
"""

import functools

import pytest
import torch

from keel.algo import AGG_MODES, agg_loss, loss_denominators

assert_close = functools.partial(torch.testing.assert_close, atol=1e-5, rtol=1e-4)

L = torch.arange(1.0, 13.0).reshape(3, 4)
M = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
EXPECTED = {
    "token-mean": 29 / 6,
    "token-sum": 29.0,
    "seq-mean-token-mean": 4.0,
    "seq-mean-token-sum": 14.5,
    "seq-mean-token-sum-norm": 29 / 8,
}


@pytest.mark.parametrize("mode", AGG_MODES)
def test_hand_computed_value_with_fully_masked_row(mode):
    assert_close(agg_loss(L, M, mode), torch.tensor(EXPECTED[mode]))


def test_seq_mean_token_sum_norm_with_explicit_scale_factor():
    assert_close(agg_loss(L, M, "seq-mean-token-sum-norm", scale_factor=10.0), torch.tensor(1.45))


def test_loss_denominators_excludes_fully_masked_rows():
    assert loss_denominators(M) == (6, 2)


def test_unknown_mode_raises_value_error():
    with pytest.raises(ValueError):
        agg_loss(L, M, "seq-mean")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_empty_mask_gives_zero_loss_and_zero_gradient(mode):
    loss = torch.randn(2, 3, requires_grad=True)
    out = agg_loss(loss, torch.zeros(2, 3), mode)
    out.backward()
    assert out.item() == 0.0
    assert torch.equal(loss.grad, torch.zeros(2, 3))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_nan_outside_mask_never_reaches_loss_or_gradient(mode):
    garbage = L.clone()
    garbage[~M.bool()] = float("nan")
    garbage.requires_grad_()
    out = agg_loss(garbage, M, mode)
    out.backward()
    assert_close(out.detach(), torch.tensor(EXPECTED[mode]))
    assert torch.isfinite(garbage.grad).all()
    assert (garbage.grad[~M.bool()] == 0).all()


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """8 x 5 per-token loss; row 2 is fully masked, row 5 has a single valid token."""
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(8, 5, generator=gen)
    lengths = torch.tensor([5, 3, 0, 4, 2, 1, 5, 3])
    mask = (torch.arange(5) < lengths[:, None]).int()
    return loss, mask


def _loss_and_grad(loss, mask, mode, splits):
    leaf = loss.clone().requires_grad_()
    num_tokens, num_seqs = loss_denominators(mask)
    total = sum(
        agg_loss(chunk, m, mode, num_tokens=num_tokens, num_seqs=num_seqs)
        for chunk, m in zip(leaf.split(splits), mask.split(splits), strict=True)
    )
    total.backward()
    return total.detach(), leaf.grad


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_with_global_denominators_match_full_batch(mode):
    loss, mask = _batch()
    full = agg_loss(loss, mask, mode)
    one_value, one_grad = _loss_and_grad(loss, mask, mode, [8])
    four_value, four_grad = _loss_and_grad(loss, mask, mode, [3, 1, 2, 2])
    assert_close(one_value, full)
    assert_close(four_value, full)
    assert_close(four_grad, one_grad)
