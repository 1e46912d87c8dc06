"""PPO-clip policy loss with dual-clip (docs/algorithms.md §3), ε_low = ε_high = 0.2, c = 3."""

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


# ---- GSPO (§6), DAPO (§5)
from keel.algo import POLICY_LOSSES, gspo_loss  # noqa: E402


def test_gspo_sequence_ratio_by_hand():
    """Row 0: ℓ − ℓ_old = [.1, .3, (masked)] → log s = .2; row 1: [−.4] → s = e^−.4.
    A = [+1, −1], wide clip: seq-mean of −A·s = (−e^.2 + e^−.4)/2.
    With ε = 0.1: s0 = 1.2214 → −clip = −1.1; s1 = .6703 → max(.6703, .9) = .9; loss −.1,
    both sequences clipped."""
    old = torch.zeros(2, 3)
    lp = torch.tensor([[0.1, 0.3, NAN], [-0.4, NAN, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([[1.0, 1.0, NAN], [-1.0, NAN, NAN]])
    wide = gspo_loss(lp, old, adv, mask, clip_ratio_low=10.0, clip_ratio_high=10.0)
    assert_close(wide.loss, torch.tensor((-math.exp(0.2) + math.exp(-0.4)) / 2))
    narrow = gspo_loss(lp, old, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.1)
    assert_close(narrow.loss, torch.tensor(-0.1))
    assert narrow.clipfrac.item() == 1.0


def test_gspo_gradient_weights_every_token_of_a_sequence_equally():
    """∂/∂ℓ_t of −A·s_i = −A·s_i/|y_i| for each valid token (unclipped); token variant equal."""
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    base = torch.tensor([[-0.9, -2.2, -0.4]])
    adv = torch.full((1, 3), 0.7)
    s = math.exp((0.1 - 0.2 + 0.1) / 3)
    for loss_fn in (POLICY_LOSSES["gspo"], POLICY_LOSSES["gspo_token"]):
        lp = base.clone().requires_grad_(True)
        out = loss_fn(lp, old, adv, torch.ones(1, 3), clip_ratio_low=1.0, clip_ratio_high=1.0)
        out.loss.backward()
        assert_close(out.loss.detach(), torch.tensor(-0.7 * s))
        assert_close(lp.grad, torch.full((1, 3), -0.7 * s / 3))


def _random_case(b=8, r=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 1, 3, 0, 5, 2, 4, 5])[:b]
    mask = (torch.arange(r)[None, :] < lengths[:, None]).float()
    old = -torch.rand(b, r, generator=g) * 3
    lp = old + 0.3 * torch.randn(b, r, generator=g)
    adv = torch.randn(b, 1, generator=g).expand(b, r).clone()
    for t in (old, lp, adv):
        t[mask == 0] = NAN
    return lp, old, adv, mask


def test_gspo_token_equals_gspo_when_advantages_are_per_sequence():
    lp, old, adv, mask = _random_case()
    grads = []
    for name in ("gspo", "gspo_token"):
        leaf = lp.clone().requires_grad_(True)
        out = POLICY_LOSSES[name](leaf, old, adv, mask, clip_ratio_low=0.1, clip_ratio_high=0.1)
        out.loss.backward()
        grads.append((out.loss.detach(), leaf.grad))
    assert_close(grads[0][0], grads[1][0])
    assert_close(grads[0][1], grads[1][1])


@pytest.mark.parametrize("mode", AGG_MODES)
def test_gspo_on_one_token_responses_equals_token_level_ppo_clip(mode):
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(16, 1, generator=g) * 2
    lp = old + 0.5 * torch.randn(16, 1, generator=g)
    adv = torch.randn(16, 1, generator=g)
    mask = torch.ones(16, 1)
    kw = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "agg_mode": mode}
    ppo = ppo_clip_loss(lp, old, adv, mask, clip_ratio_c=math.inf, **kw)
    for name in ("gspo", "gspo_token"):
        out = POLICY_LOSSES[name](lp, old, adv, mask, **kw)
        assert_close(out.loss, ppo.loss)
        assert_close(out.clipfrac, ppo.clipfrac)


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_gspo_micro_batching_padding_and_masked_gradients(name, mode):
    """1 × 8 equals 8 × 1 with global denominators; extra padding columns change nothing;
    positions outside the mask get exactly zero gradient."""
    lp, old, adv, mask = _random_case()
    n_tok, n_seq = loss_denominators(mask)
    fn = POLICY_LOSSES[name]

    def run(chunk, pad=0):
        cat = lambda x, v: torch.cat([x, torch.full((8, pad), v)], dim=1)  # noqa: E731
        leaf = cat(lp, NAN).requires_grad_(True)
        o, a, m = cat(old, NAN), cat(adv, NAN), cat(mask, 0.0)
        total = sum(
            fn(leaf[s : s + chunk], o[s : s + chunk], a[s : s + chunk], m[s : s + chunk],
               clip_ratio_low=0.05, clip_ratio_high=0.05, agg_mode=mode, num_tokens=n_tok,
               num_seqs=n_seq, scale_factor=5.0).loss
            for s in range(0, 8, chunk)
        )  # fmt: skip
        total.backward()
        return total.detach(), leaf.grad

    full, grad = run(8)
    assert torch.isfinite(full)
    assert torch.equal(grad[mask == 0], torch.zeros(int((mask == 0).sum())))
    for chunk, pad in ((1, 0), (4, 0), (8, 3)):
        loss, g = run(chunk, pad)
        assert_close(loss, full)
        assert_close(g[:, :5], grad)


def test_dapo_with_equal_clip_bounds_is_ppo_clip_and_clip_higher_differs():
    """DAPO's policy loss is PPO-clip with decoupled bounds: ε_high = ε_low gives exactly the
    symmetric PPO-clip; with ε_high = 0.28 a ratio of 1.25 at A > 0 is no longer clipped."""
    from keel.config.loading import validate
    from keel.recipes import build_spec

    def spec(high):
        return build_spec(validate({"models": {"actor": "x"}, "algorithm": {
            "name": "dapo", "clip_ratio_high": high, "clip_ratio_c": 3.0}}))  # fmt: skip

    lp, old, adv, mask = _random_case(seed=5)
    same = spec(0.2)
    dapo = POLICY_LOSSES[same.policy_loss](lp, old, adv, mask, **same.policy_loss_kwargs)
    ppo = ppo_clip_loss(lp, old, adv, mask)
    assert_close(dapo.loss, ppo.loss)
    higher = spec(0.28)
    one = (torch.zeros(1, 1), torch.full((1, 1), -math.log(1.25)), torch.ones(1, 1))
    ppo_one = ppo_clip_loss(*one, torch.ones(1, 1))
    dapo_one = POLICY_LOSSES[higher.policy_loss](
        *one, torch.ones(1, 1), **higher.policy_loss_kwargs
    )
    assert_close(ppo_one.loss, torch.tensor(-1.2))
    assert_close(dapo_one.loss, torch.tensor(-1.25))
