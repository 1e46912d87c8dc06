"""GradientStep: micro-batch gradients are summed, the logged norm is the pre-clip one, and the
applied update is clipped to `grad_clip` (directly and through `train.grad_clip`)."""

import math

import pytest
import torch

from keel.config import validate
from keel.engine import GradientStep
from keel.plan.inputs import worker_inputs
from keel.recipes import build_spec
from keel.types import Batch
from keel.workers.build import build_workers
from tests.workers.test_actor import rl_spec, synthetic_batch

# The known gradient: (3, 0) on one parameter and (4,) on another, global L2 norm 5.
G_W, G_U = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
NORM = 5.0
LR = 0.1


class TwoParameters(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        self.u = torch.nn.Parameter(torch.tensor([0.5]))


def known_gradient(micro: Batch):
    """A linear loss whose gradient is `share` × (G_W, G_U); `share` rides in the micro-batch
    (two micro-batches of 0.25 and 0.75 sum to the whole known gradient)."""
    share = micro.scores.sum()
    model = micro.meta["model"]
    loss = share * ((model.w * G_W).sum() + (model.u * G_U).sum())
    return loss, {"share": share.detach()}


def sgd_update(grad_clip: float | None) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(the applied update Δθ, the gradient left in .grad, the metrics) of one SGD step."""
    model = TwoParameters()
    before = torch.cat([p.detach().clone() for p in model.parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    step = GradientStep(model, opt, sched, grad_clip)
    micros = [Batch(scores=torch.tensor([s]), meta={"model": model}) for s in (0.25, 0.75)]
    metrics = step.apply(micros, known_gradient)
    after = torch.cat([p.detach() for p in model.parameters()])
    grad = torch.cat([p.grad for p in model.parameters()])
    return after - before, grad, metrics


def test_clipping_scales_the_update_to_grad_clip_and_logs_the_norm_before_it():
    """grad_clip 1 on a gradient of norm 5: the logged norm is 5, the gradient the optimizer
    used is the known one scaled to norm 1 (its direction kept), so SGD moves by lr × 1."""
    delta, grad, metrics = sgd_update(grad_clip=1.0)
    assert metrics["grad_norm"] == pytest.approx(NORM, rel=1e-6)
    assert metrics["share"] == pytest.approx(1.0) and metrics["skipped"] == 0.0
    assert metrics["lr"] == LR
    expected = torch.cat([G_W, G_U]) / NORM
    torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(delta, -LR * expected, rtol=1e-5, atol=1e-7)
    assert float(delta.norm()) == pytest.approx(LR * 1.0, rel=1e-5)


@pytest.mark.parametrize("grad_clip", [None, 10.0], ids=["off", "above-the-norm"])
def test_no_clipping_below_the_limit_or_without_one(grad_clip):
    delta, grad, metrics = sgd_update(grad_clip)
    assert metrics["grad_norm"] == pytest.approx(NORM, rel=1e-6)
    torch.testing.assert_close(grad, torch.cat([G_W, G_U]), rtol=1e-6, atol=0)
    assert float(delta.norm()) == pytest.approx(LR * NORM, rel=1e-5)


def built_actor(tiny_dir, **train):
    cfg = validate({
        "models": {"actor": str(tiny_dir)}, "algorithm": {"name": "grpo", "kl_loss_coef": 0.0},
        "rollout": {"n": 2},
        "train": {"batch_size": 4, "lr": 1e-4, "lr_schedule": "constant", **train},
    })  # fmt: skip
    return build_workers(worker_inputs(cfg, build_spec(cfg)), ["actor"], None)["actor"]


def gradient_norm(model: torch.nn.Module) -> float:
    grads = [p.grad.detach().flatten() for p in model.parameters() if p.grad is not None]
    return float(torch.cat(grads).norm())


def test_train_grad_clip_clips_the_built_actors_update(tiny_dir):
    """train.grad_clip reaches the actor's GradientStep (default 1.0): after an update on a
    gradient far above the limit, the gradient AdamW stepped with has norm grad_clip, while
    actor/grad_norm reports the norm before clipping; with null the two are the same."""
    assert built_actor(tiny_dir).step.grad_clip == 1.0  # the default limit
    batch = synthetic_batch(built_actor(tiny_dir).model.config.vocab_size)
    limit = 1e-3
    actor = built_actor(tiny_dir, grad_clip=limit)
    assert actor.step.grad_clip == limit
    metrics = actor.update(batch, rl_spec("token-mean"))
    assert metrics["actor/skipped"] == 0.0
    assert metrics["actor/grad_norm"] > 20 * limit  # clipping is live on this gradient
    assert gradient_norm(actor.model) == pytest.approx(limit, rel=1e-3)
    free = built_actor(tiny_dir, grad_clip=None)
    assert free.step.grad_clip is None
    unclipped = free.update(batch, rl_spec("token-mean"))["actor/grad_norm"]
    assert unclipped == pytest.approx(metrics["actor/grad_norm"], rel=1e-4)
    assert gradient_norm(free.model) == pytest.approx(unclipped, rel=1e-4)
    assert math.isfinite(unclipped)
