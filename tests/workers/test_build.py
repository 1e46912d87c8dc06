"""Building workers from the config: devices, mixed precision, gradient checkpointing and the
attention implementation reach the models as the config says."""

import pytest
import torch

from keel.config import validate
from keel.plan.inputs import worker_inputs
from keel.recipes import build_spec
from keel.workers.build import build_workers
from tests.workers.test_actor import rl_spec, synthetic_batch


def workers(tiny_dir, roles=("actor", "reference"), **models):
    cfg = validate({
        "models": {"actor": str(tiny_dir), **models},
        "algorithm": {"name": "grpo", "kl_loss_coef": 0.1},
        "rollout": {"n": 2},
        "train": {"batch_size": 4, "lr": 1e-6, "lr_schedule": "constant", "grad_clip": None},
    })  # fmt: skip
    return build_workers(worker_inputs(cfg, build_spec(cfg)), roles, None)


def changed_after_three_updates(actor) -> torch.Tensor:
    """[N] bool: which weights (all parameters, flattened) three updates at lr 1e-6 change."""
    before = torch.cat([p.detach().float().flatten() for p in actor.model.parameters()])
    batch = synthetic_batch(actor.model.config.vocab_size)
    for _ in range(3):
        actor.update(batch, rl_spec("token-mean"))
    after = torch.cat([p.detach().float().flatten() for p in actor.model.parameters()])
    return after != before


def test_mixed_precision_keeps_the_small_updates_that_pure_bfloat16_rounds_away(tiny_dir):
    """At lr 1e-6, three bf16-autocast steps on float32 master weights change ≥ 99% of the
    weights that float32 changes; pure bf16 weights round most of those updates away."""
    fp32 = changed_after_three_updates(workers(tiny_dir, ("actor",))["actor"])
    mixed = changed_after_three_updates(workers(tiny_dir, ("actor",), dtype="bfloat16")["actor"])
    with pytest.warns(UserWarning, match="pure_low_precision"):
        pure_actor = workers(tiny_dir, ("actor",), dtype="bfloat16", pure_low_precision=True)
    pure = changed_after_three_updates(pure_actor["actor"])
    assert fp32.sum() > 0.9 * fp32.numel()
    assert (mixed & fp32).sum() >= 0.99 * fp32.sum()
    assert (pure & fp32).sum() < 0.5 * fp32.sum()


def test_trained_models_keep_float32_weights_and_frozen_ones_are_stored_in_models_dtype(tiny_dir):
    built = workers(tiny_dir, dtype="bfloat16")
    actor, reference = built["actor"], built["reference"]
    assert {p.dtype for p in actor.model.parameters()} == {torch.float32}
    assert actor.dtype == torch.bfloat16  # its forwards run under bf16 autocast
    assert {p.dtype for p in reference.model.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in reference.model.parameters())
    actor.update(synthetic_batch(actor.model.config.vocab_size), rl_spec("token-mean", kl=0.1))
    state = actor.step.optimizer.state
    assert {s["exp_avg"].dtype for s in state.values()} == {torch.float32}


def test_models_land_on_the_configured_device(tiny_dir):
    built = workers(tiny_dir, ("actor", "rollout", "reference"))
    for w in (built["actor"], built["reference"], built["rollout"].engine):
        assert next(w.model.parameters()).device == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_device_cuda_without_a_gpu_is_an_error_naming_the_setting(tiny_dir):
    cfg = validate({
        "models": {"actor": str(tiny_dir)}, "algorithm": {"name": "grpo"},
        "rollout": {"n": 2}, "train": {"batch_size": 4}, "resources": {"device": "cuda"},
    })  # fmt: skip
    with pytest.raises(ValueError, match=r"resources\.device is cuda.*auto or cpu"):
        build_workers(worker_inputs(cfg, build_spec(cfg)), ("actor",), None)


def test_gradient_checkpointing_gives_the_same_gradients(tiny_dir):
    """Recomputing activations in backward changes memory, not the update."""
    grads = []
    for checkpointing in (False, True):
        cfg = validate({
            "models": {"actor": str(tiny_dir)}, "algorithm": {"name": "grpo"},
            "rollout": {"n": 2},
            "train": {"batch_size": 4, "gradient_checkpointing": checkpointing},
        })  # fmt: skip
        actor = build_workers(worker_inputs(cfg, build_spec(cfg)), ("actor",), None)["actor"]
        assert actor.model.is_gradient_checkpointing == checkpointing
        batch = synthetic_batch(actor.model.config.vocab_size)
        spec = rl_spec("token-mean", entropy=0.01)
        actor.model.train()  # transformers checkpoints only in training mode
        loss, _ = actor._policy_loss(batch, spec=spec, kl_coef=0.0, num_tokens=25, num_seqs=7)
        loss.backward()
        grads.append([p.grad.clone() for p in actor.model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_the_attention_implementation_reaches_the_models(tiny_dir):
    built = workers(tiny_dir, attn_implementation="eager")
    for w in (built["actor"], built["reference"]):
        assert w.model.config._attn_implementation == "eager"


def test_lora_in_mixed_precision_trains_the_float32_adapter_under_autocast(tiny_dir):
    """LoRA with models.dtype bfloat16: float32 adapter weights and AdamW states, forwards under
    bf16 autocast, the reference (the base under the disabled adapter) under the same."""
    built = workers(tiny_dir, dtype="bfloat16", lora={"r": 4})
    actor, reference = built["actor"], built["reference"]
    assert reference.model is actor.model and reference.dtype == actor.dtype == torch.bfloat16
    trained = {n: p for n, p in actor.model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in trained.items()}
    batch = synthetic_batch(actor.model.config.vocab_size)
    batch = reference.compute_ref_logprobs(batch)
    actor.update(batch, rl_spec("token-mean", kl=0.1))
    assert {p.dtype for p in trained.values()} == {torch.float32}
    moved = [n for n, p in trained.items() if not torch.equal(p, before[n])]
    # B starts at 0, so only B moves on the first update (A's gradient is Bᵀ·…)
    assert moved and all("lora_B" in n for n in moved)
    assert len(moved) == sum("lora_B" in n for n in trained)
    assert {s["exp_avg"].dtype for s in actor.step.optimizer.state.values()} == {torch.float32}


def test_float16_scales_the_loss_and_checkpoints_the_scaler(tiny_dir):
    """models.dtype float16: float32 master weights, fp16 autocast and a GradScaler, whose
    state (scale, growth tracker) is part of the worker's state and is restored."""
    actor = workers(tiny_dir, ("actor",), dtype="float16")["actor"]
    assert actor.step.scaler is not None and actor.dtype == torch.float16
    before = [p.detach().clone() for p in actor.model.parameters()]
    metrics = actor.update(synthetic_batch(actor.model.config.vocab_size), rl_spec("token-mean"))
    assert metrics["actor/skipped"] == 0.0
    assert any(not torch.equal(a, p) for a, p in zip(before, actor.model.parameters(), strict=True))
    actor.step.scaler.update(new_scale=128.0)  # as after overflows
    state = actor.state_dict()
    assert state["grad_scaler"]["scale"] == 128.0
    other = workers(tiny_dir, ("actor",), dtype="float16")["actor"]
    assert other.step.scaler.get_scale() != 128.0
    other.load_state_dict(state)
    assert other.step.scaler.get_scale() == 128.0
