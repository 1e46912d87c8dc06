"""The running z-score normaliser equals batch statistics over everything seen."""

import pytest
import torch

from keel.algo.normalization import RunningMoments


def test_running_statistics_equal_the_whole_history():
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=g) * 3 + 2 for n in (5, 1, 7)]
    rm = RunningMoments()
    for b in batches:
        rm.update(b)
    everything = torch.cat(batches).double()
    assert rm.count == 13
    assert rm.mean == pytest.approx(everything.mean().item(), rel=1e-12)
    assert rm.std == pytest.approx(everything.std(unbiased=False).item(), rel=1e-12)


def test_normalize_updates_first_then_z_scores():
    rm = RunningMoments()
    x = torch.tensor([1.0, 3.0])  # μ = 2, σ = 1 after the update
    torch.testing.assert_close(rm.normalize(x), torch.tensor([-1.0, 1.0]))
    y = torch.tensor([4.0])
    torch.testing.assert_close(rm.normalize(y, update=False), torch.tensor([2.0]))
    assert rm.count == 2


def test_before_any_value_it_is_the_identity():
    rm = RunningMoments()
    x = torch.tensor([0.5, -2.0])
    torch.testing.assert_close(rm.normalize(x, update=False), x)


def test_state_dict_round_trip():
    rm = RunningMoments()
    rm.update(torch.tensor([1.0, 2.0, 7.0]))
    copy = RunningMoments()
    copy.load_state_dict(rm.state_dict())
    x = torch.tensor([3.0, 0.0])
    torch.testing.assert_close(copy.normalize(x), rm.normalize(x))
    assert copy.state_dict() == rm.state_dict()
