"""The reserved KV cache: the dynamic cache's keys, values and tokens, without a copy per step."""

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from keel.data import Example
from keel.models import load_causal_lm, load_tokenizer
from keel.rollout import HFRolloutEngine, SamplingParams
from keel.rollout.decode.kvcache import ReservedLayer, reserved_cache


def _same(reserved: ReservedLayer, dynamic: DynamicLayer) -> None:
    assert reserved.get_seq_length() == dynamic.get_seq_length()
    assert torch.equal(reserved.keys, dynamic.keys)
    assert torch.equal(reserved.values, dynamic.values)


def test_a_reserved_layer_holds_what_a_dynamic_layer_holds():
    """Updates, a batch repeat (the shared prefill), a batch select, a crop, and growth past
    the reserved room: at every point the same keys and values as transformers' layer."""
    torch.manual_seed(0)
    reserved, dynamic = ReservedLayer(capacity=6), DynamicLayer()

    def update(rows: int, length: int) -> None:
        k, v = torch.randn(rows, 2, length, 4), torch.randn(rows, 2, length, 3)
        got, want = reserved.update(k, v), dynamic.update(k, v)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        _same(reserved, dynamic)

    update(2, 3)  # a prefill
    buffer = reserved.buffers[0]
    update(2, 1)
    assert reserved.buffers[0] is buffer  # written in place: no copy of the cache
    for layer in (reserved, dynamic):
        layer.batch_repeat_interleave(3)
    _same(reserved, dynamic)
    buffer = reserved.buffers[0]
    assert buffer.shape[:3] == (6, 2, 6)  # repeated straight into a reserved buffer
    update(6, 1)
    update(6, 1)
    assert reserved.buffers[0] is buffer
    for layer in (reserved, dynamic):
        layer.batch_select_indices(torch.tensor([5, 0, 2]))
    update(3, 1)
    for layer in (reserved, dynamic):
        layer.crop(-2)
    update(3, 2)  # over the cropped positions
    update(3, 4)  # past the buffer's 7 positions: grows to twice that
    assert reserved.get_seq_length() == 11
    assert reserved.buffers[0].shape[-2] == 14


@pytest.mark.parametrize("decode_loop", ["generate", "keel"])
@pytest.mark.parametrize("share_prefill", [False, True])
def test_generation_with_the_reserved_cache_equals_a_plain_generate(
    tiny_dir, share_prefill, decode_loop
):
    """The engine (reserved cache under HF generate, or Keel's decode loop; with and without
    the shared prefill) samples the tokens and log-probs of `model.generate` on transformers'
    default cache, left padding included; the reserved cache never outgrows its room."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir).eval()
    prompts = ["1+1=", "12+34=", "7="]
    sampling = SamplingParams(n=2, temperature=0.9, max_new_tokens=7)
    engine = HFRolloutEngine(
        model, tok, return_logprobs=True, share_prefill=share_prefill, decode_loop=decode_loop
    )
    caches = []
    original = model.generate

    def generate(*args, **kwargs):
        caches.append(kwargs["past_key_values"])
        return original(*args, **kwargs)

    model.generate = generate
    torch.manual_seed(5)
    batch = engine.generate([Example(prompt=p) for p in prompts], sampling)
    del model.generate

    rows = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts for _ in range(2)]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[engine.pad_id] * (width - len(r)) + r for r in rows])
    lengths = torch.tensor([len(r) for r in rows])
    attention = (torch.arange(width) >= width - lengths[:, None]).long()
    torch.manual_seed(5)
    with torch.no_grad():
        out = original(
            input_ids=ids,
            attention_mask=attention,
            do_sample=True,
            temperature=0.9,
            top_p=1.0,
            top_k=0,
            max_new_tokens=7,
            eos_token_id=list(engine.eos_ids),
            pad_token_id=engine.pad_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
    plain = [tok.decode(r, skip_special_tokens=True) for r in out.sequences[:, width:]]
    assert batch.responses == plain
    chosen = out.sequences[:, width:]
    step_logps = [torch.log_softmax(scores.float(), -1) for scores in out.scores]
    logps = torch.stack([lp.gather(-1, chosen[:, [t]])[:, 0] for t, lp in enumerate(step_logps)], 1)
    m = batch.response_mask.bool()
    torch.testing.assert_close(batch.rollout_logprobs[m], logps[:, : m.shape[1]][m])
    if decode_loop == "keel":
        assert not caches  # Keel's loop: generate never ran
        return
    layers = caches[0].layers
    assert all(isinstance(layer, ReservedLayer) for layer in layers)
    assert all(layer.buffers[0].shape[-2] == width + 7 for layer in layers)  # never regrown
    assert all(layer.keys.data_ptr() == layer.buffers[0].data_ptr() for layer in layers)


def test_a_reserved_cache_keeps_other_layer_kinds(tiny_dir):
    model = load_causal_lm(tiny_dir)
    cache = reserved_cache(model.config, 16)
    assert len(cache.layers) == model.config.num_hidden_layers
    assert all(type(layer) is ReservedLayer and layer.capacity == 16 for layer in cache.layers)


def test_a_generation_longer_than_the_reserved_room_grows_and_samples_the_same(
    tiny_dir, monkeypatch
):
    """Past RESERVED_NEW_TOKENS new tokens the cache doubles: the same tokens and log-probs."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir).eval()
    examples = [Example(prompt=p) for p in ("1+1=", "12+34=")]
    sampling = SamplingParams(n=2, temperature=0.9, max_new_tokens=9)
    batches = []
    for reserved in (1024, 2):
        monkeypatch.setattr("keel.rollout.hf.RESERVED_NEW_TOKENS", reserved)
        monkeypatch.setattr("keel.rollout.decode.decoder.RESERVED_NEW_TOKENS", reserved)
        monkeypatch.setattr("keel.rollout.decode.rollout_loop.RESERVED_NEW_TOKENS", reserved)
        torch.manual_seed(2)
        engine = HFRolloutEngine(model, tok, return_logprobs=True, share_prefill=True)
        batches.append(engine.generate(examples, sampling))
    assert batches[0].responses == batches[1].responses
    m = batches[0].response_mask.bool()
    torch.testing.assert_close(batches[1].rollout_logprobs[m], batches[0].rollout_logprobs[m])
