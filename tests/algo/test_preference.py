"""Bradley–Terry and the DPO family against hand-computed values (docs/algorithms.md §9)."""

import pytest
import torch

from keel.algo.preference import (
    DPO_LOSSES,
    bradley_terry_loss,
    dpo_loss,
    dpo_pair_losses,
    per_token_logps,
    sequence_logps,
)

# Three pairs, β = 0.5. Log-ratios chosen = [0.5, -0.5, 0], rejected = [-0.5, 0.5, 0]
# ⇒ h = [1, -1, 0], βh = [0.5, -0.5, 0] (the third pair is a tie).
POLICY_W = torch.tensor([-1.0, -2.0, -1.5])
POLICY_L = torch.tensor([-2.0, -1.0, -1.5])
REF = torch.tensor([-1.5, -1.5, -1.5])
BETA = 0.5
# −log σ(x) for x = 0.5, −0.5, 0 worked out: log(1 + e^−x)
NLS = {0.5: 0.47407698418, -0.5: 0.97407698418, 0.0: 0.69314718056}

HAND = {
    # loss type, ε → per-pair losses
    ("sigmoid", 0.0): [NLS[0.5], NLS[-0.5], NLS[0.0]],
    # cDPO ε = 0.1: 0.9·(−log σ(βh)) + 0.1·(−log σ(−βh))
    ("cdpo", 0.1): [0.52407698418, 0.92407698418, NLS[0.0]],
    ("sigmoid", 0.1): [0.52407698418, 0.92407698418, NLS[0.0]],
    # robust ε = 0.1: (0.9·(−log σ(βh)) − 0.1·(−log σ(−βh))) / 0.8
    ("robust", 0.1): [0.41157698418, 1.03657698418, NLS[0.0]],
    # IPO, τ = β = 0.5: (h − 1)²
    ("ipo", 0.0): [0.0, 4.0, 1.0],
    # hinge: max(0, 1 − βh)
    ("hinge", 0.0): [0.5, 1.5, 1.0],
}


@pytest.mark.parametrize(("loss_type", "eps"), list(HAND), ids=lambda x: str(x))
def test_each_dpo_loss_by_hand(loss_type, eps):
    want = torch.tensor(HAND[(loss_type, eps)])
    out = dpo_loss(
        POLICY_W, POLICY_L, REF, REF, loss_type=loss_type, beta=BETA, label_smoothing=eps
    )
    torch.testing.assert_close(out.loss, want.mean(), atol=1e-5, rtol=1e-4)
    h = (POLICY_W - REF) - (POLICY_L - REF)
    per_pair = dpo_pair_losses(h, loss_type=loss_type, beta=BETA, label_smoothing=eps)
    torch.testing.assert_close(per_pair, want, atol=1e-5, rtol=1e-4)


def test_dpo_metrics_by_hand():
    m = dpo_loss(POLICY_W, POLICY_L, REF, REF, beta=BETA).metrics
    # chosen rewards β·[0.5, −0.5, 0] = [0.25, −0.25, 0]; rejected [−0.25, 0.25, 0]
    assert m["rewards/chosen"] == pytest.approx(0.0, abs=1e-7)
    assert m["rewards/rejected"] == pytest.approx(0.0, abs=1e-7)
    assert m["rewards/accuracies"] == pytest.approx(1 / 3)  # the tie is not accurate
    assert m["rewards/margins"] == pytest.approx((0.5 - 0.5 + 0) / 3, abs=1e-7)
    assert m["logps/chosen"] == pytest.approx(-1.5)
    assert m["logps/rejected"] == pytest.approx(-1.5)
    m = dpo_loss(POLICY_W[:1], POLICY_L[:1], REF[:1], REF[:1], beta=BETA).metrics
    assert m["rewards/chosen"] == pytest.approx(0.25)
    assert m["rewards/rejected"] == pytest.approx(-0.25)
    assert m["rewards/margins"] == pytest.approx(0.5)
    assert m["rewards/accuracies"] == 1.0
    assert m["dpo/loss"] == pytest.approx(NLS[0.5], rel=1e-6)


def test_reference_gets_no_gradient_and_policy_does():
    pw, pl = POLICY_W.clone().requires_grad_(), POLICY_L.clone().requires_grad_()
    ref = REF.clone().requires_grad_()
    dpo_loss(pw, pl, ref, ref, beta=BETA).loss.backward()
    assert ref.grad is None
    # d/dpw of mean(−log σ(β h)) = −β σ(−βh) / N
    want = -BETA * torch.sigmoid(-BETA * torch.tensor([1.0, -1.0, 0.0])) / 3
    torch.testing.assert_close(pw.grad, want)
    torch.testing.assert_close(pl.grad, -want)


def test_num_pairs_makes_micro_batches_add_up():
    whole = dpo_loss(POLICY_W, POLICY_L, REF, REF, beta=BETA)
    parts = [
        dpo_loss(POLICY_W[s], POLICY_L[s], REF[s], REF[s], beta=BETA, num_pairs=3)
        for s in (slice(0, 1), slice(1, 3))
    ]
    torch.testing.assert_close(parts[0].loss + parts[1].loss, whole.loss)
    for key, value in whole.metrics.items():
        assert parts[0].metrics[key] + parts[1].metrics[key] == pytest.approx(value, abs=1e-6)


def test_unknown_loss_and_bad_smoothing_are_errors():
    h = torch.zeros(2)
    with pytest.raises(ValueError, match="unknown DPO loss"):
        dpo_pair_losses(h, loss_type="kto", beta=0.1)
    with pytest.raises(ValueError, match=r"\[0, 0\.5\)"):
        dpo_pair_losses(h, loss_type="robust", beta=0.1, label_smoothing=0.5)
    assert set(DPO_LOSSES) == {"sigmoid", "cdpo", "robust", "ipo", "ipo_mean", "hinge"}


def test_bradley_terry_by_hand():
    chosen = torch.tensor([2.0, 0.0, 1.0])
    rejected = torch.tensor([1.0, 0.5, 1.0])  # differences 1, −0.5, 0 (a tie)
    out = bradley_terry_loss(chosen, rejected)
    # (log(1+e^−1) + log(1+e^0.5) + log 2) / 3
    assert out.loss.item() == pytest.approx(0.66016195075, rel=1e-6)
    assert out.metrics["rm/accuracy"] == pytest.approx(1 / 3)
    assert out.metrics["rm/margin"] == pytest.approx(0.5 / 3)
    assert out.metrics["rm/chosen"] == pytest.approx(1.0)
    assert out.metrics["rm/rejected"] == pytest.approx(2.5 / 3)


def test_padding_never_changes_a_preference_loss():
    """Sequence log-probs ignore positions outside the mask, even NaN; so do the losses and
    their gradients (exactly zero at padding)."""
    g = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(4, 3, generator=g)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    padded = torch.cat([logprobs, torch.full((4, 5), float("nan"))], dim=1).requires_grad_()
    padded_mask = torch.cat([mask, torch.zeros(4, 5)], dim=1)
    garbage = torch.where(mask.bool(), logprobs, torch.full_like(logprobs, float("nan")))
    base = sequence_logps(logprobs * mask, mask)
    torch.testing.assert_close(sequence_logps(garbage, mask), base)
    seq = sequence_logps(padded, padded_mask)
    torch.testing.assert_close(seq, base)
    ref = torch.tensor([-1.0, -1.2])
    n = padded_mask.sum(dim=1)
    lengths = {"chosen_lengths": n[0::2], "rejected_lengths": n[1::2]}
    for loss_type in DPO_LOSSES:
        want = dpo_loss(base[0::2], base[1::2], ref, ref, loss_type=loss_type, beta=0.3,
                        **lengths).loss  # fmt: skip
        got = dpo_loss(seq[0::2], seq[1::2], ref, ref, loss_type=loss_type, beta=0.3,
                       **lengths).loss  # fmt: skip
        torch.testing.assert_close(got, want)
    got.backward()
    assert torch.isfinite(padded.grad).all()
    assert (padded.grad[:, 3:] == 0).all()
    assert (padded.grad[:, :3][mask == 0] == 0).all()


# ipo_mean (TRL's IPO) on two pairs, β = 0.5 so 1/(2β) = 1. Completion lengths: chosen [2, 4],
# rejected [3, 2]. Per-token log-probs: policy_w / n_w = [−1, −0.25], ref_w / n_w = [−2, −0.25]
# ⇒ chosen log-ratios [1, 0]; policy_l / n_l = [−1, −1], ref_l / n_l = [−0.5, −0.5] ⇒ rejected
# log-ratios [−0.5, −0.5]; h = [1.5, 0.5]; losses (h − 1)² = [0.25, 0.25].
# The summed form (ipo): h = [2 − (−1.5), 0 − (−1)] = [3.5, 1]; losses [6.25, 0].
MEAN_W, MEAN_L = torch.tensor([-2.0, -1.0]), torch.tensor([-3.0, -2.0])
MEAN_REF_W, MEAN_REF_L = torch.tensor([-4.0, -1.0]), torch.tensor([-1.5, -1.0])
LEN_W, LEN_L = torch.tensor([2.0, 4.0]), torch.tensor([3.0, 2.0])


def test_ipo_mean_by_hand():
    pw, pl = MEAN_W.clone().requires_grad_(), MEAN_L.clone().requires_grad_()
    out = dpo_loss(pw, pl, MEAN_REF_W, MEAN_REF_L, loss_type="ipo_mean", beta=BETA,
                   chosen_lengths=LEN_W, rejected_lengths=LEN_L)  # fmt: skip
    assert out.loss.item() == pytest.approx(0.25, abs=1e-7)
    out.loss.backward()
    # d/dpw (h − 1)² / N = 2(h − 1) / (n_w N); d/dpl = −2(h − 1) / (n_l N)
    torch.testing.assert_close(pw.grad, torch.tensor([2 * 0.5 / 4, 2 * -0.5 / 8]))
    torch.testing.assert_close(pl.grad, torch.tensor([-2 * 0.5 / 6, -2 * -0.5 / 4]))
    m = out.metrics  # on the per-token scale, as TRL logs them
    assert m["dpo/loss"] == pytest.approx(0.25, abs=1e-7)
    assert m["rewards/chosen"] == pytest.approx(BETA * 0.5)
    assert m["rewards/rejected"] == pytest.approx(BETA * -0.5)
    assert m["rewards/margins"] == pytest.approx(0.5)
    assert m["rewards/accuracies"] == 1.0
    assert m["logps/chosen"] == pytest.approx(-0.625)
    assert m["logps/rejected"] == pytest.approx(-1.0)
    summed = dpo_loss(MEAN_W, MEAN_L, MEAN_REF_W, MEAN_REF_L, loss_type="ipo", beta=BETA,
                      chosen_lengths=LEN_W, rejected_lengths=LEN_L)  # fmt: skip
    assert summed.loss.item() == pytest.approx((6.25 + 0.0) / 2)  # lengths are ignored


def test_ipo_mean_equals_ipo_when_both_completions_have_one_token():
    ones = torch.ones(3)
    ipo = dpo_loss(POLICY_W, POLICY_L, REF, REF, loss_type="ipo", beta=BETA)
    mean = dpo_loss(POLICY_W, POLICY_L, REF, REF, loss_type="ipo_mean", beta=BETA,
                    chosen_lengths=ones, rejected_lengths=ones)  # fmt: skip
    assert torch.equal(mean.loss, ipo.loss)
    assert mean.metrics == ipo.metrics
    torch.testing.assert_close(mean.loss, torch.tensor(HAND[("ipo", 0.0)]).mean())


def test_ipo_mean_needs_lengths_and_adds_up_over_micro_batches():
    with pytest.raises(ValueError, match="chosen_lengths and rejected_lengths"):
        dpo_loss(MEAN_W, MEAN_L, MEAN_REF_W, MEAN_REF_L, loss_type="ipo_mean", beta=BETA)
    kw = {"loss_type": "ipo_mean", "beta": BETA, "num_pairs": 2}
    parts = []
    for s in (slice(0, 1), slice(1, 2)):
        lengths = {"chosen_lengths": LEN_W[s], "rejected_lengths": LEN_L[s]}
        parts.append(dpo_loss(MEAN_W[s], MEAN_L[s], MEAN_REF_W[s], MEAN_REF_L[s], **kw, **lengths))
    assert (parts[0].loss + parts[1].loss).item() == pytest.approx(0.25, abs=1e-7)


def test_per_token_logps_counts_an_empty_completion_as_one_token():
    got = per_token_logps(torch.tensor([-3.0, 0.0]), torch.tensor([3, 0]))
    assert got.tolist() == [-1.0, 0.0]
