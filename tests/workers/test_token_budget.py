"""train.max_tokens_per_micro_batch: micro-batches packed by a token budget, padding removed,
give the same gradients, metrics and no-grad outputs (in the batch's row order) as the padded
rows-per-micro-batch path, for the actor (RL, SFT), the reference, the critic, DPO and the RM;
so do they with train.packing (`packed`: the budget counts real tokens and every forward pass
runs its rows concatenated without padding, keel.engine.packing).

The two paths run other batch shapes (rows per micro-batch, padded width), so their kernels
round differently, and by other amounts on other CPUs: every comparison is up to float32
rounding (rtol 1e-5), never bitwise; a wrong denominator or a lost row moves far more."""

import copy

import pytest
import torch

from keel.algo.spec import AlgorithmSpec
from keel.data.preference import PreferencePair, encode_pairs, preference_splits
from keel.engine import GradientStep
from keel.models import load_causal_lm, load_reward_model, load_tokenizer, load_value_model
from keel.types import Batch
from keel.workers import ActorWorker, CriticWorker, ReferenceWorker
from keel.workers.dpo import DPOWorker
from keel.workers.reward_model import RewardModelTrainer
from tests.workers.test_actor import rl_spec

RTOL = 1e-5  # measured apart by at most 3.6e-7 of a tensor's largest value
BUDGET = 60  # padded tokens per micro-batch; the batch below is 8 × (12 + 14) = 208
PROMPTS = [12, 1, 3, 7, 2, 12, 5, 1]
RESPONSES = [14, 2, 0, 9, 14, 1, 3, 6]  # one row without response tokens


def skewed_batch(vocab: int, p: int = 12, r: int = 14) -> Batch:
    """Rows of very different real lengths in the rollout layout; NaN outside the mask in the
    per-token inputs (they must not matter)."""
    b = len(PROMPTS)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (b, p + r), generator=g)
    attention = torch.zeros(b, p + r, dtype=torch.long)
    mask = torch.zeros(b, r)
    for i, (pl, rl) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        attention[i, p - pl : p + rl] = 1
        mask[i, :rl] = 1
    ids[attention == 0] = 0
    adv = torch.randn(b, 1, generator=g).expand(b, r).clone()
    adv[mask == 0] = float("nan")
    return Batch(input_ids=ids, attention_mask=attention, response_mask=mask, advantages=adv,
                 ref_logprobs=torch.full((b, r), -4.5))  # fmt: skip


def sgd(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return GradientStep(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), None)


PACKING = pytest.mark.parametrize("packed", [False, True], ids=["trimmed", "packed"])


def actor(model, tok, budget, *, mini: int = 8, micro: int = 8, packed=False) -> ActorWorker:
    return ActorWorker(model, tok, sgd(model), temperature=0.7, mini_batch_size=mini,
                       micro_batch_size=micro, max_tokens_per_micro_batch=budget,
                       packing=packed)  # fmt: skip


def assert_same(models, metrics, prefix):
    """Equal gradients (of the last update), parameters and metrics."""
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        # gradients reach 2.1 here (the pair losses): 7.7e-7 apart, so atol 1e-5
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=RTOL)
        torch.testing.assert_close(a, b, atol=1e-6, rtol=RTOL)
    assert metrics[0].keys() == metrics[1].keys()
    for key in metrics[0]:
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-5, abs=1e-6), key
    assert any(k.startswith(prefix) for k in metrics[0])


def with_old_logprobs(worker, batch):
    """old_logprobs from `worker`, perturbed so that the PPO clip is active for some tokens."""
    out = worker.compute_logprobs(batch)
    noise = 0.3 * torch.randn(out.old_logprobs.shape, generator=torch.Generator().manual_seed(2))
    return out.replace(old_logprobs=out.old_logprobs + noise)


@PACKING
@pytest.mark.parametrize(
    ("mode", "mini", "epochs"),
    [("seq-mean-token-mean", 8, 1), ("seq-mean-token-sum-norm", 4, 2), ("token-mean", 8, 1)],
)
def test_rl_update_equals_the_padded_path(tiny_dir, mode, mini, epochs, packed):
    tok, base = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    batch = with_old_logprobs(actor(copy.deepcopy(base), tok, None), skewed_batch(len(tok)))
    spec = rl_spec(mode, kl=0.1, entropy=0.01)
    spec = spec.__class__(**{**spec.__dict__, "ppo_epochs": epochs})
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    workers = [
        actor(models[0], tok, None, mini=mini),
        actor(models[1], tok, BUDGET, mini=mini, packed=packed),
    ]
    assert len(workers[1].micro_batches(batch)) >= 2  # the budget does split the batch
    metrics = [w.update(batch, spec) for w in workers]
    assert_same(models, metrics, "actor/")
    assert metrics[0]["actor/clipfrac"] > 0


@PACKING
def test_sft_update_equals_the_padded_path(tiny_dir, packed):
    tok, base = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    batch = skewed_batch(len(tok))
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    for mode in ("token-mean", "seq-mean-token-sum-norm"):
        spec = AlgorithmSpec(
            name="sft", stage="sft", roles=frozenset({"actor"}), loss_agg_mode=mode
        )
        metrics = [actor(m, tok, b, micro=2, packed=k).sft_update(batch, spec)
                   for m, b, k in zip(models, (None, BUDGET), (False, packed),
                                      strict=True)]  # fmt: skip
        assert_same(models, metrics, "actor/sft_loss")


@PACKING
def test_logprobs_and_ref_logprobs_equal_the_padded_path_in_row_order(tiny_dir, packed):
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    batch = skewed_batch(len(tok))
    mask = batch.response_mask.bool()
    for budget in (1, BUDGET, 10_000):  # one row each, several, one micro-batch
        padded = actor(model, tok, None, micro=3).compute_logprobs(batch).old_logprobs
        trimmed = actor(model, tok, budget, packed=packed).compute_logprobs(batch).old_logprobs
        assert trimmed.shape == padded.shape
        torch.testing.assert_close(trimmed[mask], padded[mask], atol=1e-6, rtol=RTOL)
        if packed and budget == 10_000:  # packed: 0 where no response token is (not padded)
            assert (trimmed[batch.attention_mask[:, -14:] == 0] == 0).all()
            assert (padded[batch.attention_mask[:, -14:] == 0] != 0).any()
        ref = [ReferenceWorker(model, temperature=0.7, micro_batch_size=8,
                               max_tokens_per_micro_batch=b,
                               packing=k).compute_ref_logprobs(batch)
               for b, k in ((None, False), (budget, packed))]  # fmt: skip
        torch.testing.assert_close(ref[1].ref_logprobs[mask], padded[mask], atol=1e-6, rtol=RTOL)
        # 8 rows at once against micro-batches of 3: other shapes, equal up to rounding only
        torch.testing.assert_close(ref[0].ref_logprobs, padded, atol=1e-6, rtol=RTOL)


def critic(model, tok, budget, micro: int = 8, packed=False) -> CriticWorker:
    return CriticWorker(model, tok, sgd(model), mini_batch_size=4, micro_batch_size=micro,
                        max_tokens_per_micro_batch=budget, packing=packed)  # fmt: skip


@PACKING
def test_critic_values_and_update_equal_the_padded_path(tiny_dir, packed):
    tok, base = load_tokenizer(tiny_dir), load_value_model(tiny_dir)
    batch = skewed_batch(len(tok))
    mask = batch.response_mask.bool()
    values = [critic(base, tok, b, micro=3, packed=k).compute_values(batch).values
              for b, k in ((None, False), (BUDGET, packed))]  # fmt: skip
    torch.testing.assert_close(values[1][mask], values[0][mask], atol=1e-6, rtol=RTOL)
    g = torch.Generator().manual_seed(4)
    returns = values[0] + torch.randn(values[0].shape, generator=g)
    returns[~mask] = float("nan")
    old = values[0] + 0.5 * torch.randn(values[0].shape, generator=g)  # the value clip acts
    batch = batch.replace(values=old, returns=returns)
    spec = AlgorithmSpec(name="test", stage="rl", roles=frozenset({"actor", "critic"}),
                         loss_agg_mode="seq-mean-token-sum-norm", advantage="gae",
                         cliprange_value=0.2)  # fmt: skip
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    metrics = [critic(m, tok, b, packed=k).update(batch, spec)
               for m, b, k in zip(models, (None, BUDGET), (False, packed),
                                  strict=True)]  # fmt: skip
    assert_same(models, metrics, "critic/")
    assert metrics[0]["critic/vf_clipfrac"] > 0


PAIRS = [
    *preference_splits(max_operand=30, eval_size=10)[0][:3],
    PreferencePair(prompt="123+456=", chosen="579000", rejected="5791234"),
]


@PACKING
def test_pair_updates_equal_the_padded_path(tiny_dir, packed):
    """DPO and RM: pairs stay together in a micro-batch, so the pairwise losses are unchanged."""
    tok, base = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    batch = encode_pairs(tok, PAIRS, chat=False, max_prompt_length=16)
    ref = ReferenceWorker(copy.deepcopy(base), temperature=1.0, micro_batch_size=8)
    batch = ref.compute_ref_logprobs(batch)
    noise = torch.randn(batch.ref_logprobs.shape, generator=torch.Generator().manual_seed(3))
    batch = batch.replace(ref_logprobs=batch.ref_logprobs + noise)  # margins away from 0
    spec = AlgorithmSpec(
        name="dpo", stage="dpo", roles=frozenset({"actor", "reference"}), loss_agg_mode="token-sum",
        preference_loss="ipo_mean", preference_loss_kwargs={"beta": 0.5, "label_smoothing": 0.0},
    )  # fmt: skip
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    workers = [DPOWorker(m, tok, sgd(m), temperature=1.0, mini_batch_size=4, micro_batch_size=4,
                         max_tokens_per_micro_batch=b, packing=k)
               for m, b, k in zip(models, (None, 40), (False, packed), strict=True)]  # fmt: skip
    assert len(workers[1].micro_batches(batch, pairs=True)) > 1
    logps = [w.sequence_logps(batch) for w in workers]
    torch.testing.assert_close(logps[1], logps[0], atol=1e-5, rtol=RTOL)
    assert_same(models, [w.update_pairs(batch, spec) for w in workers], "dpo/")

    rm = load_reward_model(tiny_dir, pad_token_id=tok.pad_token_id)
    models = [copy.deepcopy(rm), copy.deepcopy(rm)]
    trainers = [RewardModelTrainer(m, tok, sgd(m), mini_batch_size=4, micro_batch_size=4,
                                   max_tokens_per_micro_batch=b, packing=k)
                for m, b, k in zip(models, (None, 40), (False, packed), strict=True)]  # fmt: skip
    scores = [t.score(batch) for t in trainers]
    torch.testing.assert_close(scores[1], scores[0], atol=1e-6, rtol=RTOL)
    assert_same(models, [t.update(batch) for t in trainers], "rm/")


def test_grpo_run_with_a_token_budget_matches_the_padded_run(tiny_grpo, tmp_path):
    """End to end (tiny model, 2 steps): with the same seed the first step samples the same
    rollouts, and its losses, KL, entropy and gradient norm with a token budget over packed rows
    agree with the padded run's (padded rows, no budget). The
    untrained model stops at a random EOS, so response lengths vary (3 to 48 tokens)."""
    from keel.controller import run_training
    from keel.monitor import read_metrics

    first = []
    runs = (
        ("padded", ["train.packing=false"]),
        ("budget", ["train.max_tokens_per_micro_batch=150"]),
    )
    for name, extra in runs:  # the budget run packs its rows (train.packing, the default)
        cfg = tiny_grpo("train.steps=2", "rollout.max_new_tokens=48", "train.micro_batch_size=2",
                        "checkpoint.save_steps=0", f"run_dir={tmp_path / name}",
                        *extra)  # fmt: skip
        run_training(cfg)
        rows = read_metrics(tmp_path / name / "metrics.jsonl")
        assert [r["step"] for r in rows] == [0, 1, 2]
        first.append(rows[1])
    keys = [k for k in first[0] if not k.startswith(("timing/", "perf/", "system/"))]
    assert "actor/pg_loss" in keys and "actor/kl" in keys and "actor/grad_norm" in keys
    for key in keys:
        assert first[1][key] == pytest.approx(first[0][key], abs=1e-5), key
