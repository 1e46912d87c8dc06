"""PPO-clip policy loss with dual-clip (ALGORITHMS.md §3), ε_low = ε_high = 0.2, c = 3."""

import functools
import math

import pytest
import torch

from keel.algo import AGG_MODES, loss_denominators, ppo_clip_loss

assert_close = functools.partial(torch.testing.assert_close, atol=1e-5, rtol=1e-4)
NAN = float("nan")


def _log(ratios):
    return torch.tensor([[math.log(r) for r in ratios]])


def test_ratio_one_gives_minus_mean_advantage_and_no_clipping():
    adv = torch.tensor([[1.0, -2.0, 0.5], [3.0, -1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    lp = torch.tensor([[-1.0, -0.5, -2.0], [-0.1, -3.0, -1.0]], requires_grad=True)
    out = ppo_clip_loss(lp, lp.detach().clone(), adv, mask)
    out.loss.backward()
    assert_close(out.loss.detach(), torch.tensor(-(1.0 - 2.0 + 0.5 + 3.0 - 1.0) / 5))
    assert_close(lp.grad, -adv * mask / 5)  # dL/dℓ = −A·ρ / N_tok, ρ = 1
    assert out.clipfrac.item() == 0.0
    assert out.clipfrac_lower.item() == 0.0
    assert out.ppo_kl.item() == 0.0


def test_hand_computed_clipped_tokens_and_strict_clipfrac():
    """Per token (A, ρ) → L1 = −Aρ, L2 = −A·clip(ρ, 0.8, 1.2), L = max:
    (+1, 1.5): −1.5 vs −1.2 → −1.2 clipped; (−1, 0.5): 0.5 vs 0.8 → 0.8 clipped;
    (+1, 0.5): −0.5 vs −0.8 → −0.5;         (−2, 1.1): 2.2 vs 2.2 → 2.2, tie is not clipped.
    token-mean = (−1.2 + 0.8 − 0.5 + 2.2)/4 = 0.325; clipfrac = 2/4."""
    lp = torch.zeros(1, 4)
    old = -_log([1.5, 0.5, 0.5, 1.1])
    adv = torch.tensor([[1.0, -1.0, 1.0, -2.0]])
    out = ppo_clip_loss(lp, old, adv, torch.ones(1, 4))
    assert_close(out.loss, torch.tensor(0.325))
    assert_close(out.clipfrac, torch.tensor(0.5))
    assert out.clipfrac_lower.item() == 0.0
    assert_close(out.ppo_kl, torch.tensor(-math.log(1.5 * 0.5 * 0.5 * 1.1) / 4))


def test_clipped_tokens_get_zero_gradient():
    lp = torch.zeros(1, 4, requires_grad=True)
    old = -_log([1.5, 0.5, 0.5, 1.1])
    adv = torch.tensor([[1.0, -1.0, 1.0, -2.0]])
    ppo_clip_loss(lp, old, adv, torch.ones(1, 4)).loss.backward()
    assert_close(lp.grad, torch.tensor([[0.0, 0.0, -0.5 / 4, 2.2 / 4]]))  # −A·ρ/N unclipped


def test_dual_clip_applies_only_to_negative_advantages():
    """ρ = 10 everywhere. (A=−1): max(10, 1.2) = 10 → min(10, 3) = 3 = 3|A|;
    (A=+1): max(−10, −1.2) = −1.2, no dual clip; (A=−0.5): max(5, 0.6) = 5 → min(5, 1.5) = 1.5.
    token-sum = 3.3; clipfrac = 1/3 (the A>0 token); clipfrac_lower = 2/3."""
    lp = torch.zeros(1, 3, requires_grad=True)
    old = -_log([10.0, 10.0, 10.0])
    adv = torch.tensor([[-1.0, 1.0, -0.5]])
    out = ppo_clip_loss(lp, old, adv, torch.ones(1, 3), agg_mode="token-sum")
    out.loss.backward()
    assert_close(out.loss.detach(), torch.tensor(3.3))
    assert_close(out.clipfrac, torch.tensor(1 / 3))
    assert_close(out.clipfrac_lower, torch.tensor(2 / 3))
    assert torch.equal(lp.grad, torch.zeros(1, 3))  # every token is clipped: constant loss


def test_infinite_clip_ratio_c_disables_dual_clip():
    """Same tokens as above plus a masked one: per token 10, −1.2, 5 → token-sum 13.8."""
    lp = torch.zeros(1, 4, requires_grad=True)
    old = -_log([10.0, 10.0, 10.0, 1.0])
    adv = torch.tensor([[-1.0, 1.0, -0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = ppo_clip_loss(lp, old, adv, mask, clip_ratio_c=math.inf, agg_mode="token-sum")
    out.loss.backward()
    assert_close(out.loss.detach(), torch.tensor(13.8))
    assert out.clipfrac_lower.item() == 0.0
    assert_close(lp.grad, torch.tensor([[10.0, 0.0, 5.0, 0.0]]))


def test_clipfrac_lower_counts_only_dual_clipped_tokens():
    """(A=−1, ρ=10): 10 > 3 yes; (A=−1, ρ=2): max(2, 1.2) = 2 < 3 no; (A=+1, ρ=10) no;
    4th token masked (would count) ⇒ 1/3."""
    old = -_log([10.0, 2.0, 10.0, 10.0])
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]])
    out = ppo_clip_loss(torch.zeros(1, 4), old, adv, torch.tensor([[1, 1, 1, 0]]))
    assert_close(out.clipfrac_lower, torch.tensor(1 / 3))


@pytest.mark.parametrize("clip_ratio_c", [3.0, math.inf])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_nan_outside_mask_never_reaches_loss_or_gradient(mode, clip_ratio_c):
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])
    lp = torch.tensor([[-1.0, -2.0, NAN], [-0.5, NAN, NAN], [NAN, NAN, NAN]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.1, NAN], [-0.6, NAN, NAN], [NAN, NAN, NAN]])
    adv = torch.tensor([[1.0, -1.0, NAN], [-2.0, NAN, NAN], [NAN, NAN, NAN]])
    out = ppo_clip_loss(lp, old, adv, mask, agg_mode=mode, clip_ratio_c=clip_ratio_c)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    for metric in (out.clipfrac, out.clipfrac_lower, out.ppo_kl):
        assert torch.isfinite(metric)
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[~mask.bool()] == 0).all()
    assert (lp.grad[mask.bool()] != 0).any()


def _rollout(seed: int = 0):
    """8 x 6 batch with large log-ratios (clipping and dual-clip active), a fully masked row
    and a single-token row; garbage NaN outside the mask."""
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(8, 6, generator=gen) * 3.0
    old = lp + torch.randn(8, 6, generator=gen) * 0.8
    adv = torch.randn(8, 6, generator=gen)
    lengths = torch.tensor([6, 4, 0, 1, 5, 3, 6, 2])
    mask = (torch.arange(6) < lengths[:, None]).int()
    old[~mask.bool()] = NAN
    adv[~mask.bool()] = NAN
    return lp, old, adv, mask


def _loss_and_grad(mode, splits):
    lp, old, adv, mask = _rollout()
    leaf = lp.requires_grad_()
    num_tokens, num_seqs = loss_denominators(mask)
    total = sum(
        ppo_clip_loss(*chunk, agg_mode=mode, num_tokens=num_tokens, num_seqs=num_seqs).loss
        for chunk in zip(*(t.split(splits) for t in (leaf, old, adv, mask)), strict=True)
    )
    total.backward()
    return total.detach(), leaf.grad


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_with_global_denominators_give_same_loss_and_gradient(mode):
    one_loss, one_grad = _loss_and_grad(mode, [8])
    four_loss, four_grad = _loss_and_grad(mode, [2, 3, 1, 2])
    full = ppo_clip_loss(*_rollout(), agg_mode=mode)
    assert full.clipfrac > 0 and full.clipfrac_lower > 0  # both clip branches are exercised
    assert_close(one_loss, full.loss)
    assert_close(four_loss, one_loss)
    assert_close(four_grad, one_grad)
    assert torch.isfinite(one_grad).all()
