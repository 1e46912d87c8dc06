"""The LR schedule: linear warm-up, then constant or cosine down to min_lr_ratio."""

import itertools

import pytest
import torch

from keel.engine import build_optimizer, build_scheduler, lr_multiplier


def test_warmup_then_cosine_reaches_the_floor():
    kw = dict(warmup_steps=4, total_steps=14, schedule="cosine", min_lr_ratio=0.1)
    values = [lr_multiplier(s, **kw) for s in range(16)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert values[4] == pytest.approx(1.0)
    assert values[9] == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert values[14] == pytest.approx(0.1)
    assert values[15] == pytest.approx(0.1)  # stays at the floor
    assert all(a >= b for a, b in itertools.pairwise(values[4:]))


def test_constant_schedule_after_warmup():
    kw = dict(warmup_steps=2, total_steps=10, schedule="constant", min_lr_ratio=0.0)
    assert [lr_multiplier(s, **kw) for s in range(5)] == [0.5, 1.0, 1.0, 1.0, 1.0]


def test_scheduler_drives_the_optimizer_lr():
    model = torch.nn.Linear(3, 2)
    opt = build_optimizer(model, lr=0.1, weight_decay=0.01)
    sched = build_scheduler(opt, warmup_steps=2, total_steps=4, schedule="cosine", min_lr_ratio=0)
    seen = []
    for _ in range(4):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.05, 0.1, 0.1, 0.05], abs=1e-9)
    # weights decay, biases do not
    assert [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
