"""Rollout-vs-trainer drift statistics and truncated importance sampling (keel.algo.drift), and
the policy losses' token weights."""

import functools
import math

import pytest
import torch

from keel.algo import (
    gspo_loss,
    logprob_drift,
    ppo_clip_loss,
    truncated_is_weights,
)
from keel.algo.policy_loss import gspo_token_loss

assert_close = functools.partial(torch.testing.assert_close, atol=1e-6, rtol=1e-5)
NAN = float("nan")
LN = math.log


def drift_batch():
    """4 response tokens with r = π_train/π_rollout = [1, 3, 0.5, 1.5]; garbage (NaN) in the
    two masked positions of row 1."""
    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, NAN, NAN]])
    d = torch.tensor([[0.0, LN(3), LN(0.5)], [LN(1.5), NAN, NAN]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    return rollout, rollout + d, mask


def test_drift_statistics_by_hand():
    """|d| = [0, ln 3, ln 2, ln 1.5]: mean ln(9)/4, max ln 3. k1 = mean(−d) = −ln(2.25)/4.
    k3 = mean(r − 1 − ln r) = (0 + (2 − ln 3) + (−0.5 + ln 2) + (0.5 − ln 1.5))/4
    = (2 − ln 2.25)/4. Cap 2: weights [1, 2, 0.5, 1.5], one clipped: 1/4, mean 5/4."""
    rollout, trainer, mask = drift_batch()
    out = logprob_drift(rollout, trainer, mask, tis_cap=2.0)
    approx = functools.partial(pytest.approx, rel=1e-6)
    assert out.abs_diff_mean.item() == approx(LN(9) / 4)
    assert out.abs_diff_max.item() == approx(LN(3))
    assert out.kl_k1.item() == approx(-LN(2.25) / 4)
    assert out.kl_k3.item() == approx((2 - LN(2.25)) / 4)
    assert out.tis_clip_frac.item() == 0.25
    assert out.tis_weight_mean.item() == approx(1.25)
    assert logprob_drift(rollout, trainer, mask).tis_clip_frac is None  # no cap: no TIS stats


def test_identical_logprobs_drift_zero_and_an_empty_mask_gives_zeros():
    rollout, _, mask = drift_batch()
    same = logprob_drift(rollout, rollout.clone(), mask, tis_cap=2.0)
    for value in (same.abs_diff_mean, same.abs_diff_max, same.kl_k1, same.kl_k3):
        assert value.item() == 0.0
    assert same.tis_clip_frac.item() == 0.0 and same.tis_weight_mean.item() == 1.0
    empty = logprob_drift(rollout, rollout + 1, torch.zeros_like(mask), tis_cap=2.0)
    assert empty.abs_diff_mean.item() == 0.0 and empty.abs_diff_max.item() == 0.0


def test_the_kl_of_a_tiny_gap_is_resolved():
    """A healthy engine's gap is ~1e-6 … 1e-4 nats, where k3 ≈ d²/2 is below float32's
    resolution next to 1: the estimate must still be d²/2, not 0 or rounding noise."""
    rollout = torch.full((2, 3), -2.0)
    for gap in (1e-4, 3e-6):
        d = torch.tensor([[gap, -gap, gap], [-gap, gap, -gap]])
        out = logprob_drift(rollout, rollout + d, torch.ones(2, 3))
        exact = ((rollout + d).double() - rollout.double()) ** 2 / 2  # the float32 inputs' d
        assert out.kl_k3.item() == pytest.approx(exact.mean().item(), rel=1e-3)


def test_k3_is_unbiased_for_the_kl_between_two_categoricals():
    """Tokens sampled from π_rollout: the k3 and k1 means approach KL(π_rollout ‖ π_train)."""
    g = torch.Generator().manual_seed(0)
    p_rollout = torch.tensor([0.5, 0.3, 0.2])
    p_train = torch.tensor([0.4, 0.35, 0.25])
    exact = float((p_rollout * (p_rollout / p_train).log()).sum())
    tokens = torch.multinomial(p_rollout, 200_000, replacement=True, generator=g)[None]
    out = logprob_drift(p_rollout.log()[tokens], p_train.log()[tokens], torch.ones_like(tokens))
    assert out.kl_k3.item() == pytest.approx(exact, rel=0.05)
    assert out.kl_k1.item() == pytest.approx(exact, rel=0.2)


def test_tis_weights_are_capped_detached_and_one_outside_the_mask():
    rollout, trainer, mask = drift_batch()
    trainer.requires_grad_(True)
    w = truncated_is_weights(trainer, rollout, mask, cap=2.0)
    assert not w.requires_grad
    assert_close(w, torch.tensor([[1.0, 2.0, 0.5], [1.5, 1.0, 1.0]]))  # r = 3 → the cap 2
    huge = truncated_is_weights(torch.zeros(1, 1), torch.full((1, 1), -1e4), torch.ones(1, 1), 5)
    assert huge.item() == 5.0


def setup_loss(seed=0):
    """Ratios ρ = π_θ/π_old spread over clipped and unclipped values, mixed-sign advantages,
    a fully masked row and NaN garbage outside the mask; TIS weights with one capped token."""
    g = torch.Generator().manual_seed(seed)
    b, r = 4, 5
    mask = (torch.arange(r)[None] < torch.tensor([5, 3, 0, 4])[:, None]).float()
    lp = (-torch.rand(b, r, generator=g) * 2).requires_grad_(True)
    old = lp.detach() + torch.randn(b, r, generator=g) * 0.4
    adv = torch.randn(b, r, generator=g)
    rollout = old + torch.randn(b, r, generator=g) * 0.5
    rollout[0, 0] = old[0, 0] - 3.0  # r = e³ > cap
    for t in (old, adv, rollout):
        t[mask == 0] = NAN
    return lp, old, adv, mask, rollout


MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def grads(loss_fn, lp, *args, **kwargs):
    out = loss_fn(lp, *args, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out.loss.detach(), grad


@pytest.mark.parametrize("loss_fn", [ppo_clip_loss, gspo_loss, gspo_token_loss])
def test_weights_of_one_leave_the_loss_and_gradient_bit_for_bit(loss_fn):
    """Identical rollout and trainer log-probs give w = 1 everywhere: the TIS loss is the
    untruncated loss exactly (and token_weights=None is the code path of today)."""
    lp, old, adv, mask, _ = setup_loss()
    ones = truncated_is_weights(old, old.clone(), mask, cap=2.0)
    for mode in MODES:
        plain = grads(loss_fn, lp, old, adv, mask, agg_mode=mode)
        weighted = grads(loss_fn, lp, old, adv, mask, agg_mode=mode, token_weights=ones)
        assert torch.equal(plain[0], weighted[0]) and torch.equal(plain[1], weighted[1]), mode


@pytest.mark.parametrize("loss_fn", [ppo_clip_loss, gspo_token_loss])
@pytest.mark.parametrize("mode", MODES)
def test_tis_loss_equals_the_hand_weighted_loss(loss_fn, mode):
    """Token-level losses are positively homogeneous in A (max(−A·ρ·w, −A·clip(ρ)·w) =
    w·max(…), and the dual-clip bound −c·A·w scales too), so weighting token t by w_t is
    weighting its advantage by w_t: loss and gradient must agree, clipped tokens included."""
    lp, old, adv, mask, rollout = setup_loss()
    w = truncated_is_weights(old, rollout, mask, cap=2.0)
    assert w[0, 0].item() == 2.0  # the capped token
    tis = grads(loss_fn, lp, old, adv, mask, agg_mode=mode, token_weights=w)
    by_hand = grads(loss_fn, lp, old, adv * w, mask, agg_mode=mode)
    assert_close(tis[0], by_hand[0])
    assert_close(tis[1], by_hand[1])
    assert torch.isfinite(tis[1]).all()
    plain = grads(loss_fn, lp, old, adv, mask, agg_mode=mode)
    assert not torch.allclose(plain[1], tis[1])


def test_tis_gradient_by_hand_at_ratio_one():
    """ρ = 1 (on-policy update), token-mean: dL/dℓ_t = −A_t·w_t/N with w = min(r, 2)."""
    lp = torch.zeros(1, 4, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 2.0, 0.5]])
    rollout = -torch.tensor([[LN(0.5), LN(1.0), LN(3.0), LN(1.5)]])  # r = [0.5, 1, 3, 1.5]
    w = truncated_is_weights(lp.detach(), rollout, torch.ones(1, 4), cap=2.0)
    out = ppo_clip_loss(lp, lp.detach(), adv, torch.ones(1, 4), token_weights=w)
    out.loss.backward()
    expected = -adv * torch.tensor([[0.5, 1.0, 2.0, 1.5]]) / 4
    assert_close(lp.grad, expected)
    assert_close(out.loss.detach(), expected.sum())


def test_gspo_sequence_weights_scale_a_rows_term():
    """Sequence-level GSPO: a weight c_i on every token of row i scales that row's term by c_i,
    the same as scaling its advantage."""
    lp, old, adv, mask, _ = setup_loss()
    c = torch.tensor([0.5, 2.0, 1.0, 1.5])[:, None].expand(mask.shape)
    for mode in MODES:
        tis = grads(gspo_loss, lp, old, adv, mask, agg_mode=mode, token_weights=c)
        by_hand = grads(gspo_loss, lp, old, adv * c, mask, agg_mode=mode)
        assert_close(tis[0], by_hand[0])
        assert_close(tis[1], by_hand[1])
