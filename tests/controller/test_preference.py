"""The rm and dpo stages end to end on the tiny model: data loading, cached reference log-probs,
pairwise evaluation, controller state."""

import json

import pytest
import torch

from keel.config.loading import validate
from keel.controller.assembly import build_reward, load_datasets, local_roles
from keel.controller.preference import DPOController, RewardModelController
from keel.data import DataError
from keel.plan.run import resolve_run
from keel.recipes import build_spec
from keel.workers.dpo import DPOWorker
from keel.workers.reference import ReferenceWorker


def config(tiny_dir, tmp_path, **algorithm):
    return validate(
        {
            "run_dir": str(tmp_path / "run"),
            "models": {"actor": str(tiny_dir)},
            "algorithm": algorithm,
            "data": {"train": "builtin:preference",
                     "arithmetic": {"max_operand": 12, "eval_size": 16}},
            "train": {"steps": 2, "batch_size": 4, "micro_batch_size": 2, "lr": 1e-3},
            "monitor": {"progress": False},
        }
    )  # fmt: skip


def controller(cfg, tmp_path):
    run = resolve_run(cfg, build_spec(cfg))
    data = load_datasets(cfg, run.spec)
    roles = local_roles(run.workers, build_reward(cfg))
    cls = {"rm": RewardModelController, "dpo": DPOController}[run.spec.stage]
    return cls(run, roles, data)


def test_rm_steps_and_evaluates_pairwise(tiny_dir, tmp_path):
    ctl = controller(config(tiny_dir, tmp_path, name="rm"), tmp_path)
    before = ctl.evaluate()
    assert set(before) == {f"eval/rm/{k}" for k in ("loss", "accuracy", "margin", "chosen",
                                                     "rejected")}  # fmt: skip
    metrics = ctl.step(1)
    assert torch.isfinite(torch.tensor(list(metrics.values()))).all()
    assert {"rm/loss", "rm/accuracy", "rm/margin", "rm/grad_norm"} <= set(metrics)
    assert ctl.evaluate()["eval/rm/loss"] != before["eval/rm/loss"]


def test_cached_reference_logps_equal_fresh_ones(tiny_dir, tmp_path):
    cached = controller(config(tiny_dir, tmp_path, name="dpo", precompute_ref_logps=True), tmp_path)
    fresh = controller(config(tiny_dir, tmp_path, name="dpo", precompute_ref_logps=False), tmp_path)
    assert len(cached.ref_cache) == len(cached.train_pairs) and not fresh.ref_cache
    assert cached.roles.reference is None and fresh.roles.reference is not None
    ids = cached.indices.next_batch()
    batch = cached.encode([cached.train_pairs[i] for i in ids])
    a = cached._with_reference(batch, ids, cached.ref_cache)
    b = fresh._with_reference(batch, ids, fresh.ref_cache)
    torch.testing.assert_close(a.ref_logprobs, b.ref_logprobs, atol=1e-6, rtol=1e-5)


def test_dpo_evaluation_starts_at_ties_and_state_round_trips(tiny_dir, tmp_path):
    ctl = controller(config(tiny_dir, tmp_path, name="dpo", beta=0.5), tmp_path)
    first = ctl.evaluate()
    assert first["eval/rewards/accuracies"] == 0.0  # policy = reference: every pair is a tie
    assert first["eval/rewards/margins"] == 0.0
    assert first["eval/dpo/loss"] == pytest.approx(0.693147, rel=1e-5)
    state = json.loads(json.dumps(ctl.state_dict()))
    ctl.step(1)
    other = controller(config(tiny_dir, tmp_path, name="dpo", beta=0.5), tmp_path)
    other.load_state_dict(state)
    other.step(1)
    assert other.state_dict() == ctl.state_dict()


def test_ipo_mean_evaluates_on_per_token_log_probs(tiny_dir, tmp_path):
    ctl = controller(config(tiny_dir, tmp_path, name="dpo", loss="ipo_mean", beta=0.5), tmp_path)
    metrics = ctl.evaluate()
    assert metrics["eval/dpo/loss"] == pytest.approx(1.0, rel=1e-5)  # h = 0: (0 − 1/(2β))²
    batch = ctl.encode(ctl.eval_pairs)
    mean = ctl.roles.actor.call(DPOWorker.sequence_logps, batch) / batch.response_mask.sum(dim=1)
    assert metrics["eval/logps/chosen"] == pytest.approx(mean[0::2].mean().item(), rel=1e-5)
    assert metrics["eval/logps/rejected"] == pytest.approx(mean[1::2].mean().item(), rel=1e-5)


def test_pair_stages_need_preference_data(tiny_dir, tmp_path):
    cfg = config(tiny_dir, tmp_path, name="dpo")
    cfg.data.train = "builtin:arithmetic"
    with pytest.raises(DataError, match=r"unknown built-in dataset .*builtin:preference"):
        load_datasets(cfg, build_spec(cfg))
    rows = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg.data.train = str(tmp_path / "p.jsonl")
    data = load_datasets(cfg, build_spec(cfg))
    assert [p.chosen for p in data.train] == ["2"] and data.eval == []


def test_lora_dpo_uses_the_base_as_reference_and_trains_the_adapter(tiny_dir, tmp_path):
    """models.lora with dpo: the (uncached) reference is the actor's module with the adapter
    off, which stays the base model while the adapter learns."""
    from keel.engine.forward import response_forward
    from keel.models import load_causal_lm

    cfg = config(tiny_dir, tmp_path, name="dpo", precompute_ref_logps=False)
    cfg.models.lora = {"r": 4, "alpha": 8.0}
    ctl = controller(cfg, tmp_path)
    actor = ctl.roles.actor.workers[0].model
    assert ctl.roles.reference.workers[0].model is actor
    for step in (1, 2):
        assert ctl.step(step)["actor/grad_norm"] > 0
    batch = ctl.encode(ctl.train_pairs[:4])
    ref = ctl.roles.reference.call(ReferenceWorker.compute_ref_logprobs, batch).ref_logprobs
    with torch.no_grad():
        base = response_forward(load_causal_lm(tiny_dir).eval(), batch)[0]
        trained = response_forward(actor.eval(), batch)[0]
    # Two code paths (peft with the adapter off, a plain load): equal up to float rounding,
    # which differs from one CPU to another; the trained adapter moves far more than that.
    torch.testing.assert_close(ref, base, rtol=1e-5, atol=1e-6)
    assert (ref - trained).abs().max() > 1e-3
