"""keel.algo.distillation: the estimators, the top-k forward KL, the clamps, both modes and the
combination, each against numbers worked out by hand (docs/algorithms.md §12)."""

from __future__ import annotations

import math

import pytest
import torch

from keel.algo.distillation import (
    DistillationOptions,
    check_options,
    clamp_loss,
    combine_losses,
    distillation_loss,
    estimator_loss,
    merge_extremes,
    topk_forward_kl,
)

S = torch.tensor([[-1.0, -2.0, -0.5]])
T = torch.tensor([[-1.5, -1.0, -0.5]])
M = torch.tensor([[1.0, 1.0, 0.0]])


def _grad(mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    s = S.clone().requires_grad_(True)
    e = estimator_loss(s, T, mode)
    e.sum().backward()
    assert s.grad is not None
    return e.detach(), s.grad


@pytest.mark.parametrize("mode", ["kl", "k1"])
def test_k1_is_s_minus_tau_with_gradient_one(mode):
    e, g = _grad(mode)
    assert torch.allclose(e, torch.tensor([[0.5, -1.0, 0.0]]))
    assert torch.allclose(g, torch.ones(1, 3))


def test_abs_is_the_absolute_difference_with_the_sign_as_gradient():
    e, g = _grad("abs")
    assert torch.allclose(e, torch.tensor([[0.5, 1.0, 0.0]]))
    assert torch.allclose(g[:, :2], torch.tensor([[1.0, -1.0]]))


@pytest.mark.parametrize("mode", ["mse", "k2"])
def test_k2_is_half_the_squared_difference(mode):
    e, g = _grad(mode)
    assert torch.allclose(e, torch.tensor([[0.125, 0.5, 0.0]]))
    assert torch.allclose(g, torch.tensor([[0.5, -1.0, 0.0]]))


@pytest.mark.parametrize("mode", ["low_var_kl", "k3"])
def test_k3_by_hand_and_its_gradient_one_minus_the_ratio(mode):
    e, g = _grad(mode)
    # x = τ − s: −0.5, 1.0, 0 → e^x − x − 1
    want = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 2.0, 0.0]
    assert torch.allclose(e, torch.tensor([want]), atol=1e-6)
    assert torch.allclose(g, torch.tensor([[1 - math.exp(-0.5), 1 - math.e, 0.0]]), atol=1e-6)


def test_k3_is_clamped_at_10_and_a_clamped_token_has_no_gradient():
    s = torch.tensor([[-30.0, -1.0]], requires_grad=True)
    t = torch.tensor([[-1.0, -1.0]])  # x = 29 → clip 20 → e^20 − 21 → clamp 10
    e = estimator_loss(s, t, "k3")
    e.sum().backward()
    assert e[0, 0].item() == 10.0
    assert s.grad is not None and s.grad[0, 0].item() == 0.0


def test_k1_with_the_supervised_mode_is_an_error_and_topk_with_pg_a_warning():
    with pytest.raises(ValueError, match="use_policy_gradient"):
        DistillationOptions(loss_mode="k1", use_policy_gradient=False)
    with pytest.raises(ValueError, match="use_policy_gradient"):
        check_options("kl", False)
    assert check_options("k1", True) == []
    assert check_options("k3", False) == []
    (warning,) = check_options("forward_kl_topk", True)
    assert "forward_kl_topk" in warning
    with pytest.raises(ValueError, match="unknown"):
        check_options("k4", False)


def test_the_loss_clamp_bounds_both_sides_and_stops_the_gradient_there():
    e = torch.tensor([-5.0, -1.0, 2.0, 7.0], requires_grad=True)
    c = clamp_loss(e, 3.0)
    c.sum().backward()
    assert c.tolist() == [-3.0, -1.0, 2.0, 3.0]
    assert e.grad is not None and e.grad.tolist() == [0.0, 1.0, 1.0, 0.0]
    assert clamp_loss(e, None) is e


# --------------------------------------------------------------------------- top-k forward KL
def _topk_case():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0]]])  # [1, 1, V=4]
    ids = torch.tensor([[[1, 2]]])  # the teacher's top-2
    lam = torch.tensor([[[math.log(0.6), math.log(0.3)]]])
    return logits, ids, lam


def test_topk_forward_kl_by_hand_and_its_gradient_against_the_formula():
    logits, ids, lam = _topk_case()
    z = logits.clone().requires_grad_(True)
    out = topk_forward_kl(z, ids, lam)
    q = torch.log_softmax(logits, -1)[0, 0]
    d = 0.6 * (math.log(0.6) - q[1].item()) + 0.3 * (math.log(0.3) - q[2].item())
    assert out.loss.shape == (1, 1)
    assert out.loss.item() == pytest.approx(d, rel=1e-6)
    out.loss.sum().backward()
    p = torch.softmax(logits, -1)[0, 0]
    want = 0.6 * (p - torch.eye(4)[1]) + 0.3 * (p - torch.eye(4)[2])
    assert z.grad is not None
    assert torch.allclose(z.grad[0, 0], want, atol=1e-6)
    assert out.student_mass.item() == pytest.approx(float(p[1] + p[2]), rel=1e-6)
    assert out.teacher_mass.item() == pytest.approx(0.9, rel=1e-6)
    # the student's own top-2 are ids 0 and 1: the teacher's id 1 overlaps
    assert out.overlap_count.item() == 1.0
    adv = -0.6 * (math.log(0.6) - q[1].item())
    assert out.overlap_advantage.item() == pytest.approx(adv, rel=1e-6)


def test_topk_min_clamp_removes_a_clamped_student_entry_from_the_gradient():
    logits = torch.tensor([[[10.0, 0.0, -5.0]]])  # q_2 ≈ −15.0 < c = −10
    ids = torch.tensor([[[0, 2]]])
    lam = torch.tensor([[[math.log(0.5), math.log(0.5)]]])
    z = logits.clone().requires_grad_(True)
    out = topk_forward_kl(z, ids, lam, log_prob_min_clamp=-10.0)
    q = torch.log_softmax(logits, -1)[0, 0]
    d = 0.5 * (math.log(0.5) - q[0].item()) + 0.5 * (math.log(0.5) + 10.0)
    assert out.loss.item() == pytest.approx(d, rel=1e-6)
    out.loss.sum().backward()
    p = torch.softmax(logits, -1)[0, 0]
    assert z.grad is not None
    assert torch.allclose(z.grad[0, 0], 0.5 * (p - torch.eye(3)[0]), atol=1e-6)
    # masses are taken before the clamp
    assert out.student_mass.item() == pytest.approx(float(p[0] + p[2]), rel=1e-6)


def test_topk_kl_below_zero_is_truncated_to_zero_with_no_gradient():
    logits = torch.tensor([[[5.0, 0.0, 0.0]]])  # the student puts ~0.99 on id 0
    ids = torch.tensor([[[0]]])
    lam = torch.tensor([[[math.log(0.5)]]])  # 0.5·(log 0.5 − log 0.99) < 0
    z = logits.clone().requires_grad_(True)
    out = topk_forward_kl(z, ids, lam)
    assert out.loss.item() == 0.0
    out.loss.sum().backward()
    assert z.grad is not None and torch.all(z.grad == 0)


def test_topk_kl_matches_the_full_forward_kl_when_k_is_the_vocabulary():
    torch.manual_seed(0)
    z = torch.randn(2, 3, 5)
    t = torch.log_softmax(torch.randn(2, 3, 5), -1)
    lam, ids = t.sort(-1, descending=True)
    out = topk_forward_kl(z, ids, lam)
    full = (t.exp() * (t - torch.log_softmax(z, -1))).sum(-1)
    assert torch.allclose(out.loss, full, atol=1e-6)
    assert torch.allclose(out.overlap_count, torch.full((2, 3), 5.0))


# ------------------------------------------------------------------------------ the two modes
def test_supervised_mode_aggregates_the_clamped_loss_and_reports_pre_clamp_extremes():
    s = torch.tensor([[-1.0, -4.0, -0.5]], requires_grad=True)
    t = torch.tensor([[-1.5, -1.0, float("nan")]])  # NaN outside the mask never enters
    opts = DistillationOptions(loss_mode="k2", loss_max_clamp=2.0)
    out = distillation_loss(s, M, opts, teacher_logprobs=t)
    # e = 0.125, 4.5 → clamp 2 → token-mean 1.0625
    assert out.loss.item() == pytest.approx(1.0625)
    assert out.extremes["loss_min"].item() == pytest.approx(0.125)
    assert out.extremes["loss_max"].item() == pytest.approx(4.5)
    assert out.metrics["abs_loss"].item() == pytest.approx((0.125 + 4.5) / 2)
    assert out.metrics["loss"].item() == pytest.approx(1.0625)
    out.loss.backward()
    assert s.grad is not None
    assert torch.allclose(s.grad, torch.tensor([[0.25, 0.0, 0.0]]))  # (s−τ)/2 ; clamped: 0


def test_supervised_mode_lowers_the_reverse_kl_to_the_teacher():
    """A few gradient steps on a free categorical student: the exact KL(π_θ‖π_T) falls."""
    torch.manual_seed(0)
    teacher = torch.log_softmax(torch.tensor([2.0, 0.0, -1.0, 0.5]), -1)
    z = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([z], lr=0.5)

    def kl() -> float:
        q = torch.log_softmax(z.detach(), -1)
        return float((q.exp() * (q - teacher)).sum())

    before = kl()
    for _ in range(60):
        q = torch.log_softmax(z, -1)
        y = torch.multinomial(q.detach().exp(), 64, replacement=True)
        s = q[y][None]
        out = distillation_loss(
            s,
            torch.ones_like(s),
            DistillationOptions(loss_mode="k3"),
            teacher_logprobs=teacher[y][None],
        )
        opt.zero_grad()
        out.loss.backward()
        opt.step()
    assert kl() < 0.3 * before


def test_policy_gradient_mode_is_ppo_clip_with_advantage_minus_e():
    s = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.5, -0.5]])
    t = torch.tensor([[-1.5, -1.0, -0.5]])
    opts = DistillationOptions(loss_mode="k1", use_policy_gradient=True)
    out = distillation_loss(s, M, opts, teacher_logprobs=t, old_logprobs=old)
    # A = −(s − τ) = −0.5, +1.0. ratios: 1, e^0.5 ≈ 1.6487 → clipped at 1.2 for A > 0
    # token 1: max(0.5·1, 0.5·1) = 0.5; token 2: max(−1.6487, −1.2) = −1.2 → mean −0.35
    assert out.loss.item() == pytest.approx((0.5 - 1.2) / 2, rel=1e-5)
    assert out.metrics["pg_clipfrac"].item() == pytest.approx(0.5)
    assert out.metrics["ppo_kl"].item() == pytest.approx(-0.25)
    out.loss.backward()
    assert s.grad is not None
    # token 1: −A·ρ with ρ = 1 → ∂/∂s = −A = 0.5 / 2 tokens; token 2 clipped: 0
    assert torch.allclose(s.grad, torch.tensor([[0.25, 0.0, 0.0]]), atol=1e-6)


def test_policy_gradient_mode_pushes_tokens_the_teacher_likes_more_up():
    s = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    t = torch.tensor([[-0.5, -3.0]])  # the teacher likes token 1 more, token 2 less
    opts = DistillationOptions(loss_mode="k1", use_policy_gradient=True)
    out = distillation_loss(s, torch.ones(1, 2), opts, teacher_logprobs=t)
    out.loss.backward()
    assert s.grad is not None
    assert s.grad[0, 0] < 0 < s.grad[0, 1]  # minimising: ℓ of token 1 rises, of token 2 falls


def test_policy_gradient_dual_clip_bounds_a_negative_advantage_at_three():
    s = torch.tensor([[0.0]], requires_grad=True)
    old = torch.tensor([[-3.0]])  # ratio e^3 ≈ 20
    t = torch.tensor([[-1.0]])  # A = −(s − τ) = −1
    opts = DistillationOptions(loss_mode="k1", use_policy_gradient=True)
    out = distillation_loss(s, torch.ones(1, 1), opts, teacher_logprobs=t, old_logprobs=old)
    assert out.loss.item() == pytest.approx(3.0)  # min(max(20, 1.2), −c·A = 3)
    assert out.metrics["pg_clipfrac_lower"].item() == 1.0


def test_topk_mode_through_the_loss_reports_masses_and_overlap():
    logits, ids, lam = _topk_case()
    z = logits.clone().requires_grad_(True)
    s = torch.log_softmax(z, -1)[..., 0]
    opts = DistillationOptions(loss_mode="forward_kl_topk", topk=2)
    out = distillation_loss(
        s, torch.ones(1, 1), opts, student_logits=z, teacher_topk_ids=ids,
        teacher_topk_logprobs=lam,
    )  # fmt: skip
    direct = topk_forward_kl(logits, ids, lam)
    assert out.loss.item() == pytest.approx(direct.loss.item())
    assert out.metrics["overlap_ratio"].item() == pytest.approx(0.5)
    assert out.metrics["teacher_mass"].item() == pytest.approx(0.9, rel=1e-6)
    assert set(out.extremes) >= {"loss_min", "student_mass_min", "teacher_mass_max"}


def test_the_combination_adds_coef_times_distill_or_keeps_distill_alone():
    task, distill = torch.tensor(2.0), torch.tensor(0.5)
    assert combine_losses(task, distill, DistillationOptions(coef=0.1)).item() == pytest.approx(
        2.05
    )
    alone = DistillationOptions(use_task_rewards=False, coef=0.1)
    assert combine_losses(task, distill, alone).item() == 0.5


def test_extremes_merge_across_micro_batches_and_drop_empty_ones():
    parts = [
        {"loss_min": 0.5, "loss_max": 2.0},
        {"loss_min": 0.1, "loss_max": 1.0},
        {"loss_min": float("inf"), "loss_max": float("-inf")},
    ]
    assert merge_extremes(parts) == {"loss_min": 0.1, "loss_max": 2.0}
    assert merge_extremes([{"loss_min": float("inf")}]) == {}
