"""Reward models: the exported folder loads with plain transformers and scores the same; padding
and micro-batching never change scores or updates; rollout scoring combines, normalises, clips."""

import copy

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from keel.data.preference import (
    PreferencePair,
    encode_pairs,
    encode_scored,
    preference_splits,
)
from keel.engine import GradientStep
from keel.models import load_reward_model, load_tokenizer
from keel.rewards import RewardScorer
from keel.rewards.verifiers import even_answer
from keel.types import Batch
from keel.workers.reward_model import ModelRewardWorker, RewardModelTrainer


def trainer(tiny_dir, micro: int = 4, lr: float = 1e-3, model=None) -> RewardModelTrainer:
    """A trainer with SGD; `model` (copied) or a fresh scalar head on the tiny backbone."""
    tok = load_tokenizer(tiny_dir)
    if model is None:
        model = load_reward_model(tiny_dir, pad_token_id=tok.pad_token_id)
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    return RewardModelTrainer(
        model, tok, GradientStep(model, opt, sched, None), mini_batch_size=4, micro_batch_size=micro
    )


PAIRS = preference_splits(max_operand=30, eval_size=10)[0][:4]


def test_exported_folder_loads_with_transformers_alone_and_scores(tiny_dir, tmp_path):
    rm = trainer(tiny_dir)
    batch = encode_pairs(rm.tokenizer, PAIRS, chat=False, max_prompt_length=16)
    metrics = rm.update(batch)
    assert {"rm/loss", "rm/accuracy", "rm/margin", "rm/grad_norm"} <= set(metrics)
    rm.save_pretrained(tmp_path / "rm")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm")
    tok = AutoTokenizer.from_pretrained(tmp_path / "rm")
    assert model.config.num_labels == 1
    assert model.config.pad_token_id == tok.pad_token_id
    assert "ForSequenceClassification" in model.config.architectures[0]
    ours = rm.score(batch)
    for row, (pair, text) in enumerate((p, t) for p in PAIRS for t in (p.chosen, p.rejected)):
        ids = tok(pair.prompt + text + tok.eos_token, return_tensors="pt")  # one row, no padding
        with torch.no_grad():
            score = model(**ids).logits[0, 0]
        torch.testing.assert_close(score, ours[row], atol=1e-5, rtol=1e-4)


def test_padding_never_changes_a_score(tiny_dir):
    rm = trainer(tiny_dir)
    longer = PreferencePair(prompt="123+456=", chosen="579000", rejected="5791234")
    alone = rm.score(encode_pairs(rm.tokenizer, PAIRS[:1], chat=False, max_prompt_length=16))
    padded = rm.score(encode_pairs(rm.tokenizer, [longer, PAIRS[0]], chat=False,
                                   max_prompt_length=16))  # fmt: skip
    torch.testing.assert_close(padded[2:], alone, atol=1e-5, rtol=1e-4)


def test_micro_batching_never_changes_the_update(tiny_dir):
    base = trainer(tiny_dir).model  # the new head is random: both trainers start from one copy
    rms = [trainer(tiny_dir, micro=m, lr=1.0, model=base) for m in (4, 1)]
    batch = encode_pairs(rms[0].tokenizer, PAIRS, chat=False, max_prompt_length=16)
    metrics = [rm.update(batch) for rm in rms]
    for a, b in zip(rms[0].model.parameters(), rms[1].model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for key in ("rm/loss", "rm/accuracy", "rm/margin", "rm/grad_norm"):
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-4, abs=1e-6), key
    assert any(
        not torch.equal(a, b)
        for a, b in zip(base.parameters(), rms[0].model.parameters(), strict=True)
    )


def rollout_batch(tok) -> Batch:
    prompts = ["1+1=", "2+3=", "4+4=", "10+1="]
    responses = ["2", "5", "7", "12"]
    batch = encode_scored(tok, prompts, responses, chat=False)
    return batch.replace(prompts=prompts, responses=responses, answers=["2", "5", "8", "11"])


def test_rollout_scores_combine_normalise_and_clip(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    model = load_reward_model(tiny_dir, pad_token_id=tok.pad_token_id)
    rule = RewardScorer(even_answer, name="even")
    plain = ModelRewardWorker(model, tok, rule=None, batch_size=3)
    batch = rollout_batch(tok)
    raw = plain.model_scores(batch.prompts, batch.responses)
    torch.testing.assert_close(plain.score(batch).scores, raw)
    assert plain.score(batch).meta["reward_metrics"]["reward/model_mean"] == pytest.approx(
        raw.mean().item()
    )

    worker = ModelRewardWorker(
        model, tok, rule=rule, weight=2.0, fn_weight=0.5, normalize=True, clip=1.0, batch_size=3
    )
    out = worker.score(batch)
    z = (raw - raw.mean()) / raw.std(unbiased=False)
    want = 2.0 * z.clamp(-1.0, 1.0) + 0.5 * torch.tensor([1.0, 0.0, 0.0, 1.0])
    torch.testing.assert_close(out.scores, want, atol=1e-5, rtol=1e-4)
    assert out.meta["reward_metrics"]["reward/fn_mean"] == 0.5

    state = copy.deepcopy(worker.state_dict())
    worker.score(batch, update_stats=False)  # evaluation does not move the statistics
    assert worker.state_dict() == state
    worker.score(batch)
    assert worker.state_dict()["normalizer"]["count"] == 8
    fresh = ModelRewardWorker(model, tok, rule=None, normalize=True)
    fresh.load_state_dict(worker.state_dict())
    assert fresh.state_dict() == worker.state_dict()


def test_scores_do_not_depend_on_the_forward_batch_size(tiny_dir):
    tok = load_tokenizer(tiny_dir)
    model = load_reward_model(tiny_dir, pad_token_id=tok.pad_token_id)
    batch = rollout_batch(tok)
    one = ModelRewardWorker(model, tok, rule=None, batch_size=1).score(batch).scores
    four = ModelRewardWorker(model, tok, rule=None, batch_size=4).score(batch).scores
    torch.testing.assert_close(one, four, atol=1e-5, rtol=1e-4)
    # train.packing: the rows of each forward packed without their padding
    packed = ModelRewardWorker(model, tok, rule=None, batch_size=4, packing=True)
    shapes = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    scores = packed.score(batch).scores
    hook.remove()
    torch.testing.assert_close(scores, four, atol=1e-5, rtol=1e-4)
    assert len(shapes) == 1 and shapes[0][0] == 1  # the 4 rows as one packed sequence
