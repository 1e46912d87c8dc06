"""GRPO outcome advantage (docs/algorithms.md §4): Â_i = (R_i − mean_g)/(std_g + ε), ε = 1e-6."""

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
    out = _adv([1.0, 2.0, 3.0, 6.0], [0, 0, 0, 0], norm_adv_by_std=False)
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


@pytest.mark.parametrize("norm_adv_by_std", [True, False])
def test_advantages_have_zero_mean_within_each_group(norm_adv_by_std):
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(24, generator=gen) * 3.0
    group_ids = torch.randint(0, 5, (24,), generator=gen) * 11
    out = grpo_outcome_advantage(
        scores, torch.ones(24, 1), group_ids, norm_adv_by_std=norm_adv_by_std
    )
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


# ---- GAE, RLOO, REINFORCE++ (§3, §7, §8)
from keel.algo import (  # noqa: E402
    ADVANTAGE_ESTIMATORS,
    discounted_returns,
    gae_advantage_return,
    masked_whiten,
    rloo_outcome_advantage,
    token_level_rewards,
)

NAN = float("nan")
HOLE_MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 1.0]])  # row 1 has a hole at t=1


def test_gae_two_by_four_by_hand_with_a_hole_in_the_mask():
    """γ = 0.9, λ = 0.5 (γλ = 0.45). Row 0, valid t=0..2, r = [0, 0, 1], V = [.5, .2, .4]:
    t2: δ = 1 − .4 = .6, A = .6, Ret = 1.0; t1: δ = .9·.4 − .2 = .16, A = .16 + .45·.6 = .43,
    Ret = .63; t0: δ = .9·.2 − .5 = −.32, A = −.32 + .45·.43 = −.1265, Ret = .3735.
    Row 1, valid t = 0, 2, 3, r = [−.1, ·, 0, 2], V = [1, ·, .5, 1.5]: t3: δ = .5, A = .5, Ret = 2;
    t2: δ = .9·1.5 − .5 = .85, A = .85 + .45·.5 = 1.075, Ret = 1.575; t1 is skipped (V_next = .5,
    g_next = 1.075 carry over); t0: δ = −.1 + .9·.5 − 1 = −.65, A = −.65 + .45·1.075 = −.16625,
    Ret = .83375."""
    rewards = torch.tensor([[0.0, 0.0, 1.0, NAN], [-0.1, NAN, 0.0, 2.0]])
    values = torch.tensor([[0.5, 0.2, 0.4, NAN], [1.0, NAN, 0.5, 1.5]])
    adv, ret = gae_advantage_return(rewards, values, HOLE_MASK, gamma=0.9, lam=0.5)
    assert_close(adv, torch.tensor([[-0.1265, 0.43, 0.6, 0.0], [-0.16625, 0.0, 1.075, 0.5]]))
    assert_close(ret, torch.tensor([[0.3735, 0.63, 1.0, 0.0], [0.83375, 0.0, 1.575, 2.0]]))


def test_gae_with_gamma_lambda_one_is_return_minus_value():
    rewards = torch.tensor([[0.0, 0.5, 1.0]])
    values = torch.tensor([[0.3, 0.1, -0.2]])
    adv, ret = gae_advantage_return(rewards, values, torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert_close(ret, torch.tensor([[1.5, 1.5, 1.0]]))
    assert_close(adv, ret - values)


def test_gae_estimator_whitens_advantages_but_returns_use_unwhitened_ones():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5)
    raw, ret = gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    adv, ret2 = ADVANTAGE_ESTIMATORS["gae"](
        token_rewards=rewards, response_mask=mask, group_ids=torch.arange(3), values=values,
        gamma=0.9, lam=0.8, norm_adv=True,
    )  # fmt: skip
    assert_close(ret2, ret)
    assert_close(adv, masked_whiten(raw, mask))
    assert_close(adv.mean(), torch.tensor(0.0))


def test_token_level_rewards_put_the_score_on_the_last_valid_token_and_kl_on_every_token():
    """r = −β·k·m + R at the last valid token; β = 0.1."""
    kl = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, NAN, 5.0, 6.0]])
    out = token_level_rewards(torch.tensor([1.0, 2.0]), HOLE_MASK, kl, 0.1)
    expected = torch.tensor([[-0.1, -0.2, -0.3 + 1.0, 0.0], [-0.4, 0.0, -0.5, -0.6 + 2.0]])
    assert_close(out, expected)
    assert_close(token_level_rewards(torch.tensor([1.0]), torch.zeros(1, 3)), torch.zeros(1, 3))


def test_rloo_leave_one_out_by_hand():
    """R = [1, 2, 3, 6]: Â_i = R_i − mean of the others = [1 − 11/3, 2 − 10/3, 3 − 3, 6 − 2];
    a singleton group keeps its score (verl loop)."""
    scores = torch.tensor([1.0, 2.0, 3.0, 6.0, 5.0])
    out = rloo_outcome_advantage(scores, torch.ones(5, 2), torch.tensor([0, 0, 0, 0, 1]))
    assert_close(out[:, 0], torch.tensor([-8 / 3, -4 / 3, 0.0, 4.0, 5.0]))
    assert_close(out[:, 1], out[:, 0])


def test_reinforce_pp_discounted_returns_skip_holes_and_whiten_over_the_batch():
    """γ = 0.5. Row 0: r = [−.1, −.2, 1] → G = [−.1 + .5·.3, −.2 + .5·1, 1] = [.05, .3, 1].
    Row 1: r = [.2, ·, 0, 2] → G3 = 2, G2 = 1, t1 skipped, G0 = .2 + .5·1 = .7."""
    rewards = torch.tensor([[-0.1, -0.2, 1.0, NAN], [0.2, NAN, 0.0, 2.0]])
    ret = discounted_returns(rewards, HOLE_MASK, gamma=0.5)
    assert_close(ret, torch.tensor([[0.05, 0.3, 1.0, 0.0], [0.7, 0.0, 1.0, 2.0]]))
    adv, _ = ADVANTAGE_ESTIMATORS["reinforce_pp"](
        token_rewards=rewards, response_mask=HOLE_MASK, group_ids=torch.arange(2), gamma=0.5
    )
    flat = [0.05, 0.3, 1.0, 0.7, 1.0, 2.0]
    mu, sd = sum(flat) / 6, math.sqrt(sum((x - sum(flat) / 6) ** 2 for x in flat) / 5)
    expected = torch.tensor([[0.05, 0.3, 1.0, mu], [0.7, mu, 1.0, 2.0]])
    assert_close(adv, torch.where(HOLE_MASK.bool(), (expected - mu) / sd, torch.zeros(())))


def test_reinforce_pp_baseline_subtracts_the_group_mean_then_whitens_by_token():
    """Scores [1, 3 | 2] (groups 0, 0, 1), lengths 2, 1, 3: R̃ = [−1, 1, 2] (singleton: mean 0);
    token values [−1, −1, 1, 2, 2, 2] are whitened together (weighted by token count)."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    rewards = token_level_rewards(torch.tensor([1.0, 3.0, 2.0]), mask)
    adv, ret = ADVANTAGE_ESTIMATORS["reinforce_pp_baseline"](
        token_rewards=rewards, response_mask=mask, group_ids=torch.tensor([0, 0, 1])
    )
    flat = [-1.0, -1.0, 1.0, 2.0, 2.0, 2.0]
    mu = sum(flat) / 6
    sd = math.sqrt(sum((x - mu) ** 2 for x in flat) / 5)
    expected = torch.tensor([[-1.0, -1.0, 0.0], [1.0, 0.0, 0.0], [2.0, 2.0, 2.0]])
    assert_close(adv, torch.where(mask.bool(), (expected - mu) / sd, torch.zeros(())))
    assert ret is None


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"])
def test_trailing_padding_never_changes_advantages_or_returns(name):
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    rewards = token_level_rewards(torch.randn(4, generator=g), mask, torch.randn(4, 3), 0.1)
    values = torch.randn(4, 3, generator=g)
    groups = torch.tensor([0, 0, 1, 1])
    fn = ADVANTAGE_ESTIMATORS[name]
    adv, ret = fn(token_rewards=rewards, response_mask=mask, group_ids=groups, values=values)
    pad = lambda x, v: torch.cat([x, torch.full((4, 2), v)], dim=1)  # noqa: E731
    adv2, ret2 = fn(token_rewards=pad(rewards, NAN), response_mask=pad(mask, 0.0),
                    group_ids=groups, values=pad(values, NAN))  # fmt: skip
    assert_close(adv2[:, :3], adv)
    assert torch.equal(adv2[:, 3:], torch.zeros(4, 2))
    if ret is not None:
        assert_close(ret2[:, :3], ret)


def test_grpo_advantages_are_zero_mean_within_every_group():
    g = torch.Generator().manual_seed(2)
    scores = torch.randint(0, 3, (24,), generator=g).float()
    groups = torch.arange(6).repeat_interleave(4)
    for norm in (True, False):
        adv = grpo_outcome_advantage(scores, torch.ones(24, 1), groups, norm_adv_by_std=norm)[:, 0]
        assert_close(adv.view(6, 4).sum(dim=1), torch.zeros(6))


def test_gae_over_holes_is_gae_over_the_policys_tokens_alone():
    """Multi-turn episodes (keel.envs): observation tokens are holes in the mask. GAE skips
    them (verl's multi-turn semantics): the result at the policy's tokens is GAE over those
    tokens squeezed together, and the rewards and values at the holes do not matter."""
    g = torch.Generator().manual_seed(0)
    b, r = 3, 9
    mask = torch.ones(b, r)
    mask[0, 2:5] = 0  # an observation between two turns
    mask[1, [1, 4, 5]] = 0
    mask[2, 7:] = 0  # padding
    rewards, values = torch.randn(b, r, generator=g), torch.randn(b, r, generator=g)
    adv, ret = gae_advantage_return(rewards, values, mask, gamma=0.9, lam=0.8)
    noisy = torch.where(mask.bool(), 0.0, torch.randn(b, r, generator=g) * 100)
    adv2, ret2 = gae_advantage_return(rewards + noisy, values - noisy, mask, gamma=0.9, lam=0.8)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)
    for i in range(b):
        keep = mask[i].bool()
        squeezed = gae_advantage_return(
            rewards[i, keep][None], values[i, keep][None], torch.ones(1, int(keep.sum())),
            gamma=0.9, lam=0.8,
        )  # fmt: skip
        torch.testing.assert_close(adv[i, keep], squeezed[0][0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ret[i, keep], squeezed[1][0], rtol=0, atol=1e-6)
        assert (adv[i, ~keep] == 0).all() and (ret[i, ~keep] == 0).all()
