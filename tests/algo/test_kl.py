"""Per-token KL estimators (docs/algorithms.md §2).

Hand-computed example: ℓ = [-1.0, -2.0], ℓ_ref = [-1.5, -1.0] ⇒ d = ℓ − ℓ_ref = [0.5, -1.0],
x = ℓ_ref − ℓ = [-0.5, 1.0].
k1 = d = [0.5, -1.0];  abs = [0.5, 1.0];  k2 = ½d² = [0.125, 0.5];
k3 = eˣ − x − 1 = [e^-0.5 − 0.5, e − 2] = [0.1065306597, 0.7182818285].
Gradients w.r.t. ℓ: k1 → 1, k2 → d, k3 → 1 − eˣ = [0.3934693403, −1.7182818285].
"""

import functools
import math

import pytest
import torch

from keel.algo import kl_penalty

assert_close = functools.partial(torch.testing.assert_close, atol=1e-5, rtol=1e-4)

LP = torch.tensor([-1.0, -2.0])
REF = torch.tensor([-1.5, -1.0])
K3 = [math.exp(-0.5) - 0.5, math.e - 2.0]


def _value_and_grad(kind: str, lp: torch.Tensor = LP, ref: torch.Tensor = REF):
    lp = lp.clone().requires_grad_()
    value = kl_penalty(lp, ref, kind)
    value.sum().backward()
    return value.detach(), lp.grad


@pytest.mark.parametrize(
    ("kinds", "expected"),
    [
        (("kl", "k1"), [0.5, -1.0]),
        (("abs",), [0.5, 1.0]),
        (("mse", "k2"), [0.125, 0.5]),
        (("low_var_kl", "k3"), K3),
    ],
)
def test_estimator_values_by_every_alias(kinds, expected):
    for kind in kinds:
        assert_close(kl_penalty(LP, REF, kind), torch.tensor(expected))


def test_default_estimator_is_low_var_kl():
    assert_close(kl_penalty(LP, REF), torch.tensor(K3))


def test_k1_gradient_is_one():
    _, grad = _value_and_grad("k1")
    assert_close(grad, torch.ones(2))


def test_k2_gradient_is_d():
    _, grad = _value_and_grad("k2")
    assert_close(grad, torch.tensor([0.5, -1.0]))


def test_k3_gradient_is_one_minus_ratio():
    _, grad = _value_and_grad("k3")
    assert_close(grad, torch.tensor([1.0 - math.exp(-0.5), 1.0 - math.e]))


def test_k3_is_clamped_at_ten_with_zero_gradient():
    """x = 3: e³ − 4 ≈ 16.09 > 10; x = ±25 is clamped to ±20 first, then to 10 outside."""
    lp = torch.tensor([0.0, 0.0, 0.0, 0.0])
    ref = torch.tensor([3.0, 25.0, -25.0, 0.5])
    value, grad = _value_and_grad("k3", lp, ref)
    assert_close(value, torch.tensor([10.0, 10.0, 10.0, math.exp(0.5) - 1.5]))
    assert_close(grad, torch.tensor([0.0, 0.0, 0.0, 1.0 - math.exp(0.5)]))


def test_k3_is_nonnegative():
    torch.manual_seed(0)
    assert (kl_penalty(torch.randn(100), torch.randn(100), "k3") >= 0).all()


def test_k3_plus_has_k3_value_and_k2_gradient():
    value, grad = _value_and_grad("k3+")
    assert_close(value, torch.tensor(K3))
    assert_close(grad, torch.tensor([0.5, -1.0]))


def test_k1_plus_has_k1_value_and_k2_gradient():
    value, grad = _value_and_grad("k1+")
    assert_close(value, torch.tensor([0.5, -1.0]))
    assert_close(grad, torch.tensor([0.5, -1.0]))


@pytest.mark.parametrize("kind", ["k4", "full", "+", "K3", ""])
def test_unknown_estimator_raises_value_error(kind):
    with pytest.raises(ValueError):
        kl_penalty(LP, REF, kind)
