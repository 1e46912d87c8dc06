"""A config's plan: colocated roles share a GPU, FSDP divides the model states, LoRA trains
only the adapter, and when a plan does not fit, the advice says what does."""

import pytest

from keel.config import KeelConfig
from keel.engine.memory import advise, plan_inputs, plan_memory, shape_from_config
from keel.engine.memory.fit import CPU_PROCESS, CUDA_CONTEXT
from tests.engine.memory.test_estimate import LLAMA2_7B

SHAPE = shape_from_config(LLAMA2_7B)
GiB = 1 << 30


def config(**sections) -> KeelConfig:
    base = {"models": {"actor": "llama7b", "dtype": "bfloat16"},
            "algorithm": {"name": "grpo", "kl_loss_coef": 0.001},
            "data": {"train": "builtin:arithmetic", "max_prompt_length": 512},
            "rollout": {"n": 8, "max_new_tokens": 512, "batch_size": 4},
            "train": {"batch_size": 32, "mini_batch_size": 64, "micro_batch_size": 4}}  # fmt: skip
    for key, value in sections.items():
        base[key] = value if key == "algorithm" else {**base.get(key, {}), **value}
    return KeelConfig.model_validate(base)


ROLES = frozenset({"actor", "rollout", "reference", "reward"})
SHAPES = {"actor": SHAPE, "rollout": SHAPE, "reference": SHAPE, "reward": None}


def test_colocated_roles_share_a_gpu_and_fsdp_divides_model_states():
    ray = {"backend": "ray", "groups": [
        {"roles": ["actor", "rollout"], "workers": 64, "fsdp": True},
        {"roles": ["reference"], "workers": 2}]}  # fmt: skip
    plan = plan_memory(plan_inputs(config(resources=ray), ROLES, SHAPES))
    by_group = {g.group: g for g in plan.gpus}
    assert set(by_group) == {"groups[0]", "groups[1]", "driver"}  # reward: in the driver
    actor = by_group["groups[0]"].roles[0]
    # ZeRO stage 3 over 64 GPUs: 16 bytes per parameter / 64 (Figure 1's 1.9 GB for 7.5B)
    assert actor.resident == pytest.approx(16 * SHAPE.parameters() / 64, rel=1e-6)
    rollout = by_group["groups[0]"].roles[1]
    assert rollout.weights == 0 and rollout.kv_cache > 0  # generates with the actor's module
    reference = by_group["groups[1]"].roles[0]
    assert reference.weights == 2 * SHAPE.parameters()  # frozen, in models.dtype, replicated
    assert by_group["groups[1]"].peak < 20 * GiB


def test_local_backend_puts_every_role_on_one_gpu_and_lora_trains_the_adapter():
    full = plan_memory(plan_inputs(config(), ROLES, SHAPES)).gpus[0]
    assert [r.role for r in full.roles] == ["actor", "reference", "reward", "rollout"]
    assert full.resident == 16 * SHAPE.parameters() + 2 * SHAPE.parameters()
    lora = plan_memory(plan_inputs(config(models={"lora": {"r": 8}}), ROLES, SHAPES)).gpus[0]
    actor, reference = lora.roles[0], lora.roles[1]
    assert actor.trained_parameters == SHAPE.lora_parameters(8, "all-linear")
    assert actor.gradients == 4 * actor.trained_parameters
    assert reference.weights == 0  # the actor's module with the adapter off
    assert lora.peak < full.peak / 2


def test_a_plan_that_does_not_fit_names_the_settings_that_do():
    inputs = plan_inputs(config(), ROLES, SHAPES, gpu_memory=80 * GiB)
    assert not plan_memory(inputs).fits
    advice = advise(inputs)
    fitting = [a for a in advice if a.fits]
    assert fitting, advice
    assert all(a.peak <= 80 * GiB for a in fitting)
    settings = [s for a in advice for s in a.settings]
    assert "models.lora.r=16" in settings
    assert "resources.backend=ray" in settings  # more GPUs needs Ray with the local backend
    more = next(a for a in advice if "resources.groups[0].fsdp=true" in a.settings)
    assert more.fits
    small = plan_inputs(config(), ROLES, SHAPES, gpus=8, gpu_memory=200 * GiB)
    assert advise(small) == [] and plan_memory(small).gpus[0].workers == 8


def test_offline_stages_plan_pairs_as_two_rows_and_say_what_bounds_the_responses():
    pairs = {"name": "dpo"}
    dpo = config(algorithm=pairs, train={"batch_size": 8, "mini_batch_size": 8,
                                         "micro_batch_size": 2})  # fmt: skip
    inputs = plan_inputs(dpo, frozenset({"actor", "reference"}), SHAPES)
    assert inputs.micro_batch_size == 4  # 2 pairs: chosen and rejected rows
    assert any("rollout.max_new_tokens" in note for note in inputs.notes)
    rm = config(algorithm={"name": "rm"}, train={"batch_size": 8, "mini_batch_size": 8})
    (actor,) = plan_memory(plan_inputs(rm, frozenset({"actor"}), SHAPES)).gpus[0].roles
    assert actor.logits == 0 and actor.parameters == SHAPE.parameters("score")


def test_vllm_holds_its_share_of_the_gpu_and_a_reward_function_holds_nothing():
    ray = {"backend": "ray", "groups": [{"roles": ["actor", "reference"]},
                                        {"roles": ["rollout"], "workers": 2}]}  # fmt: skip
    cfg = config(rollout={"engine": "vllm", "vllm": {"gpu_memory_utilization": 0.4}},
                 resources=ray)  # fmt: skip
    plan = plan_memory(plan_inputs(cfg, ROLES, SHAPES, gpu_memory=80 * GiB))
    rollout_gpu = next(g for g in plan.gpus if g.group == "groups[1]")
    # its share holds vLLM's own CUDA context: none added
    assert rollout_gpu.resident == rollout_gpu.peak == int(0.4 * 80 * GiB)
    driver = next(g for g in plan.gpus if g.group == "driver")
    (reward,) = driver.roles
    assert reward.resident == 0 and reward.parameters == 0 and driver.peak == 0
    actor_gpu = next(g for g in plan.gpus if g.group == "groups[0]")  # the context counted
    assert actor_gpu.runtime == CUDA_CONTEXT
    assert actor_gpu.peak == CUDA_CONTEXT + max(actor_gpu.resident, *actor_gpu.phases.values())


def test_a_cpu_plan_counts_the_process_and_offers_no_more_gpus():
    inputs = plan_inputs(config(), ROLES, SHAPES, gpu_memory=80 * GiB, device="cpu")
    plan = plan_memory(inputs)
    assert plan.gpus[0].runtime == CPU_PROCESS
    assert plan.peak == CPU_PROCESS + max(plan.gpus[0].phases.values())
    settings = [s for a in advise(inputs) for s in a.settings]
    assert "models.lora.r=16" in settings and "resources.backend=ray" not in settings
