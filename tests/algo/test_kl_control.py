"""KL coefficient controllers (docs/algorithms.md §3): fixed and Ziegler's adaptive controller."""

import pytest
import torch

from keel.algo import AdaptiveKLController, FixedKLController, build_kl_controller
from keel.algo.kl import batch_mean_kl


def test_adaptive_coefficient_over_several_updates_by_hand():
    """β0 = 0.2, target 6, horizon 10000, 100 sequences per batch (n/h = 0.01).
    KL 9: e = clip(0.5) = 0.2 → β = 0.2·1.002 = 0.2004; KL 6: e = 0 → unchanged;
    KL 3: e = clip(−0.5) = −0.2 → β = 0.2004·0.998 = 0.1999992;
    KL 6.6: e = 0.1 → β = 0.1999992·1.001 = 0.2001991992."""
    ctrl = AdaptiveKLController(0.2, target_kl=6.0, horizon=10000)
    seen = []
    for kl in (9.0, 6.0, 3.0, 6.6):
        ctrl.update(kl, n_steps=100)
        seen.append(ctrl.value)
    assert seen == pytest.approx([0.2004, 0.2004, 0.1999992, 0.2001991992], rel=1e-9)


def test_fixed_controller_never_moves():
    ctrl = build_kl_controller("fixed", kl_coef=0.05)
    assert isinstance(ctrl, FixedKLController)
    ctrl.update(100.0, n_steps=10**6)
    assert ctrl.value == 0.05


def test_state_dict_round_trip_continues_the_same_trajectory():
    a = build_kl_controller("adaptive", kl_coef=0.1, target_kl=1.0, horizon=50)
    a.update(2.0, n_steps=8)
    b = build_kl_controller("adaptive", kl_coef=999.0, target_kl=5.0, horizon=7)
    b.load_state_dict(a.state_dict())
    a.update(0.5, n_steps=8)
    b.update(0.5, n_steps=8)
    assert a.value == b.value and b.target == 1.0 and b.horizon == 50


@pytest.mark.parametrize(
    "kwargs", [{"target_kl": 1.0, "horizon": 0}, {"target_kl": 0.0, "horizon": 10}]
)
def test_adaptive_controller_rejects_a_bad_horizon_or_target(kwargs):
    with pytest.raises(ValueError):
        build_kl_controller("adaptive", kl_coef=0.1, **kwargs)


def test_batch_current_kl_is_the_mean_over_sequences_of_the_token_mean():
    """Rows: [1, 3] → 2; [4, ·] → 4; fully masked row excluded. (2 + 4)/2 = 3."""
    kl = torch.tensor([[1.0, 3.0], [4.0, float("nan")], [float("nan"), 9.0]])
    mask = torch.tensor([[1, 1], [1, 0], [0, 0]])
    assert batch_mean_kl(kl, mask) == pytest.approx(3.0)
