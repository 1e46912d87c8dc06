"""Keel's decode loop (`keel.rollout.decode.decoder`): generate's tokens and log-probs for the
same seed, rows joining and leaving at any step, and a batch that does not grow with uptime."""

import pytest
import torch

from keel.models import load_causal_lm, load_tokenizer
from keel.rollout import HFRolloutEngine, SamplingParams
from keel.rollout.decode import HFDecoder
from keel.rollout.protocol import Decoder, DecodingEngine, RowRequest
from tests.rollout.decode.conftest import TEXTS, token_prompts


@pytest.mark.parametrize("share_prefill", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_loop_samples_generates_tokens_as_rows_finish(eager_eos, temperature, share_prefill):
    """Rows ending at many different steps (so the loop drops them from the batch): the same
    tokens and log-probs as HF generate for the same seed, and the random stream ends where
    generate leaves it; a continuation of a conversation (a long prompt of earlier turns)."""
    model, tok = eager_eos
    texts = TEXTS
    sampling = SamplingParams(n=4, temperature=temperature, top_p=0.95, max_new_tokens=24)
    results = {}
    for loop in ("generate", "keel", "static"):
        engine = HFRolloutEngine(
            model, tok, return_logprobs=True, share_prefill=share_prefill, decode_loop=loop
        )
        torch.manual_seed(3)
        first = engine.generate_ids(token_prompts(tok, texts), sampling)
        # a second turn: the first row's prompt, its answer and more text, as environments do
        more = token_prompts(tok, [" and 3+4="])[0]
        turn = [token_prompts(tok, texts)[0] + first.token_ids[0] + more]
        second = engine.generate_ids(turn, sampling)
        results[loop] = (first, second, torch.rand(4))
    a1, a2, ra = results["generate"]
    lengths = {len(t) for t in a1.token_ids}
    assert len(lengths) >= (2 if temperature == 0 else 4)  # rows ended at different steps
    for loop in ("keel", "static"):  # static: padded buckets, attention over masked columns
        b1, b2, rb = results[loop]
        assert b1.token_ids == a1.token_ids and b2.token_ids == a2.token_ids
        assert b1.finish_reasons == a1.finish_reasons
        for got, want in ((b1, a1), (b2, a2)):
            assert got.logprobs is not None and want.logprobs is not None
            for x, y in zip(got.logprobs, want.logprobs, strict=True):
                torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-5, rtol=1e-5)
        assert torch.equal(ra, rb)


def _alone(model, tok, prompt, sampling):
    decoder = HFDecoder(model, [tok.eos_token_id], tok.pad_token_id)
    decoder.join([RowRequest("x", prompt, sampling)])
    out = []
    while decoder.live:
        out.extend(decoder.step())
    return [t.token for t in out], [t.logprob for t in out]


@pytest.mark.parametrize("loop", ["keel", "static"])
def test_rows_join_a_running_batch_and_decode_as_alone(tiny_dir, loop):
    """A row joining at step 5, another at step 9: each yields the tokens and log-probs it yields
    alone, the running rows go on undisturbed, and tokens come back in join order."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir).eval()
    engine = HFRolloutEngine(model, tok, decode_loop=loop)
    assert isinstance(engine, DecodingEngine)
    decoder = engine.decoder()
    assert isinstance(decoder, Decoder)
    greedy = SamplingParams(temperature=0, max_new_tokens=14)
    texts = ["1+1=", "a longer prompt than the first=", "7"]
    prompts = dict(zip("abc", token_prompts(tok, texts), strict=True))
    joins = {0: "a", 5: "b", 9: "c"}
    got: dict[str, list] = {k: [] for k in prompts}
    step = 0
    while step == 0 or decoder.live:
        if step in joins:
            key = joins[step]
            decoder.join([RowRequest(key, prompts[key], greedy)])
        tokens = decoder.step()
        live_keys = [t.key for t in tokens]
        assert live_keys == sorted(live_keys)  # join order: a, b, c
        for t in tokens:
            got[t.key].append(t)
        step += 1
    for key, prompt in prompts.items():
        ids, logps = _alone(model, tok, prompt, greedy)
        assert [t.token for t in got[key]] == ids
        torch.testing.assert_close(torch.tensor([t.logprob for t in got[key]]),
                                   torch.tensor(logps), atol=1e-5, rtol=1e-5)  # fmt: skip
        assert got[key][-1].finish in ("stop", "length")
        assert all(t.finish is None for t in got[key][:-1])


def test_leaving_rows_free_their_slots_and_the_batch_stays_small(tiny_dir):
    """leave() frees a row at once; finished rows leave the forward's batch; rows joining and
    leaving for many steps do not grow the cache past what the live rows use."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir).eval()
    decoder = HFDecoder(model, [tok.eos_token_id], tok.pad_token_id)
    long = SamplingParams(temperature=0.8, max_new_tokens=10_000)
    prompt = token_prompts(tok, ["3*4="])[0]
    decoder.join([RowRequest(i, prompt, long) for i in range(8)])
    decoder.step()
    decoder.leave([0, 1, 2, 99])  # 99: unknown, ignored
    assert decoder.live == 5
    tokens = decoder.step()
    assert {t.key for t in tokens} == {3, 4, 5, 6, 7}
    assert len(decoder.rows) == 5  # three of eight left: the batch was rebuilt without them
    live = [t.key for t in tokens if t.finish is None]
    widths = []
    for k in range(40):  # the oldest row leaves and a new one joins, every step
        decoder.leave([live.pop(0)])
        live.append(100 + k)
        decoder.join([RowRequest(100 + k, prompt, long)])
        tokens = decoder.step()
        assert [t.key for t in tokens] == live
        live = [t.key for t in tokens if t.finish is None]
        assert decoder.live == len(live)
        widths.append(decoder.T)
    # every live row joined at most ~8 steps ago: the columns no live row uses were dropped
    assert max(widths[10:]) <= len(prompt) + 12
    decoder.leave(live)
    assert decoder.live == 0 and decoder.step() == []
    with pytest.raises(ValueError, match="unique"):
        decoder.join([RowRequest("k", prompt, long), RowRequest("k", prompt, long)])


def test_the_eager_attention_kernel_decodes_as_generate(tiny_dir):
    """With attn_implementation eager the decode step's mask is additive: generate's tokens."""
    tok = load_tokenizer(tiny_dir)
    model = load_causal_lm(tiny_dir, attn_implementation="eager").eval()
    sampling = SamplingParams(n=2, temperature=0.8, max_new_tokens=12)
    out = {}
    for loop in ("generate", "keel", "static"):
        engine = HFRolloutEngine(model, tok, return_logprobs=True, decode_loop=loop)
        torch.manual_seed(4)
        out[loop] = engine.generate_ids(token_prompts(tok, TEXTS), sampling)
    for loop in ("keel", "static"):
        assert out[loop].token_ids == out["generate"].token_ids
        for x, y in zip(out[loop].logprobs, out["generate"].logprobs, strict=True):
            torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-5, rtol=1e-5)
