"""The actor's loss with on-policy distillation: task + coef·L_distill or L_distill alone, every
mode independent of the micro-batch size, and the distillation/* metrics."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from keel.algo.distillation import DistillationOptions
from keel.models import load_causal_lm, load_tokenizer
from tests.workers.test_actor import rl_spec, sgd_actor, synthetic_batch

MODES = [
    DistillationOptions(loss_mode="k3", use_task_rewards=False),
    DistillationOptions(loss_mode="k2", coef=0.5, loss_max_clamp=1.0),
    DistillationOptions(loss_mode="k1", use_policy_gradient=True, coef=2.0),
    DistillationOptions(loss_mode="forward_kl_topk", topk=4, log_prob_min_clamp=-10.0),
]


def with_teacher(batch, vocab: int):
    g = torch.Generator().manual_seed(3)
    b, r = batch.response_mask.shape
    lam, ids = torch.log_softmax(torch.randn(b, r, vocab, generator=g), -1).topk(4, dim=-1)
    return batch.replace(
        teacher_logprobs=-torch.rand(b, r, generator=g) * 5, teacher_topk_ids=ids,
        teacher_topk_logprobs=lam,
    )  # fmt: skip


@pytest.mark.parametrize("opts", MODES, ids=lambda o: f"{o.loss_mode}-pg{o.use_policy_gradient}")
def test_distillation_update_is_the_same_in_one_micro_batch_or_four(tiny_dir, opts):
    tok, base = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    batch = with_teacher(synthetic_batch(len(tok)), len(tok))
    spec = dataclasses.replace(rl_spec("token-mean"), distillation=opts)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    metrics = [
        sgd_actor(m, tok, micro).update(batch, spec)
        for m, micro in zip(models, (8, 2), strict=True)
    ]
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    one, four = metrics
    for key in (
        "distillation/loss",
        "distillation/loss_min",
        "distillation/loss_max",
        "actor/loss",
    ):
        assert one[key] == pytest.approx(four[key], rel=1e-4, abs=1e-6), key
    if opts.use_task_rewards:
        want = one["actor/pg_loss"] + opts.coef * one["distillation/loss"]
        assert one["actor/loss"] == pytest.approx(want, rel=1e-5)
    else:
        assert one["actor/loss"] == pytest.approx(one["distillation/loss"], rel=1e-6)
    if opts.use_policy_gradient:
        assert {"distillation/pg_clipfrac", "distillation/ppo_kl"} <= set(one)
    if opts.topk_mode:
        assert 0 < one["distillation/teacher_mass"] <= 1
        assert one["distillation/student_mass_min"] <= one["distillation/student_mass_max"]
    changed = any(
        not torch.equal(a, b)
        for a, b in zip(base.parameters(), models[0].parameters(), strict=True)
    )
    assert changed
