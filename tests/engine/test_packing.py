"""Packed passes (keel.engine.packing, train.packing): rows concatenated without padding give
the padded pass's log-probs, entropy, values, scores and gradients, for every model family of
the family suite (tests/models/families.py)."""

import pytest
import torch

from keel.engine import forward
from keel.engine.forward import response_forward, score_forward, value_forward
from keel.engine.packing import pack
from keel.models import load_causal_lm, load_reward_model, load_value_model
from keel.types import Batch
from tests.engine.test_forward import grouped_batch
from tests.models.families import FAMILIES, build_family


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("packing-families")
    return {name: build_family(family, root / name) for name, family in FAMILIES.items()}


def skewed_batch(vocab: int) -> Batch:
    """Four distinct prompts of 2–9 tokens (left-padded to 9) and responses of 1–12 tokens
    (right-padded to 12, one with an observation hole in its response_mask): lengths as uneven
    as a rollout's, longer than the families' sliding window of 8."""
    g = torch.Generator().manual_seed(1)
    p, r = 9, 12
    ids, attention, trained = [], [], []
    for prompt_len, length in ((9, 12), (2, 1), (5, 7), (7, 3)):
        row = torch.randint(3, vocab, (p + r,), generator=g)
        mask = torch.zeros(p + r, dtype=torch.long)
        mask[p - prompt_len : p + length] = 1
        row[mask == 0] = 0
        ids.append(row)
        attention.append(mask)
        loss = mask[p:].float()
        if length > 4:
            loss[2:4] = 0  # tokens the environment wrote: attended to, not trained on
        trained.append(loss)
    return Batch(
        input_ids=torch.stack(ids),
        attention_mask=torch.stack(attention),
        response_mask=torch.stack(trained),
    )


def both_passes(model, batch, run):
    """[(output, grads)] of `run(model, batch, packing)` for packing off and on; eval mode (no
    dropout: GPT-2's would draw different masks), gradients of Σ output² over the mask."""
    model.eval()
    out = []
    for packing in (False, True):
        model.zero_grad()
        value = run(model, batch, packing)
        (value * batch.response_mask).pow(2).sum().backward()
        out.append((value.detach(), [p.grad.clone() for p in model.parameters()]))
    return out


def assert_same(results, mask, atol=1e-5):
    (a, grads_a), (b, grads_b) = results
    assert a.shape == b.shape
    torch.testing.assert_close(b[mask], a[mask], atol=atol, rtol=1e-5)
    for ga, gb in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(gb, ga, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_packed_log_probs_entropy_and_gradients_equal_the_padded_pass(name, family_dirs):
    model = load_causal_lm(family_dirs[name])
    batch = skewed_batch(model.config.vocab_size)

    def run(model, batch, packing):
        logprobs, entropy = response_forward(
            model, batch, temperature=0.7, with_entropy=True, packing=packing
        )
        return logprobs + entropy

    results = both_passes(model, batch, run)
    assert_same(results, batch.response_mask.bool())
    real = batch.attention_mask[:, 9:].bool()
    assert (results[1][0][~real] == 0).all()  # no response token, no value: 0


def test_a_micro_batch_longer_than_one_packed_sequence_runs_as_several(tiny_dir, monkeypatch):
    """PACK_TOKENS 12: the 4 rows (21, 3, 12, 10 real tokens) run as 4 packed sequences
    (3 and 12 do not fit in one)."""
    monkeypatch.setattr(forward, "PACK_TOKENS", 12)
    model = load_causal_lm(tiny_dir)
    batch = skewed_batch(model.config.vocab_size)
    calls = []
    hook = model.register_forward_pre_hook(lambda *_: calls.append(1))

    def run(model, batch, packing):
        logprobs, entropy = response_forward(model, batch, with_entropy=True, packing=packing)
        return logprobs + entropy

    results = both_passes(model, batch, run)
    hook.remove()
    assert len(calls) == 1 + 4  # the padded pass, then the packed ones
    assert_same(results, batch.response_mask.bool())


@pytest.mark.parametrize("name", ["qwen2", "gemma2", "gpt2"])
def test_packed_critic_values_and_reward_scores_equal_the_padded_pass(
    name, family_dirs, monkeypatch
):
    """(in packed sequences of 12 tokens: several per micro-batch)"""
    monkeypatch.setattr(forward, "PACK_TOKENS", 12)
    batch = skewed_batch(load_causal_lm(family_dirs[name]).config.vocab_size)
    critic = load_value_model(family_dirs[name])
    results = both_passes(critic, batch, lambda m, b, packing: value_forward(m, b, packing=packing))
    assert_same(results, batch.response_mask.bool())

    pad = critic.config.pad_token_id
    reward = load_reward_model(family_dirs[name], pad_token_id=pad)
    assert isinstance(reward.score, torch.nn.Module)  # the head the packed pass reads
    scored = batch.replace(input_ids=torch.where(batch.attention_mask.bool(), batch.input_ids, pad))
    scored.response_mask = torch.ones(len(batch), 1)  # one loss term per row
    results = both_passes(
        reward,
        scored,
        lambda m, b, packing: score_forward(m, b, packing=packing).unsqueeze(1),
    )
    assert_same(results, torch.ones(len(batch), 1, dtype=torch.bool))


def test_shared_prompts_keep_the_shared_pass_and_distinct_ones_are_packed(tiny_dir):
    """With train.share_prompts a batch whose rows share a prompt takes the shared pass (one
    prompt pass per group, as tests/engine/test_forward.py counts); rows with distinct prompts
    run as one packed row of their real tokens."""
    model = load_causal_lm(tiny_dir).eval()
    shapes = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    grouped = grouped_batch(model.config.vocab_size)
    distinct = grouped_batch(model.config.vocab_size, groups=4, n=1)
    with torch.no_grad():
        response_forward(model, grouped, share_prompts=True, packing=True)
        response_forward(model, distinct, share_prompts=True, packing=True)
    hook.remove()
    assert shapes == [(3, 6), (12, 4), (1, int(distinct.attention_mask.sum()))]


def test_pack_keeps_real_tokens_with_positions_per_row_and_refuses_holes():
    batch = skewed_batch(50)
    packed = pack(batch)
    assert packed is not None
    lengths = batch.attention_mask.sum(dim=1)
    assert packed.tokens == int(lengths.sum())
    expected = torch.cat([torch.arange(int(n)) for n in lengths])
    assert torch.equal(packed.position_ids[0], expected)
    assert torch.equal(packed.input_ids[0], batch.input_ids[batch.attention_mask.bool()])
    # each target predicts the next packed token, which is its label
    assert torch.equal(packed.input_ids[0, packed.targets + 1], packed.labels)
    holed = batch.attention_mask.clone()
    holed[0, 12] = 0  # a hole inside row 0's response
    assert pack(batch.replace(attention_mask=holed)) is None
    outside = batch.response_mask.clone()
    outside[1, 5] = 1  # a trained token the attention mask leaves out
    assert pack(batch.replace(response_mask=outside)) is None


def test_packed_rows_with_a_chunked_lm_head_equal_the_padded_whole_pass(tiny_dir):
    """train.logits_chunk_tokens with packing: the head runs on the predicting positions of the
    packed sequence, 5 tokens at a time."""
    model = load_causal_lm(tiny_dir)
    batch = skewed_batch(model.config.vocab_size)

    def run(model, batch, packing):
        logprobs, entropy = response_forward(
            model, batch, with_entropy=True, packing=packing, logits_chunk=5 if packing else None
        )
        return logprobs + entropy

    assert_same(both_passes(model, batch, run), batch.response_mask.bool())


def _fsdp_rank(rank: int, store: str, tiny_dir, out) -> None:
    """One of 2 FSDP2 ranks (PACK_TOKENS 12): rank 0 packs its skewed rows, which unsharded
    would run as several packed sequences; rank 1's two rows of equal length have no padding
    and run padded. Each must still make exactly one forward pass (FSDP2's collectives)."""
    from datetime import timedelta

    import torch.distributed as dist

    from keel.engine.distributed import shard_fsdp2

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(0, 120)
    )
    torch.set_num_threads(1)
    forward.PACK_TOKENS = 12
    model = shard_fsdp2(load_causal_lm(tiny_dir).eval())
    part = skewed_batch(model.config.vocab_size) if rank == 0 else _even_rows(model)
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    logprobs, _ = response_forward(model, part, temperature=0.7, packing=True)
    (logprobs * part.response_mask).sum().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    torch.save((logprobs.detach(), grads, len(calls)), out / f"rank{rank}.pt")
    dist.destroy_process_group()


def _even_rows(model) -> Batch:
    ids = torch.arange(3, 3 + 2 * 10).reshape(2, 10) % model.config.vocab_size
    attention = torch.ones(2, 10, dtype=torch.long)
    return Batch(input_ids=ids, attention_mask=attention, response_mask=torch.ones(2, 4))


def test_fsdp2_ranks_make_one_forward_each_whether_they_pack_or_not(tiny_dir, tmp_path):
    """2 FSDP2 ranks (gloo): one packs, one runs padded, each one forward pass; their
    log-probs and the reduced gradients equal one unsharded padded pass over both parts."""
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_rank, args=(str(tmp_path / "store"), tiny_dir, tmp_path), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [r[2] for r in ranks] == [1, 1]
    model = load_causal_lm(tiny_dir).eval()
    parts = [skewed_batch(model.config.vocab_size), _even_rows(model)]
    total = 0
    for rank, part in zip(ranks, parts, strict=True):
        logprobs, _ = response_forward(model, part, temperature=0.7)
        mask = part.response_mask.bool()
        torch.testing.assert_close(rank[0][mask], logprobs[mask], atol=1e-5, rtol=1e-5)
        total = total + (logprobs * part.response_mask).sum()
    total.backward()
    for got, p in zip(ranks[0][1], model.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad, atol=1e-5, rtol=1e-4)


def test_packed_rows_under_gradient_checkpointing_equal_the_padded_pass(tiny_dir):
    """train.gradient_checkpointing: each layer recomputed in the backward with the packed
    positions it ran with (the tiny Llama has no dropout, so training mode changes nothing
    else)."""
    model = load_causal_lm(tiny_dir)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = skewed_batch(model.config.vocab_size)
    results = []
    for packing in (False, True):
        model.train()
        model.zero_grad()
        logprobs, _ = response_forward(model, batch, packing=packing, share_prompts=True)
        (logprobs * batch.response_mask).pow(2).sum().backward()
        results.append((logprobs.detach(), [p.grad.clone() for p in model.parameters()]))
    assert (results[1][0][batch.attention_mask[:, 9:] == 0] == 0).all()  # it packed
    assert_same(results, batch.response_mask.bool())
