"""CriticWorker: values from an HF token-classification head, clipped value-loss updates that do
not depend on micro-batching, export as a standard HF folder that loads back, full state."""

import copy

import pytest
import torch
from transformers import AutoModelForTokenClassification

from keel.algo.spec import AlgorithmSpec
from keel.engine import GradientStep
from keel.models import load_tokenizer, load_value_model
from keel.workers import CriticWorker
from tests.workers.test_actor import AGG_MODES, synthetic_batch


def spec(mode: str, value_clip: float | None = 0.5, epochs: int = 1) -> AlgorithmSpec:
    return AlgorithmSpec(name="test", stage="rl", roles=frozenset({"actor", "critic"}),
                         loss_agg_mode=mode, advantage="gae", cliprange_value=value_clip,
                         ppo_epochs=epochs)  # fmt: skip


def critic(model, tok, micro: int, lr: float = 0.5) -> CriticWorker:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    step = GradientStep(model, opt, sched, grad_clip=None)
    return CriticWorker(model, tok, step, mini_batch_size=8, micro_batch_size=micro)


def value_batch(tok, worker):
    batch = worker.compute_values(synthetic_batch(len(tok)))
    g = torch.Generator().manual_seed(4)
    returns = batch.values + torch.randn(batch.values.shape, generator=g)
    returns[batch.response_mask == 0] = float("nan")  # garbage outside the mask
    return batch.replace(returns=returns)


def test_value_model_is_a_one_label_token_classifier_on_the_actor_backbone(tiny_dir):
    model = load_value_model(tiny_dir)
    assert model.config.num_labels == 1 and model.score.out_features == 1
    tok = load_tokenizer(tiny_dir)
    batch = critic(model, tok, 4).compute_values(synthetic_batch(len(tok)))
    assert batch.values.shape == batch.response_mask.shape
    assert torch.isfinite(batch.values).all()


@pytest.mark.parametrize("mode", AGG_MODES)
def test_one_micro_batch_equals_eight(tiny_dir, mode):
    """1 × 8 and 8 × 1 give the same critic update (global denominators)."""
    # The new value head is drawn from the global RNG, whose normal_ rounds differently by CPU
    # kernel level: the tolerance holds for any head (with token-sum at lr 0.5 the two
    # accumulation orders' rounding reaches ~1e-6 on ~1% of heads; a wrong denominator is ×8).
    torch.manual_seed(0)
    tok, base = load_tokenizer(tiny_dir), load_value_model(tiny_dir)
    batch = value_batch(tok, critic(copy.deepcopy(base), tok, 8))
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    metrics = [critic(m, tok, micro).update(batch, spec(mode)) for m, micro in
               zip(models, (8, 1), strict=True)]  # fmt: skip
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-4, abs=1e-6), key
    assert any(not torch.equal(a, b) for a, b in
               zip(base.parameters(), models[0].parameters(), strict=True))  # fmt: skip


def test_updates_move_values_towards_the_returns(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    worker = critic(load_value_model(tiny_dir), tok, 8, lr=0.05)
    batch = value_batch(tok, worker)
    m = batch.response_mask.bool()
    first = worker.update(batch, spec("token-mean", value_clip=None, epochs=20))
    after = worker.compute_values(batch).values
    before_err = ((batch.values - batch.returns)[m] ** 2).mean()
    after_err = ((after - batch.returns)[m] ** 2).mean()
    assert after_err < 0.5 * before_err
    assert first["critic/skipped"] == 0.0


def test_saved_critic_is_a_standard_hf_folder_that_loads_back(tiny_dir, tmp_path):
    tok = load_tokenizer(tiny_dir)
    worker = critic(load_value_model(tiny_dir), tok, 8)
    batch = value_batch(tok, worker)
    worker.update(batch, spec("token-mean"))
    worker.save_pretrained(tmp_path / "critic")
    plain = AutoModelForTokenClassification.from_pretrained(tmp_path / "critic")
    assert plain.config.num_labels == 1
    again = critic(load_value_model(tmp_path / "critic"), tok, 8)
    torch.testing.assert_close(again.compute_values(batch).values,
                               worker.compute_values(batch).values)  # fmt: skip


def test_state_dict_round_trip_gives_the_same_next_update(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    a = critic(load_value_model(tiny_dir), tok, 8)
    a.step.optimizer = torch.optim.AdamW(a.model.parameters(), lr=1e-2)
    a.step.scheduler = torch.optim.lr_scheduler.LambdaLR(a.step.optimizer, lambda s: 1 / (s + 1))
    batch = value_batch(tok, a)
    a.update(batch, spec("token-mean"))
    b = critic(load_value_model(tiny_dir), tok, 8)
    b.step.optimizer = torch.optim.AdamW(b.model.parameters(), lr=1e-2)
    b.step.scheduler = torch.optim.lr_scheduler.LambdaLR(b.step.optimizer, lambda s: 1 / (s + 1))
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    for w in (a, b):
        w.update(batch, spec("token-mean"))
    for p, q in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_a_reward_model_folder_gives_the_critic_its_backbone_and_head_weights(tiny_dir, tmp_path):
    """PPO's critic may start from a sequence-classification reward model: the backbone and the
    score weights load, only the (bias) term the RM lacks is new."""
    from transformers import AutoModelForSequenceClassification

    rm = AutoModelForSequenceClassification.from_pretrained(tiny_dir, num_labels=1)
    rm.save_pretrained(tmp_path / "rm")
    load_tokenizer(tiny_dir).save_pretrained(tmp_path / "rm")
    value = load_value_model(tmp_path / "rm")
    assert torch.equal(value.score.weight, rm.score.weight)
    rm_layer = rm.model.layers[0].mlp.up_proj.weight
    assert torch.equal(value.model.layers[0].mlp.up_proj.weight, rm_layer)
