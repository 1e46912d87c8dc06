"""The decode step at fixed shapes (`keel.rollout.decode.graphs`): padded buckets on a static
cache give the dynamic loop's tokens, a cache outgrown mid-generation moves to a larger
bucket, and an engine keeps a bounded set of steps. (On CUDA each step is a CUDA graph:
bench/gpu_step.py --decode keel-static and tests/gpu measure and check it there.)"""

import pytest
import torch

from keel.models import load_causal_lm, load_tokenizer
from keel.rollout import HFRolloutEngine, SamplingParams
from keel.rollout.decode import HFDecoder, RolloutDecoder
from keel.rollout.decode.graphs import MIN_COLUMNS, StaticSteps, bucket
from keel.rollout.protocol import RowRequest


def test_buckets_are_powers_of_two_at_or_above():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 127, 128, 129)] == [1, 2, 4, 4, 8, 128, 128, 256]
    assert bucket(3, MIN_COLUMNS) == 64 and bucket(65, MIN_COLUMNS) == 128


def test_a_generation_that_outgrows_its_bucket_moves_on_with_the_same_tokens(tiny_dir, monkeypatch):
    """With 4 new positions reserved per rebuild, 150 tokens outgrow the 64-column bucket twice:
    each time the rows move to a larger one, and the tokens and log-probs stay the dynamic
    loop's; the pool holds the buckets it made."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir).eval()
    model.generation_config.suppress_tokens = [tok.eos_token_id]  # every row runs to the end
    for module in ("decoder", "rollout_loop"):
        monkeypatch.setattr(f"keel.rollout.decode.{module}.RESERVED_NEW_TOKENS", 4)
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("1+1=", "9*9=", "77")]
    sampling = SamplingParams(temperature=0.9, max_new_tokens=150)
    got = {}
    for static in (None, StaticSteps()):
        decoder = RolloutDecoder(model, [tok.eos_token_id], tok.pad_token_id, static=static)
        torch.manual_seed(5)
        got[static is None] = decoder.decode(
            [RowRequest(i, p, sampling) for i, p in enumerate(prompts)]
        )[:2]
        if static is not None:
            assert {c for _, c in static.steps} == {64, 128, 256}  # outgrown twice
            assert all(r == 4 for r, _ in static.steps)  # 3 rows in a bucket of 4
    (dyn_tokens, dyn_logps), (tokens, logps) = got[True], got[False]
    assert all(len(t) == 150 for t in tokens) and tokens == dyn_tokens
    torch.testing.assert_close(torch.tensor(logps), torch.tensor(dyn_logps), atol=1e-5, rtol=1e-5)
    model.generation_config.suppress_tokens = None


def test_the_pool_keeps_the_latest_steps_and_rows_leaving_shrink_the_bucket(tiny_dir):
    """Rows leaving a running batch move it to a smaller row bucket at the rebuild; the pool
    drops its least recently used steps past its limit; the static step refuses FSDP2."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir).eval()
    pool = StaticSteps(limit=2)
    decoder = HFDecoder(model, [tok.eos_token_id], tok.pad_token_id, static=pool)
    sampling = SamplingParams(temperature=0.8, max_new_tokens=40)
    prompt = tok("3*4=", add_special_tokens=False)["input_ids"]
    decoder.join([RowRequest(i, prompt, sampling) for i in range(8)])
    decoder.step()
    assert decoder.running is not None and decoder.running.rows == 8
    decoder.leave(range(5))
    decoder.step()
    assert decoder.running.rows == 4 and len(decoder.rows) == 3
    decoder.leave(range(5, 7))
    decoder.step()
    assert decoder.running.rows == 1
    assert [r for r, _ in pool.steps] == [4, 1]  # the 8-row step was dropped
    engine = HFRolloutEngine(model, tok, decode_loop="static", synced=True)
    assert engine.lean and engine._steps is None  # FSDP2 keeps the dynamic loop
    with pytest.raises(ValueError, match="FSDP2"):
        HFDecoder(model, [tok.eos_token_id], tok.pad_token_id, synced=True, static=pool)


def test_two_decoders_on_one_pool_never_share_a_steps_cache(tiny_dir):
    """Two decoders of one engine stepping in turn at the same bucket: each gets its own step
    (its cache holds its rows), and each decodes what it decodes alone; a released step is
    the pool's again."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir).eval()
    engine = HFRolloutEngine(model, tok, decode_loop="static")
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    texts = {"a": ["1+1=", "2+2="], "b": ["a longer prompt=", "9*9="]}
    decoders = {k: engine.decoder() for k in texts}
    alone = {k: HFRolloutEngine(model, tok).decoder() for k in texts}
    got: dict[str, list] = {k: [] for k in texts}
    want: dict[str, list] = {k: [] for k in texts}
    for k, ts in texts.items():
        rows = [RowRequest(i, tok(t, add_special_tokens=False)["input_ids"], greedy)
                for i, t in enumerate(ts)]  # fmt: skip
        decoders[k].join(rows)
        alone[k].join(rows)
    while any(d.live for d in decoders.values()):
        for k in texts:
            got[k].extend((t.key, t.token) for t in decoders[k].step())
            want[k].extend((t.key, t.token) for t in alone[k].step())
        a, b = decoders["a"].running, decoders["b"].running
        if a is not None and b is not None:
            assert a is not b and a.cache is not b.cache
    assert got == want and all(got.values())
    assert all(s.owner is None for s in engine._steps.steps.values())


def test_the_static_step_under_bfloat16_autocast_decodes_as_the_dynamic_loop(tiny_dir):
    """A colocated actor in mixed precision: the bucket's keys (float32 after the rotary
    embedding) and values (bfloat16) keep their own dtypes; greedy tokens equal the dynamic
    loop's under the same autocast."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir).eval()
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in ("1+1=", "12+34=", "7")]
    greedy = SamplingParams(n=2, temperature=0, max_new_tokens=24)
    out = {}
    for loop in ("keel", "static"):
        engine = HFRolloutEngine(model, tok, decode_loop=loop, dtype=torch.bfloat16)
        out[loop] = engine.generate_ids(prompts, greedy).token_ids
    assert out["static"] == out["keel"]
    (step,) = engine._steps.steps.values()
    assert step.cache is not None
    layer = step.cache.layers[0]
    assert (layer.keys.dtype, layer.values.dtype) == (torch.float32, torch.bfloat16)
