"""Clipped value loss (docs/algorithms.md §3): hand values, clip fraction, masks, micro-batching."""

import functools

import pytest
import torch

from keel.algo import AGG_MODES, clipped_value_loss, loss_denominators

assert_close = functools.partial(torch.testing.assert_close, atol=1e-5, rtol=1e-4)
NAN = float("nan")


def test_value_clipping_by_hand():
    """V_old = 0, ε_v = 0.5. (V, Ret): (1, .8): unclipped .04, V̂ = .5 → .09, max .09 (clipped);
    (.3, 0): .09 vs .09, a tie is not clipped; (−1, .5): 2.25 vs V̂ = −.5 → 1.0, max 2.25.
    token-mean: ½·(.09 + .09 + 2.25)/3 = .405; vf_clipfrac 1/3. Gradient ½·∂max/∂V / 3:
    token 0 is clipped (0), token 1: 2·.3 → .1, token 2: 2·(−1.5) → −.5."""
    v = torch.tensor([[1.0, 0.3, -1.0]], requires_grad=True)
    loss, clipfrac = clipped_value_loss(
        v, torch.zeros(1, 3), torch.tensor([[0.8, 0.0, 0.5]]), torch.ones(1, 3),
        cliprange_value=0.5,
    )  # fmt: skip
    loss.backward()
    assert_close(loss.detach(), torch.tensor(0.405))
    assert_close(clipfrac, torch.tensor(1 / 3))
    assert_close(v.grad, torch.tensor([[0.0, 0.1, -0.5]]))


def test_no_clipping_is_half_the_squared_error():
    v, ret = torch.tensor([[2.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    loss, clipfrac = clipped_value_loss(v, v + 5, ret, torch.ones(1, 2), cliprange_value=None)
    assert_close(loss, torch.tensor(0.5 * (4.0 + 1.0) / 2))
    assert clipfrac.item() == 0.0


def _data(b=8, r=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 1, 3, 0, 5, 2, 4, 5])[:b]
    mask = (torch.arange(r)[None, :] < lengths[:, None]).float()
    v = torch.randn(b, r, generator=g)
    old = v + 0.8 * torch.randn(b, r, generator=g)
    ret = torch.randn(b, r, generator=g)
    for t in (v, old, ret):
        t[mask == 0] = NAN
    return v, old, ret, mask


def test_masked_positions_get_exactly_zero_gradient_and_padding_changes_nothing():
    v, old, ret, mask = _data()
    v.requires_grad_(True)
    loss, _ = clipped_value_loss(v, old, ret, mask, agg_mode="seq-mean-token-mean")
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.equal(v.grad[mask == 0], torch.zeros(int((mask == 0).sum())))
    pad = lambda x, val: torch.cat([x.detach(), torch.full((8, 3), val)], dim=1)  # noqa: E731
    loss2, _ = clipped_value_loss(
        pad(v, NAN), pad(old, NAN), pad(ret, NAN), pad(mask, 0.0), agg_mode="token-mean"
    )
    loss1, _ = clipped_value_loss(v.detach(), old, ret, mask, agg_mode="token-mean")
    assert_close(loss2, loss1)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_with_global_denominators_sum_to_the_full_loss(mode):
    """1 × 8 equals 8 × 1 (and 2 × 4) in value and gradient."""
    v, old, ret, mask = _data()
    n_tok, n_seq = loss_denominators(mask)

    def run(chunk):
        leaf = v.clone().requires_grad_(True)
        total = sum(
            clipped_value_loss(
                leaf[s : s + chunk], old[s : s + chunk], ret[s : s + chunk], mask[s : s + chunk],
                agg_mode=mode, num_tokens=n_tok, num_seqs=n_seq,
            )[0]
            for s in range(0, 8, chunk)
        )  # fmt: skip
        total.backward()
        return total.detach(), leaf.grad

    full, full_grad = run(8)
    for chunk in (1, 4):
        loss, grad = run(chunk)
        assert_close(loss, full)
        assert_close(grad, full_grad)
