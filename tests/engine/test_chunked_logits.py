"""train.logits_chunk_tokens: the LM head a chunk of tokens at a time gives the whole pass's
log-probs, entropy and gradients, and never holds the [B, R, V] logits."""

from pathlib import Path

import pytest
import torch

from keel.config import validate
from keel.config.schema import TrainConfig
from keel.engine.chunked_logits import check_plain_head
from keel.engine.forward import pass_chunk, response_forward
from keel.engine.logits_budget import LOGITS_BOUND_BYTES
from keel.models import load_causal_lm
from keel.plan.inputs import worker_inputs
from keel.recipes import build_spec
from keel.types import Batch
from keel.workers.build import _logits_chunk, build_workers
from tests.engine.test_forward import grouped_batch
from tests.workers.test_actor import rl_spec, synthetic_batch


def _pass(model, batch, **options):
    model.zero_grad()
    logprobs, entropy = response_forward(
        model, batch, temperature=0.7, with_entropy=True, **options
    )
    mask = batch.response_mask
    ((logprobs * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
    return logprobs.detach(), entropy.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("share_prompts", [False, True])
@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_chunks_give_the_whole_pass(tiny_dir, share_prompts, chunk):
    """Chunks of 1 token, of 7 (not a divisor of a row's 5 response positions: chunks straddle
    rows) and of everything: the same log-probs, entropy and gradients as full logits."""
    model = load_causal_lm(tiny_dir).train()
    batch = grouped_batch(model.config.vocab_size)
    whole = _pass(model, batch, share_prompts=share_prompts)
    chunked = _pass(model, batch, share_prompts=share_prompts, logits_chunk=chunk)
    m = batch.response_mask.bool()
    torch.testing.assert_close(chunked[0][m], whole[0][m], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(chunked[1][m], whole[1][m], atol=1e-6, rtol=1e-6)
    for a, b in zip(chunked[2], whole[2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_lm_head_never_sees_more_than_a_chunk(tiny_dir):
    """Forward and the backward's recomputation alike: at most `chunk` rows of hidden states go
    through the LM head at once, and the no-grad entropy adds no graph."""
    model = load_causal_lm(tiny_dir).train()
    batch = grouped_batch(model.config.vocab_size)
    rows = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda _m, args, out: rows.append(out.shape[:-1].numel()))
    logprobs, entropy = response_forward(
        model, batch, with_entropy=True, entropy_grad=False, logits_chunk=8
    )
    forward_calls = len(rows)
    (logprobs * batch.response_mask).sum().backward()
    hook.remove()
    assert not entropy.requires_grad
    assert max(rows) <= 8
    assert forward_calls == -(-batch.response_mask.numel() // 8)
    assert len(rows) == 2 * forward_calls  # each chunk recomputed once in the backward


def test_a_no_grad_pass_in_chunks_equals_the_whole_one(tiny_dir):
    model = load_causal_lm(tiny_dir).eval()
    batch = grouped_batch(model.config.vocab_size)
    with torch.no_grad():
        whole = response_forward(model, batch, share_prompts=True)[0]
        chunked = response_forward(model, batch, share_prompts=True, logits_chunk=5)[0]
    m = batch.response_mask.bool()
    torch.testing.assert_close(chunked[m], whole[m], atol=1e-6, rtol=1e-6)


def _workers(tiny_dir, *, chunk, **models):
    cfg = validate({
        "models": {"actor": str(tiny_dir), **models},
        "algorithm": {"name": "grpo", "kl_loss_coef": 0.1},
        "rollout": {"n": 2},
        "train": {"batch_size": 4, "lr": 1e-3, "lr_schedule": "constant",
                  "logits_chunk_tokens": chunk},
    })  # fmt: skip
    return build_workers(worker_inputs(cfg, build_spec(cfg)), ("actor", "reference"), None)


@pytest.mark.parametrize("lora", [False, True])
def test_an_update_in_chunks_equals_the_whole_update(tiny_dir, lora):
    """The actor's update and the reference's log-probs with train.logits_chunk_tokens equal
    those without, for a full and a LoRA actor (whose reference is the adapter switched off)."""
    models = {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}} if lora else {}
    results = []
    for chunk in (None, 16):
        torch.manual_seed(0)
        built = _workers(tiny_dir, chunk=chunk, **models)
        actor, reference = built["actor"], built["reference"]
        assert actor.logits_chunk == chunk and reference.logits_chunk == chunk
        batch = synthetic_batch(actor.model.config.vocab_size)
        batch = reference.compute_ref_logprobs(batch)
        metrics = actor.update(batch, rl_spec("token-mean", kl=0.1))
        weights = [p.detach().clone() for p in actor.model.parameters() if p.requires_grad]
        results.append((batch.ref_logprobs, metrics["actor/loss"], weights))
    (ref_a, loss_a, w_a), (ref_b, loss_b, w_b) = results
    torch.testing.assert_close(ref_b, ref_a, atol=1e-6, rtol=1e-6)
    assert loss_b == pytest.approx(loss_a, abs=1e-6)
    for a, b in zip(w_a, w_b, strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5)


def test_a_model_with_logit_softcapping_is_refused_naming_the_setting(tiny_dir):
    model = load_causal_lm(tiny_dir)
    check_plain_head(model)  # a plain head: accepted
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match=r"train\.logits_chunk_tokens.*final_logit_softcapping"):
        check_plain_head(model)


def test_auto_chunks_a_large_vocabulary_and_equals_the_whole_pass():
    """train.logits_chunk_tokens: auto on a 2-row pass of 240 response tokens at Qwen2.5's
    151,936 vocabulary (278 MiB of float32 logits, above the bound): the head runs in chunks
    of 110 tokens, with the whole pass's log-probs, entropy and gradients."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    vocab, rows, prompt, r = 151_936, 2, 4, 240
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=prompt + r,
        tie_word_embeddings=True,
    )).train()  # fmt: skip
    assert rows * r * vocab * 4 > LOGITS_BOUND_BYTES
    assert pass_chunk(model, "auto", rows * r) == 110
    ids = torch.randint(3, vocab, (rows, prompt + r))
    attention = torch.ones_like(ids)
    attention[1, -40:] = 0  # the second response cut short
    batch = Batch(
        input_ids=ids, attention_mask=attention, response_mask=attention[:, prompt:].float()
    )
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda _m, args, out: seen.append(out.shape[:-1].numel())
    )
    auto = _pass(model, batch, logits_chunk="auto")
    assert max(seen) == 110  # chunks, never the whole [2, 240, V]
    whole = _pass(model, batch)
    hook.remove()
    m = batch.response_mask.bool()
    torch.testing.assert_close(auto[0][m], whole[0][m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(auto[1][m], whole[1][m], atol=1e-5, rtol=1e-5)
    for a, b in zip(auto[2], whole[2], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_auto_is_the_default_and_keeps_the_tiny_model_whole(tiny_dir):
    """The default (auto) reaches the workers; the tiny model's logits stay within the bound
    (the whole pass: golden curves unchanged); a model whose logits are not the plain head
    takes the whole pass under auto instead of being refused."""
    cfg = validate({"models": {"actor": str(tiny_dir)}, "algorithm": {"name": "grpo"}})
    assert cfg.train.logits_chunk_tokens == "auto"
    built = _workers(tiny_dir, chunk="auto")
    assert built["actor"].logits_chunk == "auto" and built["reference"].logits_chunk == "auto"
    assert pass_chunk(built["actor"].model, "auto", 64 * 1024) is None
    model = load_causal_lm(tiny_dir)
    model.config.final_logit_softcapping = 30.0
    assert _logits_chunk(model, TrainConfig()) is None
    assert _logits_chunk(model, TrainConfig(logits_chunk_tokens=0)) is None
    with pytest.raises(ValueError, match=r"train\.logits_chunk_tokens"):
        _logits_chunk(model, TrainConfig(logits_chunk_tokens=64))


def test_fsdp_groups_take_chunks(tiny_dir):
    cfg = validate({
        "models": {"actor": str(tiny_dir)}, "algorithm": {"name": "grpo"},
        "rollout": {"n": 2}, "train": {"batch_size": 4, "logits_chunk_tokens": 64},
        "resources": {"backend": "ray", "groups": [
            {"roles": ["actor", "rollout", "reference", "reward"], "workers": 2, "fsdp": True}]},
    })  # fmt: skip
    assert cfg.train.logits_chunk_tokens == 64


def _fsdp_rank(rank: int, store: str, tiny_dir: Path, out: Path) -> None:
    """One of 2 FSDP2 ranks: its half of the rows (two whole groups of 4 and 2 of another,
    so that the shared prompt pass shares and does not) through the chunked pass; its
    log-probs and entropy, and every parameter's reduced gradient (gathered), saved."""
    import torch.distributed as dist

    from keel.engine.distributed import shard_fsdp2

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = shard_fsdp2(load_causal_lm(tiny_dir).train())
    batch = grouped_batch(model.config.vocab_size)
    rows = slice(0, 6) if rank == 0 else slice(6, 12)
    part = type(batch)(
        input_ids=batch.input_ids[rows], attention_mask=batch.attention_mask[rows],
        response_mask=batch.response_mask[rows],
    )  # fmt: skip
    logprobs, entropy = response_forward(
        model, part, temperature=0.7, with_entropy=True, share_prompts=True, logits_chunk=7
    )
    mask = part.response_mask
    ((logprobs * mask).sum() + 0.1 * (entropy * mask).sum()).backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    torch.save((logprobs.detach(), entropy.detach(), grads), out / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_chunks_under_fsdp2_give_the_unsharded_whole_pass(tiny_dir, tmp_path):
    """2 FSDP2 ranks (gloo), each its half of the rows through the chunked pass (the decoder's
    states and the LM head outside `forward`, as the root's FSDP forward methods): the same
    log-probs and entropy as one unsharded pass with full logits over all rows, and gradients
    (summed over the ranks, as shard_fsdp2 reduces them) equal to that pass's."""
    import torch.multiprocessing as mp

    mp.spawn(_fsdp_rank, args=(str(tmp_path / "store"), tiny_dir, tmp_path), nprocs=2)
    model = load_causal_lm(tiny_dir).train()
    batch = grouped_batch(model.config.vocab_size)
    logprobs, entropy, grads = _pass(model, batch)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    m = batch.response_mask.bool()
    got_lp, got_ent = torch.cat([r[0] for r in ranks]), torch.cat([r[1] for r in ranks])
    torch.testing.assert_close(got_lp[m], logprobs[m], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_ent[m], entropy[m], atol=1e-6, rtol=1e-6)
    for got, want in zip(ranks[0][2], grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    for a, b in zip(ranks[0][2], ranks[1][2], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # both ranks hold the same reduced sum
