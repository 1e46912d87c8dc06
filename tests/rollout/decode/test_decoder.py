"""Keel's decode loop (`keel.rollout.decode`): generate's tokens and log-probs for the same
seed, rows joining and leaving at any step, and a batch that does not grow with uptime."""

import copy

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopPLogitsWarper

from keel.models import load_causal_lm, load_tokenizer
from keel.rollout import HFRolloutEngine, SamplingParams
from keel.rollout.decode import HFDecoder
from keel.rollout.decode.sampling import sample_tokens
from keel.rollout.protocol import Decoder, DecodingEngine, RowRequest


@pytest.fixture(scope="module")
def eager_eos(tiny_dir):
    """The tiny model with EOS made likely, and its tokenizer: EOS's output row is the row of
    the token greedy decoding picks most, a little longer, so EOS takes that token's place
    where it wins (rows end at different steps, greedily too)."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir).eval()
    greedy = SamplingParams(n=1, temperature=0, max_new_tokens=24)
    out = HFRolloutEngine(model, tok).generate_ids(_prompts(tok, TEXTS), greedy)
    common = torch.tensor([t for row in out.token_ids for t in row]).mode().values
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] = 1.01 * model.lm_head.weight[common]
    return model, tok


TEXTS = ["1+1=", "12+34=", "7=", "a much longer prompt, 9*9=", "2"]


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.8), (1.3, 0.95)])
def test_sampling_is_generates_multinomial_draw(temperature, top_p):
    """sample_tokens draws as generate's warpers + torch.multinomial do, from the same stream."""
    torch.manual_seed(0)
    logits = 3 * torch.randn(16, 50)
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    torch.manual_seed(7)
    expected = torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1)
    after = torch.rand(3)
    torch.manual_seed(7)
    noise = torch.empty_like(logits).exponential_(1)
    rows = torch.full((16,), temperature)
    floor = torch.full((16,), 1 - top_p) if top_p < 1 else None
    tokens, logp = sample_tokens(logits, rows, floor, noise)
    assert torch.equal(tokens, expected)
    assert torch.equal(torch.rand(3), after)  # the stream moved as far
    want = torch.log_softmax(logits / temperature, -1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logp, want)
    greedy, glogp = sample_tokens(logits, torch.zeros(16), None, None)
    assert torch.equal(greedy, logits.argmax(-1))
    torch.testing.assert_close(glogp, torch.log_softmax(logits, -1).max(-1).values)


def _prompts(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


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
        first = engine.generate_ids(_prompts(tok, texts), sampling)
        # a second turn: the first row's prompt, its answer and more text, as environments do
        turn = [_prompts(tok, texts)[0] + first.token_ids[0] + _prompts(tok, [" and 3+4="])[0]]
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
    prompts = dict(zip("abc", _prompts(tok, texts), strict=True))
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
    prompt = _prompts(tok, ["3*4="])[0]
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


def test_the_generation_config_suppressed_tokens_and_what_falls_back(tiny_dir):
    """suppress_tokens are never sampled, as generate never samples them (equal tokens and
    log-probs); a generation config that changes logits otherwise keeps HF generate."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir).eval()
    model.generation_config.suppress_tokens = [tok.eos_token_id]
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=16)
    out = {}
    for loop in ("generate", "keel"):
        engine = HFRolloutEngine(model, tok, return_logprobs=True, decode_loop=loop)
        assert engine.lean == (loop == "keel")
        torch.manual_seed(1)
        out[loop] = engine.generate_ids(_prompts(tok, TEXTS), sampling)
    assert out["keel"].token_ids == out["generate"].token_ids
    assert all(len(t) == 16 for t in out["keel"].token_ids)  # EOS never sampled
    torch.testing.assert_close(torch.tensor(out["keel"].logprobs),
                               torch.tensor(out["generate"].logprobs))  # fmt: skip
    model.generation_config.repetition_penalty = 1.1
    assert not HFRolloutEngine(model, tok).lean
    with pytest.raises(ValueError, match="repetition_penalty"):
        HFDecoder(model, [tok.eos_token_id], tok.pad_token_id)
    model.generation_config.repetition_penalty = None
    model.generation_config.suppress_tokens = None


def test_the_eager_attention_kernel_decodes_as_generate(tiny_dir):
    """With attn_implementation eager the decode step's mask is additive: generate's tokens."""
    tok = load_tokenizer(tiny_dir)
    model = load_causal_lm(tiny_dir, attn_implementation="eager").eval()
    sampling = SamplingParams(n=2, temperature=0.8, max_new_tokens=12)
    out = {}
    for loop in ("generate", "keel", "static"):
        engine = HFRolloutEngine(model, tok, return_logprobs=True, decode_loop=loop)
        torch.manual_seed(4)
        out[loop] = engine.generate_ids(_prompts(tok, TEXTS), sampling)
    for loop in ("keel", "static"):
        assert out[loop].token_ids == out["generate"].token_ids
        for x, y in zip(out[loop].logprobs, out["generate"].logprobs, strict=True):
            torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-5, rtol=1e-5)


def _teacher_forced(model, prompt, response, temperature):
    """[R] log-probs of `response` after `prompt` under `model` (one forward, no cache), and
    [R] the token each position's logits rank first."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0], logits.argmax(-1)


def test_a_weight_swap_at_step_k_continues_the_rows_under_the_new_weights(eager_eos):
    """The step hook loads version B before the step that samples token K (an interruptible
    rollout's push): every token before K has A's log-prob and every later one B's, as a
    forward of the whole sequence under each gives them (the cache is computed again under B,
    not kept from A); greedy, each token is its version's argmax; rows that ended before K
    are A's alone; each token records its version. Keel's loop and the static one, greedy and
    sampled."""
    for loop in ("keel", "static"):
        for temperature in (0.0, 0.9):
            _check_swap(eager_eos, loop, temperature)


def _check_swap(eager_eos, loop, temperature):
    model, tok = eager_eos
    a = copy.deepcopy(model)
    b = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(0.3 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    engine = HFRolloutEngine(
        copy.deepcopy(model), tok, return_logprobs=True, decode_loop=loop, share_prefill=True
    )
    k, held = 5, [0]
    calls = []

    def hook(step):
        calls.append(step)
        if step == k:
            engine.update_weights(b.state_dict(), 1)
            held[0] = 1
        return held[0]

    engine.step_hook = hook
    sampling = SamplingParams(n=2, temperature=temperature, max_new_tokens=12)
    prompts = _prompts(tok, TEXTS)
    torch.manual_seed(5)
    out = engine.generate_ids(prompts, sampling)
    assert calls[:2] == [0, 1] and k in calls
    assert out.versions is not None and out.logprobs is not None
    lengths = [len(t) for t in out.token_ids]
    assert min(lengths) < k < max(lengths)  # rows ending before the swap and after it
    moved = 0.0
    for i, (ids, logps, versions) in enumerate(
        zip(out.token_ids, out.logprobs, out.versions, strict=True)
    ):
        prompt = prompts[i // 2]
        assert versions == [0 if t < k else 1 for t in range(len(ids))]
        under_a, top_a = _teacher_forced(a, prompt, ids, temperature)
        under_b, top_b = _teacher_forced(b, prompt, ids, temperature)
        want = torch.where(torch.tensor(versions) == 0, under_a, under_b)
        torch.testing.assert_close(torch.tensor(logps), want, atol=2e-5, rtol=1e-5)
        if temperature == 0:
            assert ids == torch.where(torch.tensor(versions) == 0, top_a, top_b).tolist()
        if len(ids) > k:
            moved = max(moved, float((under_a[k:] - under_b[k:]).abs().max()))
    assert moved > 1e-2  # B's log-probs are not A's: the check above can fail
