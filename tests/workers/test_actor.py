"""ActorWorker updates: micro-batching never changes the update; the loss terms compose."""

import copy
import itertools
from types import SimpleNamespace

import pytest
import torch

from keel.algo.spec import AlgorithmSpec
from keel.engine import GradientStep
from keel.models import load_causal_lm, load_tokenizer
from keel.types import Batch
from keel.workers import ActorWorker

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
             "seq-mean-token-sum-norm"]  # fmt: skip


def rl_spec(mode: str, kl: float = 0.0, entropy: float = 0.0) -> AlgorithmSpec:
    roles = {"actor", "rollout", "reward"} | ({"reference"} if kl else set())
    return AlgorithmSpec(
        name="test", stage="rl", roles=frozenset(roles), loss_agg_mode=mode, advantage="grpo",
        policy_loss="vanilla", policy_loss_kwargs={"clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
                                                   "clip_ratio_c": 3.0},
        kl_loss_coef=kl, entropy_coeff=entropy,
    )  # fmt: skip


def synthetic_batch(vocab: int, b: int = 8, p: int = 4, r: int = 5) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (b, p + r), generator=g)
    attention = torch.ones(b, p + r, dtype=torch.long)
    attention[0, :2] = 0  # left padding in one prompt
    lengths = torch.tensor([5, 1, 3, 0, 5, 2, 4, 5])  # one fully masked row
    mask = (torch.arange(r)[None, :] < lengths[:, None]).float()
    attention[:, p:] = mask.long()
    adv = torch.randn(b, 1, generator=g).expand(b, r).clone()
    adv[mask == 0] = float("nan")  # garbage outside the mask must not matter
    return Batch(
        input_ids=ids, attention_mask=attention, response_mask=mask, advantages=adv,
        old_logprobs=torch.full((b, r), -4.0), ref_logprobs=torch.full((b, r), -4.5),
    )  # fmt: skip


def sgd_actor(model, tok, micro: int) -> ActorWorker:
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    step = GradientStep(model, opt, sched, grad_clip=None)
    return ActorWorker(model, tok, step, temperature=1.0, mini_batch_size=8, micro_batch_size=micro)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_one_micro_batch_equals_four(tiny_dir, mode):
    """1 × 8 and 4 × 2 give the same update (global denominators, docs/algorithms.md §1)."""
    tok, base = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    batch = synthetic_batch(len(tok))
    spec = rl_spec(mode, kl=0.1, entropy=0.01)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    metrics = [
        sgd_actor(m, tok, micro).update(batch, spec)
        for m, micro in zip(models, (8, 2), strict=True)
    ]
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    for key in ("actor/pg_loss", "actor/kl", "actor/entropy", "actor/loss", "actor/grad_norm"):
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-4, abs=1e-6), key
    changed = any(
        not torch.equal(a, b)
        for a, b in zip(base.parameters(), models[0].parameters(), strict=True)
    )
    assert changed


def test_update_is_finite_with_nan_outside_mask(tiny_dir):
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    batch = synthetic_batch(len(tok))
    metrics = sgd_actor(model, tok, 4).update(batch, rl_spec("token-mean", kl=0.1))
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert metrics["actor/skipped"] == 0.0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_non_finite_gradient_skips_the_update(tiny_dir):
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    batch = synthetic_batch(len(tok))
    batch.advantages[batch.response_mask.bool()] = float("inf")
    before = copy.deepcopy(model.state_dict())
    metrics = sgd_actor(model, tok, 8).update(batch, rl_spec("token-mean"))
    assert metrics["actor/skipped"] == 1.0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_rollout_correction_weights_on_the_batch_multiply_each_tokens_term(tiny_dir):
    """Decoupled rollout correction stores its IS weights on the batch (rollout_is_weights):
    weights of 1 give the unweighted update bit for bit; weights of 2 double the gradient
    (SGD: twice the step)."""
    tok, base = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    batch = synthetic_batch(len(tok))
    spec = rl_spec("token-mean")

    def step(b: Batch) -> list[torch.Tensor]:
        model = copy.deepcopy(base)
        sgd_actor(model, tok, 4).update(b, spec)
        return [p.detach() - q.detach() for p, q in zip(model.parameters(), base.parameters(),
                                                        strict=True)]  # fmt: skip

    plain = step(batch)
    ones = step(batch.replace(rollout_is_weights=torch.ones_like(batch.old_logprobs)))
    assert all(torch.equal(a, b) for a, b in zip(plain, ones, strict=True))
    doubled = step(batch.replace(rollout_is_weights=torch.full_like(batch.old_logprobs, 2.0)))
    for a, b in zip(plain, doubled, strict=True):
        torch.testing.assert_close(b, 2 * a, atol=1e-6, rtol=1e-4)


class EmbeddingLM(torch.nn.Module):
    """A causal-LM-shaped module (embedding → linear head) whose forward is value-independent,
    so it runs on the meta device (transformers' mask building reads values)."""

    def __init__(self, vocab: int, width: int = 8):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep, use_cache):
        hidden = self.embed(input_ids) * attention_mask[..., None] + position_ids[..., None]
        return SimpleNamespace(logits=self.head(hidden[:, -logits_to_keep:]))


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo"])
def test_the_actor_loss_runs_on_the_meta_device(tiny_dir, policy_loss):
    """The actor's loss (log-probs, policy loss, TIS weights, entropy, KL, aggregation,
    metrics) and its backward allocate nothing on the host: on the `meta` device any host
    tensor mixed in would raise (a GPU run would crash the same way)."""
    tok = load_tokenizer(tiny_dir)
    with torch.device("meta"):
        model = EmbeddingLM(len(tok))
    spec = rl_spec("seq-mean-token-mean", kl=0.1, entropy=0.01)
    spec = AlgorithmSpec(**{**spec.__dict__, "policy_loss": policy_loss, "policy_loss_kwargs": {}})
    actor = ActorWorker(model, tok, None, temperature=0.7, mini_batch_size=8, micro_batch_size=8)
    batch = synthetic_batch(len(tok))
    batch = batch.replace(rollout_is_weights=torch.full_like(batch.old_logprobs, 1.5)).to("meta")
    loss, metrics = actor._policy_loss(batch, spec=spec, kl_coef=0.1, num_tokens=25, num_seqs=7)
    loss.backward()
    assert loss.device.type == "meta"
    assert {v.device.type for v in metrics.values()} == {"meta"}
    assert model.head.weight.grad.device.type == "meta"
    on_policy = batch.replace(old_logprobs=None)  # the on-policy shortcut's path
    assert actor._policy_loss(on_policy, spec=spec, kl_coef=0.1, num_tokens=25, num_seqs=7)[
        0
    ].device == torch.device("meta")


def holed_batch(vocab: int) -> Batch:
    """synthetic_batch as multi-turn episodes: response columns 1-2 of rows 0, 2, 4-7 are an
    observation (attended to, mask 0) between two turns of the policy."""
    batch = synthetic_batch(vocab)
    holes = torch.zeros_like(batch.response_mask, dtype=torch.bool)
    holes[[0, 2, 4, 5, 6, 7], 1:3] = True
    holes &= batch.response_mask.bool()
    return batch.replace(
        response_mask=torch.where(holes, 0.0, batch.response_mask),
        rollout_logprobs=torch.full_like(batch.response_mask, -4.2),
        rollout_is_weights=torch.full_like(batch.response_mask, 1.5),
        meta={"holes": holes},
    )


@pytest.mark.parametrize("mode", AGG_MODES)
def test_observation_tokens_do_not_reach_the_gradient(tiny_dir, mode):
    """Every per-token input of the loss perturbed at the observation tokens (advantages,
    old, reference and rollout log-probs): the update is bitwise the same; and the gradient
    reaching the logits that predict observation tokens is exactly 0 (it is not at the
    policy's tokens)."""
    tok, base = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    batch = holed_batch(len(tok))
    holes = batch.meta["holes"]
    g = torch.Generator().manual_seed(1)

    def noise(t: torch.Tensor) -> torch.Tensor:
        return torch.where(holes, torch.randn(t.shape, generator=g) * 50 - 3, t)

    perturbed = batch.replace(
        advantages=noise(batch.advantages),
        old_logprobs=noise(batch.old_logprobs),
        ref_logprobs=noise(batch.ref_logprobs),
        rollout_logprobs=noise(batch.rollout_logprobs),
        rollout_is_weights=noise(batch.rollout_is_weights),
    )
    spec = rl_spec(mode, kl=0.1, entropy=0.01)
    models = [copy.deepcopy(base), copy.deepcopy(base)]
    logits: list[torch.Tensor] = []

    def keep(module, args, output):
        output.retain_grad()
        logits.append(output)

    models[0].lm_head.register_forward_hook(keep)
    for model, b in zip(models, (batch, perturbed), strict=True):
        sgd_actor(model, tok, 8).update(b, spec)
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        assert torch.equal(a, b)
    r = batch.response_length
    assert len(logits) == 1 and logits[0].shape[1] == r + 1  # logits_to_keep = R + 1
    grad = logits[0].grad[:, :r].abs().sum(dim=-1)  # [B, R]: at the position predicting column j
    assert (grad[holes] == 0).all()
    assert (grad[batch.response_mask.bool()] > 0).any()


def zero_advantage_updates(base, tok, coef: float, steps: int = 4) -> list[float]:
    """actor/entropy before each of `steps` SGD updates on one batch whose advantages are all
    0 (no policy-gradient signal, no KL term): only the entropy bonus c_H·H moves the policy."""
    batch = synthetic_batch(len(tok))
    batch = batch.replace(advantages=torch.zeros_like(batch.advantages), old_logprobs=None)
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    actor = ActorWorker(model, tok, GradientStep(model, opt, sched, grad_clip=None),
                        temperature=1.0, mini_batch_size=8, micro_batch_size=4)  # fmt: skip
    spec = rl_spec("token-mean", entropy=coef)
    history = [actor.update(batch, spec) for _ in range(steps)]
    assert all(m["actor/pg_loss"] == 0.0 for m in history)
    return [m["actor/entropy"] for m in history]


def test_the_entropy_bonus_raises_the_entropy_and_a_negative_one_lowers_it(tiny_dir):
    """With zero advantages the loss is −c_H·H: c_H = +0.1 makes the entropy rise update after
    update, c_H = −0.1 makes it fall, and c_H = 0 leaves the policy where it is."""
    tok, base = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    up = zero_advantage_updates(base, tok, +0.1)
    down = zero_advantage_updates(base, tok, -0.1)
    still = zero_advantage_updates(base, tok, 0.0)
    start = pytest.approx(still[0], rel=1e-5)  # the same policy before the first update
    assert up[0] == start and down[0] == start
    assert all(b > a for a, b in itertools.pairwise(up)), up
    assert all(b < a for a, b in itertools.pairwise(down)), down
    assert still == pytest.approx([still[0]] * len(still), rel=1e-6)
    assert up[-1] - up[0] > 5e-4 and down[0] - down[-1] > 5e-4  # float noise: ~1e-6


def test_the_logged_loss_is_pg_minus_the_entropy_bonus_plus_the_kl_term(tiny_dir):
    """actor/loss = pg_loss − c_H·entropy + β·kl, with every term live (non-zero advantages,
    a reference) and β the controller's coefficient, not the spec's."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    batch = synthetic_batch(len(tok))
    spec = rl_spec("token-mean", kl=0.05, entropy=0.1)
    m = sgd_actor(model, tok, 4).update(batch, spec, kl_coef=0.2)
    assert min(abs(m["actor/pg_loss"]), m["actor/entropy"], m["actor/kl"]) > 1e-3
    expected = m["actor/pg_loss"] - 0.1 * m["actor/entropy"] + 0.2 * m["actor/kl"]
    assert m["actor/loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
