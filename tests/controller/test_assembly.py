"""Assembling a run: which roles exist, and which held-out data is used."""

from keel.config import validate
from keel.controller.assembly import build_reward, build_roles, load_datasets
from keel.recipes import build_spec


def assemble(tiny_dir, **algorithm):
    cfg = validate({"models": {"actor": str(tiny_dir)}, "algorithm": algorithm,
                    "data": {"arithmetic": {"eval_size": 10}}})  # fmt: skip
    spec = build_spec(cfg)
    return cfg, spec, build_roles(cfg, spec, build_reward(cfg))


def test_kl_coefficient_zero_loads_no_reference_model(tiny_dir):
    _, _, roles = assemble(tiny_dir, name="grpo", kl_loss_coef=0.0)
    assert roles.reference is None


def test_reference_is_a_separate_frozen_copy(tiny_dir):
    _, _, roles = assemble(tiny_dir, name="grpo", kl_loss_coef=0.01)
    actor = roles.actor.workers[0].model
    ref = roles.reference.workers[0].model
    assert ref is not actor
    assert not any(p.requires_grad for p in ref.parameters())


def test_rollout_engine_generates_with_the_actors_weights(tiny_dir):
    _, _, roles = assemble(tiny_dir, name="grpo")
    assert roles.rollout.workers[0].engine.model is roles.actor.workers[0].model


def test_eval_defaults_to_the_arithmetic_held_out_split_only_for_arithmetic(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "a", "answer": "1"}\n')
    base = {"models": {"actor": "x"}, "algorithm": {"name": "grpo"}}
    own = validate({**base, "data": {"train": str(data)}})
    assert load_datasets(own, build_spec(own)).eval == []
    arith = validate({**base, "data": {"arithmetic": {"eval_size": 7}}})
    assert len(load_datasets(arith, build_spec(arith)).eval) == 7
