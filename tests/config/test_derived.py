"""Batch algebra checks and the derived batch plan (keel.config.derived)."""

import pytest

from keel.config import ConfigError, batch_plan, validate
from keel.config.derived import rank_batch_sizes


def config(algorithm="grpo", **sections):
    raw = {"models": {"actor": "builtin:tiny"}, "algorithm": {"name": algorithm}, **sections}
    return validate(raw, source="run.yaml")


def algebra_error(**kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        config(**kwargs)
    return str(info.value)


# ------------------------------------------------------------------- batch algebra
def test_mini_batch_not_dividing_sequences_names_mini_batch_size():
    # 3 prompts × 4 responses = 12 sequences; 5 does not divide 12.
    msg = algebra_error(train={"batch_size": 3, "mini_batch_size": 5}, rollout={"n": 4})
    assert "run.yaml" in msg
    assert "train.mini_batch_size (5) must divide" in msg


def test_mini_batch_larger_than_step_is_an_error():
    msg = algebra_error(train={"batch_size": 2, "mini_batch_size": 16}, rollout={"n": 4})
    assert "train.mini_batch_size (16)" in msg


def test_mini_batch_dividing_batch_times_n_is_accepted():
    # 3 × 4 = 12 is divisible by 6 although 3 is not.
    cfg = config(train={"batch_size": 3, "mini_batch_size": 6}, rollout={"n": 4})
    assert batch_plan(cfg).mini_batches_per_step == 2


def test_micro_batch_not_dividing_mini_names_micro_batch_size():
    msg = algebra_error(
        train={"batch_size": 4, "mini_batch_size": 8, "micro_batch_size": 3}, rollout={"n": 4}
    )
    assert "train.micro_batch_size (3) must divide train.mini_batch_size (8)" in msg


def test_sft_uses_batch_size_times_one():
    # 6 × 8 = 48 is divisible by 4 but SFT has no rollout: 6 is not.
    msg = algebra_error(
        algorithm="sft", train={"batch_size": 6, "mini_batch_size": 4}, rollout={"n": 8}
    )
    assert "train.mini_batch_size (4)" in msg


# ---------------------------------------------------------------------- batch plan
def test_batch_plan_grpo_numbers():
    cfg = config(
        train={
            "batch_size": 4,
            "mini_batch_size": 8,
            "micro_batch_size": 2,
            "ppo_epochs": 2,
            "steps": 10,
        },
        rollout={"n": 8},
    )
    assert batch_plan(cfg).as_dict() == {
        "sequences_per_step": 32,
        "mini_batch_size": 8,
        "mini_batches_per_step": 4,
        "micro_batch_size": 2,
        "grad_accumulation_steps": 4,
        "optimizer_steps_per_step": 8,  # 4 mini-batches × 2 epochs
        "total_optimizer_steps": 80,
    }


def test_batch_plan_defaults_to_one_update_per_step():
    plan = batch_plan(config(train={"batch_size": 4, "steps": 7}, rollout={"n": 2}))
    assert (plan.mini_batch_size, plan.micro_batch_size) == (8, 8)
    assert (plan.mini_batches_per_step, plan.grad_accumulation_steps) == (1, 1)
    assert plan.total_optimizer_steps == 7


def test_batch_plan_sft_sequences_are_examples():
    plan = batch_plan(config("sft", train={"batch_size": 8, "steps": 5}, rollout={"n": 4}))
    assert plan.sequences_per_step == 8
    assert plan.total_optimizer_steps == 5


def test_batch_plan_sft_ignores_ppo_epochs():
    plan = batch_plan(config("sft", train={"batch_size": 8, "ppo_epochs": 3}))
    assert plan.optimizer_steps_per_step == 1


def test_batch_plan_sft_counts_one_update_per_mini_batch():
    """ActorWorker.sft_update steps the optimizer (and LR scheduler) once per mini-batch, and
    build_roles sizes the scheduler with total_optimizer_steps, so the plan must count them."""
    cfg = config("sft", train={"batch_size": 8, "mini_batch_size": 4, "steps": 5})
    plan = batch_plan(cfg)
    assert plan.mini_batches_per_step == 2
    assert plan.optimizer_steps_per_step == 2
    assert plan.total_optimizer_steps == 10


# ------------------------------------------------------------------ data parallelism
def test_ray_workers_must_divide_the_mini_batch_of_the_roles_they_train():
    train = {"batch_size": 2, "mini_batch_size": 8}
    groups = [{"roles": ["actor", "reference"], "workers": 3}]
    msg = algebra_error(train=train, resources={"backend": "ray", "groups": groups})
    assert "resources.groups[0].workers (3)" in msg and "train.mini_batch_size (8)" in msg
    ok = config(train=train, resources={"backend": "ray", "groups": [{**groups[0], "workers": 4}]})
    assert rank_batch_sizes(batch_plan(ok), 4) == (2, 2)
    # untrained roles (a rollout group) and the local backend have no such constraint
    config(
        train=train, resources={"backend": "ray", "groups": [{"roles": ["rollout"], "workers": 3}]}
    )
    config(train=train, resources={"groups": groups})


def test_a_role_in_two_groups_is_refused_with_the_field():
    groups = [{"roles": ["actor"]}, {"roles": ["rollout", "actor"]}]
    msg = algebra_error(resources={"backend": "ray", "groups": groups})
    assert "resources.groups[1].roles" in msg and "'actor'" in msg


# --------------------------------------------------------------------------------- LoRA
def test_lora_is_refused_for_reward_model_training():
    msg = algebra_error(algorithm="rm", models={"actor": "builtin:tiny", "lora": {"r": 4}})
    assert "models.lora does not apply to algorithm.name: rm" in msg


def test_lora_with_an_fsdp_actor_group_is_accepted():
    """A LoRA actor on FSDP2 ranks (tests/workers/test_ray_group.py trains and resumes one)."""
    groups = [{"roles": ["actor", "rollout"], "workers": 2, "fsdp": True}]
    cfg = config(
        "grpo",
        models={"actor": "builtin:tiny", "lora": {}},
        resources={"backend": "ray", "groups": groups},
        train={"batch_size": 4},
        rollout={"n": 2},
    )
    assert cfg.models.lora is not None and cfg.resources.groups[0].fsdp


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "sft", "dpo"])
def test_lora_is_accepted_for_rl_sft_and_dpo(algorithm):
    cfg = config(algorithm, models={"actor": "builtin:tiny", "lora": {"r": 4, "alpha": 8}})
    assert cfg.models.lora.r == 4 and cfg.models.lora.target_modules == "all-linear"
