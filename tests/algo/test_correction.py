"""Rollout correction (keel.algo.correction): IS weights, rejection, metrics and the bypass loss,
against numbers worked out by hand and against a plain-Python loop written from the formulas of
docs/algorithms.md §11 (verl 0.9.1's), one row and one token at a time."""

import functools
import math
from dataclasses import replace

import pytest
import torch

from keel.algo import POLICY_LOSSES, RS_OPTIONS, ppo_clip_loss
from keel.algo.correction import (
    CorrectionError,
    ISThreshold,
    RolloutCorrection,
    RSRule,
    bypass_loss,
    decoupled_correction,
    importance_weights,
    log_ratio,
    off_policy_metrics,
    parse_is_threshold,
    parse_rejection,
    probability_diagnostics,
    rejection_mask,
    resolve_correction,
    token_divergences,
)

LN = math.log
NAN = float("nan")
approx = functools.partial(pytest.approx, rel=1e-5, abs=1e-6)


def example():
    """δ = ℓ_old − ℓ_roll = [[ln 2, 0, ln ½], [ln 4, ln 3, ·]]: token ratios [[2, 1, ½], [4, 3]];
    garbage (NaN) at the masked position."""
    roll = torch.tensor([[-1.0, -0.5, -2.0], [-3.0, -1.5, NAN]])
    delta = torch.tensor([[LN(2), 0.0, LN(0.5)], [LN(4), LN(3), NAN]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    return roll + delta, roll, mask


def delta_of(old, roll, mask):
    return log_ratio(old, roll, mask)


# ----------------------------------------------------------------------- by hand
def test_token_tis_weights_and_metrics_by_hand():
    """U = 2: w = [[2, 1, ½], [2, 2]]. MM(w) = 7.5/5 = 1.5; ρ > 2 on 4 and 3: 2/5; ρ < ½: none.
    std = sqrt(MM(w²) − 1.5²) = sqrt(13.25/5 − 2.25) = sqrt(0.4); ESS = 1/(2.65/2.25).
    Row means s = [3.5/3, 2]; raw row means r = [3.5/3, 3.5]."""
    old, roll, mask = example()
    w, m = importance_weights(delta_of(old, roll, mask), mask, "token", ISThreshold(2.0))
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.5], [2.0, 2.0, 0.0]]))
    s0 = 3.5 / 3
    assert {k: v.item() for k, v in m.items()} == approx({
        "rollout_is_mean": 1.5,
        "rollout_is_ratio_fraction_high": 0.4,
        "rollout_is_ratio_fraction_low": 0.0,
        "rollout_is_max": 2.0,
        "rollout_is_min": 0.5,
        "rollout_is_std": math.sqrt(0.4),
        "rollout_is_eff_sample_size": 2.25 / 2.65,
        "rollout_is_seq_mean": (s0 + 2) / 2,
        "rollout_is_seq_std": (2 - s0) / math.sqrt(2),
        "rollout_is_seq_max": 2.0,
        "rollout_is_seq_min": s0,
        "rollout_is_seq_max_deviation": 1.0,
        "rollout_is_seq_fraction_high": 0.5,
        "rollout_is_seq_fraction_low": 0.0,
    })  # fmt: skip


def test_sequence_tis_weights_and_metrics_by_hand():
    """S = [ln2 + 0 + ln½, ln4 + ln3] = [0, ln 12]: ρ = 1 on row 0, 12 on row 1; U = 2 caps row
    1 at 2. MM(w) = 7/5; max = exp(min(ln 12, 20)) = 12, min = exp(0) = 1; S > ln 2 on one row
    of two."""
    old, roll, mask = example()
    w, m = importance_weights(delta_of(old, roll, mask), mask, "sequence", ISThreshold(2.0))
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]))
    assert m["rollout_is_mean"].item() == approx(1.4)
    assert m["rollout_is_max"].item() == approx(12.0)
    assert m["rollout_is_min"].item() == approx(1.0)
    assert m["rollout_is_ratio_fraction_high"].item() == 0.5
    assert m["rollout_is_ratio_fraction_low"].item() == 0.0
    assert m["rollout_is_seq_fraction_high"].item() == 0.5  # raw row means 1 and 12


def test_icepop_zeroes_the_tokens_outside_the_band_without_touching_the_mask():
    """'0.5_3': w = ρ·[½ ≤ ρ ≤ 3] (inclusive: ½ and 3 stay) = [[2, 1, ½], [0, 3]]; out of the
    band: only the 4, 1/5. L = lo = ½ for the low fractions."""
    old, roll, mask = example()
    threshold = parse_is_threshold("0.5_3")
    assert threshold == ISThreshold(3.0, 0.5)
    w, m = importance_weights(delta_of(old, roll, mask), mask, "token", threshold)
    torch.testing.assert_close(w, torch.tensor([[2.0, 1.0, 0.5], [0.0, 3.0, 0.0]]))
    assert m["rollout_is_oob_ratio"].item() == approx(0.2)
    assert m["rollout_is_ratio_fraction_high"].item() == approx(0.2)
    assert m["rollout_is_ratio_fraction_low"].item() == 0.0


def test_batch_normalisation_divides_by_the_batch_mean_and_reports_it():
    """Token: μ = MM(w) = 1.5. Sequence: μ = mean over valid rows of the row means [1, 2] = 1.5.
    The other metrics are of the weights before it; all-zero weights stay, factor 1."""
    old, roll, mask = example()
    d = delta_of(old, roll, mask)
    raw, _ = importance_weights(d, mask, "token", ISThreshold(2.0))
    w, m = importance_weights(d, mask, "token", ISThreshold(2.0), normalize=True)
    torch.testing.assert_close(w, raw / 1.5)
    assert m["rollout_is_batch_norm_factor"].item() == approx(1.5)
    assert m["rollout_is_mean"].item() == approx(1.5)  # before normalisation
    w, m = importance_weights(d, mask, "sequence", ISThreshold(2.0), normalize=True)
    torch.testing.assert_close(w, torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]) / 1.5)
    assert m["rollout_is_batch_norm_factor"].item() == approx(1.5)
    far = torch.full((1, 2), 30.0)  # ρ = e^20 is outside a band of [0.5, 3]: w = 0
    w, m = importance_weights(far, torch.ones(1, 2), "token", ISThreshold(3.0, 0.5),
                              normalize=True)  # fmt: skip
    assert w.sum().item() == 0.0 and m["rollout_is_batch_norm_factor"].item() == 1.0


def test_token_k1_rejection_bounds_the_inverse_ratio_as_verl_does():
    """k1 = −δ = log π_roll/π_old = [[−ln2, 0, ln2], [−ln4, −ln3]]; '0.4_2.5' keeps
    ln 0.4 ≤ k1 ≤ ln 2.5: all of row 0, none of row 1 (both below ln 0.4 = −0.92)."""
    old, roll, mask = example()
    rules = parse_rejection("token_k1", "0.4_2.5")
    keep, m = rejection_mask(delta_of(old, roll, mask), mask, rules)
    assert keep[mask.bool()].tolist() == [True, True, True, False, False]
    assert m["rollout_rs_masked_fraction"].item() == approx(0.4)
    assert m["rollout_rs_seq_masked_fraction"].item() == 0.5
    assert m["rollout_rs_token_k1_fraction_low"].item() == approx(0.4)
    assert m["rollout_rs_token_k1_fraction_high"].item() == 0.0
    assert m["rollout_rs_token_k1_mean"].item() == approx(-LN(12) / 5)
    assert m["rollout_rs_token_k1_seq_masked_fraction"].item() == 0.5
    # the direction: a ratio r = 2.2 (k1 = −ln 2.2) is kept by bounds on 1/r of [1/2.5, 1/0.4]
    # ... and an asymmetric band '0.8_1.5' keeps r ∈ [1/1.5, 1/0.8] = [0.667, 1.25]
    band = parse_rejection("token_k1", "0.8_1.5")
    d = torch.tensor([[LN(0.7), LN(1.2), LN(1.3), LN(0.6)]])
    keep, _ = rejection_mask(d, torch.ones(1, 4), band)
    assert keep.tolist() == [[True, True, False, False]]


def test_sequence_rejection_options_decide_for_the_whole_row():
    """seq_mean_k1 of row 1 = −ln 12/2 = −1.24 < ln 0.4: the row goes; seq_max_k2 with u = 0.3:
    row 0's max is ½ln²2 = 0.24 (kept), row 1's ½ln²4 = 0.96 (rejected); the options combine
    by AND (a single shared threshold string is split per option when given one per option)."""
    old, roll, mask = example()
    d = delta_of(old, roll, mask)
    keep, m = rejection_mask(d, mask, parse_rejection("seq_mean_k1", "0.4_2.5"))
    assert keep.tolist() == [[True, True, True], [False, False, False]]
    assert m["rollout_rs_seq_mean_k1_seq_mean"].item() == approx(-LN(12) / 4)
    assert m["rollout_rs_seq_mean_k1_min"].item() == approx(-LN(12) / 2)
    keep, m = rejection_mask(d, mask, parse_rejection("seq_max_k2", 0.3))
    assert keep.tolist() == [[True, True, True], [False, False, False]]
    assert m["rollout_rs_seq_max_k2_max"].item() == approx(0.5 * LN(4) ** 2)
    assert "rollout_rs_seq_max_k2_seq_fraction_low" not in m  # k1 options only
    both = parse_rejection("token_k2, seq_sum_k3", "0.3,100")
    keep, m = rejection_mask(d, mask, both)
    # token_k2 = ½δ²: ½ln²2 = 0.24 ≤ 0.3 kept, ½ln²4 = 0.96 and ½ln²3 = 0.60 rejected
    assert keep[mask.bool()].tolist() == [True, True, True, False, False]
    assert m["rollout_rs_token_k2_masked_fraction"].item() == approx(0.4)
    assert m["rollout_rs_seq_sum_k3_masked_fraction"].item() == 0.0


def test_divergences_by_hand():
    d = torch.tensor([LN(2), -30.0])
    k = token_divergences(d)
    assert k["k1"].tolist() == approx([-LN(2), 20.0])  # clipped at ±20
    assert k["k2"].tolist() == approx([0.5 * LN(2) ** 2, 200.0])
    assert k["k3"].tolist() == approx([2 - 1 - LN(2), math.exp(-20) - 1 + 20])


def test_off_policy_metrics_by_hand():
    """One row, ℓ_old = [−1, −2], ℓ_roll = [−1, −3]: δ = [0, 1]; training ppl exp(1.5), rollout
    ppl exp(2); kl = MM(ℓ_roll − ℓ_old) = −½; k3 = (e − 2)/2; D = −2 + 1.5 = −½;
    χ²_token = (1 + e²)/2 − 1, χ²_seq = e² − 1."""
    m = off_policy_metrics(torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.0, -3.0]]),
                           torch.ones(1, 2))  # fmt: skip
    assert {k: v.item() for k, v in m.items()} == approx({
        "training_ppl": math.exp(1.5), "training_log_ppl": 1.5,
        "rollout_ppl": math.exp(2.0), "rollout_log_ppl": 2.0,
        "kl": -0.5, "k3_kl": (math.e - 2) / 2,
        "log_ppl_diff": -0.5, "log_ppl_abs_diff": 0.5, "log_ppl_diff_max": -0.5,
        "log_ppl_diff_min": -0.5, "ppl_ratio": math.exp(-0.5),
        "chi2_token": (1 + math.e**2) / 2 - 1, "chi2_seq": math.e**2 - 1,
    })  # fmt: skip


def test_probability_diagnostics_by_hand():
    """p = exp(ℓ_old) = [½, ¼, ⅛], q = [½, ½, ⅛]: |p − q| = [0, ¼, 0]."""
    old = torch.tensor([[LN(0.5), LN(0.25), LN(0.125)]])
    roll = torch.tensor([[LN(0.5), LN(0.5), LN(0.125)]])
    m = probability_diagnostics(old, roll, torch.ones(1, 3))
    p, q = [0.5, 0.25, 0.125], [0.5, 0.5, 0.125]
    mp, mq = sum(p) / 3, sum(q) / 3
    cov = sum((a - mp) * (b - mq) for a, b in zip(p, q, strict=True))
    var_p = sum((a - mp) ** 2 for a in p)
    var_q = sum((b - mq) ** 2 for b in q)
    assert {k: v.item() for k, v in m.items()} == approx({
        "rollout_probs_diff_valid": 1.0, "rollout_probs_diff_max": 0.25,
        "rollout_probs_diff_mean": 0.25 / 3,
        "rollout_probs_diff_std": math.sqrt(((0.25 / 3) ** 2 * 2 + (0.25 - 0.25 / 3) ** 2) / 2),
        "rollout_actor_probs_pearson_corr": cov / math.sqrt(var_p * var_q),
    })  # fmt: skip


# ------------------------------------------------------------------ threshold parsing
def test_thresholds_parse_as_verl_does():
    assert parse_is_threshold(2.0) == ISThreshold(2.0)
    assert parse_is_threshold("2.5") == ISThreshold(2.5)
    assert parse_rejection("token_k1", 2.0) == (RSRule("token_k1", 2.0, 0.5),)  # u → 1/u_u
    assert parse_rejection(" seq_mean_k3 ,token_k1,seq_mean_k3", "0.01, 0.5_2") == (
        RSRule("seq_mean_k3", 0.01), RSRule("token_k1", 2.0, 0.5))  # fmt: skip
    assert parse_rejection("seq_max_k2,seq_sum_k2", 0.1) == (
        RSRule("seq_max_k2", 0.1), RSRule("seq_sum_k2", 0.1))  # fmt: skip
    assert parse_rejection(None, None) == ()


@pytest.mark.parametrize(("options", "threshold", "words"), [
    ("token_k4", 1.0, "unknown option 'token_k4'"),
    ("token_k2", "0.1_0.2", "k2/k3 options take one number"),
    ("token_k1", "2_0.5", "0 < lo ≤ hi"),
    ("token_k1", 0.5, "0 < lo ≤ hi"),
    ("seq_sum_k3", -1.0, "u > 0"),
    ("token_k2,token_k3", "1,2,3", "one threshold for all options or one per option (2"),
    ("token_k2", None, "rollout_rs_threshold is required"),
    ("token_k2", "abc", "not a number"),
])  # fmt: skip
def test_a_bad_rejection_setting_is_an_error_naming_the_key(options, threshold, words):
    with pytest.raises(CorrectionError, match="rollout_rs") as info:
        parse_rejection(options, threshold)
    assert words in str(info.value)


@pytest.mark.parametrize("value", [0, -1.0, "0.5", "3_2", "0_2", "a_b", "1_2_3", "inf"])
def test_a_bad_is_threshold_is_an_error_naming_the_key(value):
    if value == "0.5":  # a number as a string is fine (verl: float-like strings)
        assert parse_is_threshold(value) == ISThreshold(0.5)
        return
    with pytest.raises(CorrectionError, match="rollout_is_threshold"):
        parse_is_threshold(value)


def test_resolve_correction_reads_the_sections_keys():
    c = resolve_correction({"rollout_is": "sequence", "rollout_is_threshold": "0.5_5",
                            "rollout_is_batch_normalize": True, "rollout_rs": "seq_mean_k1",
                            "rollout_rs_threshold": "0.999_1.001", "bypass_mode": True,
                            "loss_type": "reinforce", "preset": None})  # fmt: skip
    assert c == RolloutCorrection(True, "sequence", ISThreshold(5.0, 0.5), True,
                                  (RSRule("seq_mean_k1", 1.001, 0.999),), "reinforce")  # fmt: skip
    assert resolve_correction({}).metrics_only and not resolve_correction({}).bypass
    with pytest.raises(CorrectionError, match="rollout_is 'row'"):
        resolve_correction({"rollout_is": "row"})


# --------------------------------------------------- against a loop over the formulas
def loop_reference(a, roll, mask, settings):
    """Every metric of docs/algorithms.md §11, with Python floats, one row/token at a time."""
    B = len(mask)
    rows = [[t for t in range(len(mask[b])) if mask[b][t]] for b in range(B)]
    N = sum(len(r) for r in rows)
    clip = lambda x: max(min(x, 20.0), -20.0)  # noqa: E731
    d = [[a[b][t] - roll[b][t] for t in range(len(mask[b]))] for b in range(B)]

    def mm(f):  # token mean over the mask
        return sum(f(b, t) for b in range(B) for t in rows[b]) / (N + 1e-8)

    def rm(f, b):
        return sum(f(b, t) for t in rows[b]) / (len(rows[b]) + 1e-8)

    def mean(xs):
        return sum(xs) / len(xs) if xs else 0.0

    def std(xs):
        if len(xs) < 2:
            return 0.0
        mu = mean(xs)
        return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))

    out, keep = {}, [[True] * len(mask[b]) for b in range(B)]
    seq_sum = [sum(d[b][t] for t in rows[b]) for b in range(B)]
    if settings.is_level is not None:
        th = settings.is_threshold
        U, L = th.upper, th.low
        if settings.is_level == "token":
            rho = [[math.exp(clip(d[b][t])) for t in range(len(mask[b]))] for b in range(B)]
        else:
            rho = [[math.exp(clip(seq_sum[b]))] * len(mask[b]) for b in range(B)]

        def w(b, t):
            r = rho[b][t]
            if th.lower is None:
                return min(r, U)
            return r if th.lower <= r <= U else 0.0

        valid_w = [w(b, t) for b in range(B) for t in rows[b]]
        out["rollout_is_mean"] = mm(w)
        if settings.is_level == "token":
            out["rollout_is_ratio_fraction_high"] = mm(lambda b, t: rho[b][t] > U)
            out["rollout_is_ratio_fraction_low"] = mm(lambda b, t: rho[b][t] < L)
            out["rollout_is_max"], out["rollout_is_min"] = max(valid_w), min(valid_w)
        else:
            out["rollout_is_max"] = math.exp(min(max(seq_sum), 20.0))
            out["rollout_is_min"] = math.exp(min(seq_sum))
            out["rollout_is_ratio_fraction_high"] = mean([s > math.log(U) for s in seq_sum])
            out["rollout_is_ratio_fraction_low"] = mean([s < math.log(L) for s in seq_sum])
        wt = lambda b, t: min(max(w(b, t), 0.0), U)  # noqa: E731
        mu = mm(wt)
        out["rollout_is_std"] = math.sqrt(max(mm(lambda b, t: wt(b, t) ** 2) - mu**2, 0.0))
        out["rollout_is_eff_sample_size"] = 1 / mm(lambda b, t: (wt(b, t) / (mu + 1e-8)) ** 2)
        s = [rm(w, b) for b in range(B)]
        out["rollout_is_seq_mean"], out["rollout_is_seq_std"] = mean(s), std(s)
        out["rollout_is_seq_max"], out["rollout_is_seq_min"] = max(s), min(s)
        out["rollout_is_seq_max_deviation"] = max(abs(x - 1) for x in s)
        r = [rm(lambda b, t: rho[b][t], b) for b in range(B)]
        out["rollout_is_seq_fraction_high"] = mean([x > U for x in r])
        out["rollout_is_seq_fraction_low"] = mean([x < L for x in r])
        if th.lower is not None:
            out["rollout_is_oob_ratio"] = mm(lambda b, t: not th.lower <= rho[b][t] <= U)
    k = {
        "k1": lambda b, t: -clip(d[b][t]),
        "k2": lambda b, t: 0.5 * clip(d[b][t]) ** 2,
        "k3": lambda b, t: math.exp(clip(d[b][t])) - 1 - clip(d[b][t]),
    }
    valid = [b for b in range(B) if rows[b]]

    def option(rule):
        kind, name = rule.option.rsplit("_", 1)
        f = k[name]
        if kind == "token":
            X, v = f, [rm(f, b) for b in valid]
        else:
            if kind == "seq_sum":
                row = [sum(f(b, t) for t in rows[b]) for b in range(B)]
            elif kind == "seq_mean":
                row = [rm(f, b) for b in range(B)]
            else:
                row = [max((f(b, t) for t in rows[b]), default=0.0) for b in range(B)]
            X, v = (lambda b, t, row=row: row[b]), [row[b] for b in valid]
        hi = math.log(rule.upper) if rule.k1 else rule.upper
        lo = math.log(rule.lower) if rule.k1 else 0.0
        keep_o = [[(lo <= X(b, t) <= hi) if rule.k1 else X(b, t) <= hi
                   for t in range(len(mask[b]))] for b in range(B)]  # fmt: skip
        p = f"rollout_rs_{rule.option}_"
        out[p + "mean"] = mm(X)
        if kind == "token":
            xs = [X(b, t) for b in range(B) for t in rows[b]]
            out[p + "max"], out[p + "min"] = max(xs), min(xs)
            out[p + "fraction_high"] = mm(lambda b, t: X(b, t) > hi)
            out[p + "fraction_low"] = mm(lambda b, t: X(b, t) < lo) if rule.k1 else 0.0
        else:
            out[p + "max"], out[p + "min"] = max(v), min(v)
            out[p + "fraction_high"] = mean([x > hi for x in v])
            out[p + "fraction_low"] = mean([x < lo for x in v]) if rule.k1 else 0.0
        xt = lambda b, t: min(max(X(b, t), lo), hi)  # noqa: E731
        out[p + "std"] = math.sqrt(max(mm(lambda b, t: xt(b, t) ** 2) - mm(xt) ** 2, 0.0))
        out[p + "seq_mean"], out[p + "seq_std"] = mean(v), std(v)
        out[p + "seq_max"], out[p + "seq_min"] = max(v), min(v)
        out[p + "seq_max_deviation"] = max(abs(x) for x in v)
        out[p + "seq_fraction_high"] = mean([x > hi for x in v])
        if rule.k1:
            out[p + "seq_fraction_low"] = mean([x < lo for x in v])
        out[p + "masked_fraction"] = mm(lambda b, t: not keep_o[b][t])
        out[p + "seq_masked_fraction"] = mean(
            [any(not keep_o[b][t] for t in rows[b]) for b in valid]
        )
        return keep_o

    for rule in settings.rejection:
        keep_o = option(rule)
        keep = [[keep[b][t] and keep_o[b][t] for t in range(len(mask[b]))] for b in range(B)]
    if settings.rejection:
        out["rollout_rs_masked_fraction"] = mm(lambda b, t: not keep[b][t])
        out["rollout_rs_seq_masked_fraction"] = mean(
            [any(not keep[b][t] for t in rows[b]) for b in range(B)]
        )
    ma = [rm(lambda b, t: a[b][t], b) for b in range(B)]
    mr = [rm(lambda b, t: roll[b][t], b) for b in range(B)]
    D = [mr[b] - ma[b] for b in range(B)]
    out.update({
        "training_ppl": mean([math.exp(-x) for x in ma]), "training_log_ppl": -mean(ma),
        "rollout_ppl": mean([math.exp(-x) for x in mr]), "rollout_log_ppl": -mean(mr),
        "kl": mm(lambda b, t: roll[b][t] - a[b][t]),
        "k3_kl": mm(lambda b, t: math.exp(d[b][t]) - d[b][t] - 1),
        "log_ppl_diff": mean(D), "log_ppl_abs_diff": mean([abs(x) for x in D]),
        "log_ppl_diff_max": max(D), "log_ppl_diff_min": min(D),
        "ppl_ratio": mean([math.exp(x) for x in D]),
        "chi2_token": mm(lambda b, t: math.exp(clip(d[b][t])) ** 2) - 1,
        "chi2_seq": mean([math.exp(2 * clip(s)) for s in seq_sum]) - 1,
    })  # fmt: skip
    return {"rollout_corr/" + key: value for key, value in out.items()}, keep


def random_batch(seed: int, scale: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    B, R = 5, 6
    lengths = torch.tensor([6, 3, 1, 4, 2])  # every row valid (an empty one: the test below)
    mask = (torch.arange(R)[None, :] < lengths[:, None]).float()
    roll = -torch.rand(B, R, generator=g) * 2 - 0.05
    old = roll + torch.randn(B, R, generator=g) * scale
    return old, roll, mask


SETTINGS = [
    RolloutCorrection(is_level="token", is_threshold=ISThreshold(1.5)),
    RolloutCorrection(is_level="sequence", is_threshold=ISThreshold(2.0)),
    RolloutCorrection(is_level="token", is_threshold=ISThreshold(2.0, 0.6)),
    RolloutCorrection(is_level="sequence", is_threshold=ISThreshold(3.0, 0.3)),
    RolloutCorrection(rejection=parse_rejection(",".join(RS_OPTIONS), 1.5)),
    RolloutCorrection(rejection=parse_rejection("token_k1,seq_sum_k1,seq_mean_k1", "0.7_1.8")),
    RolloutCorrection(rejection=parse_rejection("seq_mean_k3,seq_max_k2,token_k3", "0.05,0.2,0.1")),
    RolloutCorrection(),  # metrics only
]  # fmt: skip


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: s.describe())
@pytest.mark.parametrize("seed", [0, 1])
def test_every_metric_and_the_mask_match_the_loop(settings, seed):
    old, roll, mask = random_batch(seed)
    out = decoupled_correction(old, roll, mask, settings)
    expected, keep = loop_reference(old.tolist(), roll.tolist(), mask.tolist(), settings)
    got = {k: v.item() for k, v in out.metrics.items() if k.startswith("rollout_corr/")}
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=2e-4, abs=2e-5), key
    kept = torch.tensor(keep, dtype=torch.float32) * mask
    assert torch.equal(out.response_mask, kept)
    assert {k for k in out.metrics if k.startswith("training/")} == {
        "training/rollout_probs_diff_valid", "training/rollout_probs_diff_max",
        "training/rollout_probs_diff_mean", "training/rollout_probs_diff_std",
        "training/rollout_actor_probs_pearson_corr"}  # fmt: skip
    assert (out.weights is None) == (settings.is_level is None)


def test_an_empty_row_gives_zero_statistics_and_every_metric_stays_finite():
    old, roll, mask = random_batch(2)
    mask[2] = 0.0  # an empty row: RM 0; a row max of 0 (verl: -inf for seq_max_k*)
    settings = RolloutCorrection(is_level="sequence", batch_normalize=True,
                                 rejection=parse_rejection(",".join(RS_OPTIONS), 2.0))  # fmt: skip
    out = decoupled_correction(old, roll, mask, settings)
    assert all(math.isfinite(v.item()) for v in out.metrics.values())
    assert out.response_mask[2].sum() == 0 and out.weights[2].sum() == 0


# ---------------------------------------------------------------------- the two modes
def test_decoupled_weights_are_detached_and_the_mask_keeps_its_dtype():
    old, roll, mask = example()
    old = old.clone().requires_grad_()
    settings = resolve_correction({"rollout_is": "token", "rollout_rs": "token_k1",
                                   "rollout_rs_threshold": "0.4_2.5"})  # fmt: skip
    out = decoupled_correction(old, roll, mask, settings)
    assert not out.weights.requires_grad and out.response_mask.dtype == mask.dtype
    assert all(not v.requires_grad for v in out.metrics.values())


def bypass_inputs():
    """ℓ_θ (with grad), ℓ_roll, A, m: δ = ℓ_θ − ℓ_roll = [[ln 2, 0, ln ½], [ln 4, ln 3]]."""
    old, roll, mask = example()
    logprobs = old.clone().requires_grad_()
    adv = torch.tensor([[1.0, 1.0, 1.0], [-2.0, -2.0, NAN]])
    return logprobs, roll, adv, mask


def test_bypass_reinforce_gradient_is_minus_a_times_the_detached_weight():
    """L = −A·ℓ_θ·w, token TIS U = 2: w = [[2, 1, ½], [2, 2]]; token-mean over N = 5:
    ∂L/∂ℓ_t = −A_t·w_t/5 (no term through w: it is a constant of the loss)."""
    logprobs, roll, adv, mask = bypass_inputs()
    corr = resolve_correction({"rollout_is": "token", "bypass_mode": True,
                               "loss_type": "reinforce"})  # fmt: skip
    out = POLICY_LOSSES["bypass_mode"](logprobs, roll, adv, mask, correction=corr,
                                       agg_mode="token-mean", num_tokens=5)  # fmt: skip
    out.loss.backward()
    expected = torch.tensor([[-2.0, -1.0, -0.5], [4.0, 4.0, 0.0]]) / 5
    torch.testing.assert_close(logprobs.grad, expected)
    kl = ((-1.0 - 0.5 - 2.0 - 3.0 - 1.5) - logprobs.detach()[mask.bool()].sum().item()) / 5
    assert out.ppo_kl.item() == approx(kl)  # MM(ℓ_roll − ℓ_θ)
    assert out.metrics["rollout_corr/rollout_is_mean"].item() == approx(1.5)
    plain = bypass_loss(logprobs, roll, adv, mask, correction=replace(corr, is_level=None))
    logprobs.grad = None
    plain.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0] * 3, [2.0, 2.0, 0.0]]) / 5)


def test_bypass_rejection_masks_the_loss_but_the_denominator_is_the_callers():
    """token_k1 '0.4_2.5' rejects row 1: REINFORCE's gradient there is 0, and the token-mean
    denominator stays the 5 of m (verl: rejected tokens still count)."""
    logprobs, roll, adv, mask = bypass_inputs()
    corr = resolve_correction({"rollout_rs": "token_k1", "rollout_rs_threshold": "0.4_2.5",
                               "bypass_mode": True, "loss_type": "reinforce"})  # fmt: skip
    out = bypass_loss(logprobs, roll, adv, mask, correction=corr, num_tokens=5)
    out.loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-1.0] * 3, [0.0] * 3]) / 5)
    assert out.metrics["rollout_corr/rollout_rs_masked_fraction"].item() == approx(0.4)


def test_bypass_ppo_clip_is_ppo_against_the_engine_with_weights_for_metrics_only():
    """ppo_clip: the PPO-clip loss with ℓ_old := ℓ_roll on m' whatever the IS weights; the
    weights show in the metrics only."""
    logprobs, roll, adv, mask = bypass_inputs()
    corr = resolve_correction({"rollout_is": "token", "rollout_rs": "seq_max_k2",
                               "rollout_rs_threshold": 0.3, "bypass_mode": True})  # fmt: skip
    out = bypass_loss(logprobs, roll, adv, mask, correction=corr, num_tokens=5)
    kept = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    ref = ppo_clip_loss(logprobs, roll, adv, kept, num_tokens=5)
    assert out.loss.item() == approx(ref.loss.item())
    assert out.clipfrac.item() == approx(ref.clipfrac.item())
    assert out.ppo_kl.item() == approx(ref.ppo_kl.item())
    no_is = bypass_loss(logprobs, roll, adv, mask, correction=replace(corr, is_level=None),
                        num_tokens=5)  # fmt: skip
    assert no_is.loss.item() == out.loss.item()
    assert "rollout_corr/rollout_is_mean" in out.metrics
    assert "rollout_corr/rollout_is_mean" not in no_is.metrics
    assert "rollout_corr/kl" in out.metrics and "rollout_corr/chi2_seq" in out.metrics
    with pytest.raises(ValueError, match="correction"):
        bypass_loss(logprobs, roll, adv, mask)


def test_describe_names_the_mode_the_weights_and_the_rejection():
    corr = resolve_correction({"preset": "bypass_pg_geo_rs_token_tis", "rollout_is": "token",
                               "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.999_1.001",
                               "bypass_mode": True, "loss_type": "reinforce"})  # fmt: skip
    assert corr.describe() == ("preset bypass_pg_geo_rs_token_tis: bypass (reinforce); token "
                               "TIS 2; seq_mean_k1[0.999_1.001]")  # fmt: skip
