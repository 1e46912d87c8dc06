"""The HF rollout engine: masks, EOS handling, groups, and log-probs that match the trainer."""

import pytest
import torch

from keel.data import Example
from keel.models import (
    TinyModelSpec,
    build_char_tokenizer,
    build_tiny_model,
    load_causal_lm,
    load_tokenizer,
)
from keel.rollout import HFRolloutEngine, SamplingParams
from keel.workers import ActorWorker

BIGRAMS = {"=": "7", "7": "#", "+": "8", "8": "<eos>", "-": "9", "9": "9"}


def bigram_model(bigrams: dict[str, str]):
    """(model, tokenizer): a tiny model that greedily follows `bigrams` (next token of each
    token): attention and MLP outputs are zero, so the last hidden state is the (one-hot)
    embedding of the current token and the untied lm_head is the bigram table. Deterministic
    on any machine, unlike a model trained for the test."""
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, TinyModelSpec(hidden_size=128, tie_word_embeddings=False))
    ids = {c: tok.convert_tokens_to_ids(c) for c in {*bigrams, *bigrams.values()}}
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(len(tok), 128))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for cur, nxt in bigrams.items():
            model.lm_head.weight[ids[nxt], ids[cur]] = 1.0
    return model.eval(), tok


@pytest.fixture(scope="module")
def eos_model():
    """Prompts ending in '=' → '7' EOS; prompts ending in '-' → a run of 9s past any limit."""
    return bigram_model({"=": "7", "7": "<eos>", "-": "9", "9": "9"})


def test_generation_stops_at_eos_and_mask_includes_it(eos_model):
    model, tok = eos_model
    engine = HFRolloutEngine(model, tok)
    examples = [Example(prompt="b3="), Example(prompt="a3-")]
    batch = engine.generate(examples, SamplingParams(n=1, temperature=0, max_new_tokens=6))
    r = batch.response_length
    response = batch.input_ids[:, -r:]
    # Row 0 said "7" then EOS: mask covers both, padding after it is excluded.
    assert response[0, :2].tolist() == [tok.convert_tokens_to_ids("7"), tok.eos_token_id]
    assert batch.response_mask[0].tolist() == [1.0, 1.0] + [0.0] * (r - 2)
    assert (response[0, 2:] == tok.pad_token_id).all()
    assert batch.attention_mask[0, -r:].tolist() == batch.response_mask[0].long().tolist()
    # Row 1 never emitted EOS: all max_new_tokens are valid, nothing more was generated.
    assert r == 6
    assert batch.response_mask[1].sum() == 6
    assert batch.responses == ["7", "999999"]


@pytest.fixture(scope="module")
def two_eos_dir(tmp_path_factory):
    """A saved bigram model (BIGRAMS) whose generation config stops on [<eos>, '#']."""
    model, tok = bigram_model(BIGRAMS)
    model.generation_config.eos_token_id = [tok.eos_token_id, tok.convert_tokens_to_ids("#")]
    path = tmp_path_factory.mktemp("two-eos") / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_generation_stops_at_any_eos_id_of_the_generation_config(two_eos_dir):
    tok, model = load_tokenizer(two_eos_dir), load_causal_lm(two_eos_dir)
    hash_id = tok.convert_tokens_to_ids("#")
    assert list(model.generation_config.eos_token_id) == [tok.eos_token_id, hash_id]
    engine = HFRolloutEngine(model, tok)
    examples = [Example(prompt="b3="), Example(prompt="b3+"), Example(prompt="b3-")]
    batch = engine.generate(examples, SamplingParams(n=1, temperature=0, max_new_tokens=4))
    response = batch.input_ids[:, -batch.response_length :]
    seven, eight = tok.convert_tokens_to_ids("7"), tok.convert_tokens_to_ids("8")
    # Row 0 ends on the generation config's '#', row 1 on the tokenizer's EOS: each stops there,
    # the mask includes the EOS, padding follows. Row 2 never ends: all 4 tokens are valid.
    assert response[0].tolist() == [seven, hash_id, tok.pad_token_id, tok.pad_token_id]
    assert response[1].tolist() == [eight, tok.eos_token_id, tok.pad_token_id, tok.pad_token_id]
    assert batch.response_mask.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch.attention_mask[:, -4:].tolist() == batch.response_mask.long().tolist()
    assert batch.responses == ["7", "8", "9999"]  # the closing EOS is no part of the text
    assert batch.meta["eos_token_ids"] == [tok.eos_token_id, hash_id]


def test_the_tokenizer_eos_alone_is_the_one_eos_id(eos_model):
    model, tok = eos_model
    engine = HFRolloutEngine(model, tok)
    batch = engine.generate([Example(prompt="b1=")], SamplingParams(temperature=0))
    assert batch.meta["eos_token_ids"] == [tok.eos_token_id]


def test_prompts_are_left_padded(eos_model):
    model, tok = eos_model
    engine = HFRolloutEngine(model, tok)
    batch = engine.generate(
        [Example(prompt="b1="), Example(prompt="b12345=")],
        SamplingParams(n=1, temperature=0, max_new_tokens=3),
    )
    p = batch.prompt_length
    assert p == len("b12345=")
    assert batch.attention_mask[0, :p].tolist() == [0] * 4 + [1] * 3
    assert tok.decode(batch.input_ids[0, 4:p]) == "b1="


def test_n_samples_per_prompt_share_a_group(eos_model):
    model, tok = eos_model
    engine = HFRolloutEngine(model, tok)
    batch = engine.generate(
        [Example(prompt="b1=", answer="7"), Example(prompt="a2=", answer="x")],
        SamplingParams(n=3, temperature=1.0, max_new_tokens=4),
        group_offset=10,
    )
    assert batch.group_ids.tolist() == [10, 10, 10, 11, 11, 11]
    assert batch.answers == ["7"] * 3 + ["x"] * 3
    assert batch.prompts == ["b1="] * 3 + ["a2="] * 3


def test_rollout_logprobs_match_the_trainers_forward(tiny_dir):
    """Left padding, position ids and temperature agree between generate and the trainer."""
    torch.manual_seed(1)
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    engine = HFRolloutEngine(model, tok, return_logprobs=True, batch_size=2)
    examples = [Example(prompt=p) for p in ("1+1=", "12+34=", "7=", "99+99=")]
    batch = engine.generate(examples, SamplingParams(n=2, temperature=0.7, max_new_tokens=5))
    actor = ActorWorker(model, tok, None, temperature=0.7, mini_batch_size=8, micro_batch_size=3)
    recomputed = actor.compute_logprobs(batch).old_logprobs
    m = batch.response_mask.bool()
    assert m.any()
    torch.testing.assert_close(recomputed[m], batch.rollout_logprobs[m], atol=1e-4, rtol=1e-4)


def test_rollout_logprobs_under_top_p_are_the_full_distributions(tiny_dir):
    """The per-step recorder sees the raw logits (before transformers' temperature and top-p
    warpers), so under top_p < 1 the log-probs are still those the trainer recomputes."""
    torch.manual_seed(2)
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    engine = HFRolloutEngine(model, tok, return_logprobs=True)
    examples = [Example(prompt=p) for p in ("1+1=", "12+34=")]
    sampling = SamplingParams(n=3, temperature=0.9, top_p=0.7, max_new_tokens=6)
    batch = engine.generate(examples, sampling)
    actor = ActorWorker(model, tok, None, temperature=0.9, mini_batch_size=6, micro_batch_size=6)
    recomputed = actor.compute_logprobs(batch).old_logprobs
    m = batch.response_mask.bool()
    torch.testing.assert_close(recomputed[m], batch.rollout_logprobs[m], atol=1e-4, rtol=1e-4)


def test_a_static_kv_cache_decodes_the_same_tokens(tiny_dir):
    """rollout.static_cache (a preallocated cache; compiled on CUDA) changes speed, not tokens."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    greedy = SamplingParams(n=1, temperature=0, max_new_tokens=6)
    engines = [HFRolloutEngine(model, tok, static_cache=static) for static in (False, True)]
    # the second call is shorter: the static cache keeps the first call's length
    for prompts in (("1+1=", "12+34=", "7="), ("3=", "5=")):
        examples = [Example(prompt=p) for p in prompts]
        batches = [engine.generate(examples, greedy) for engine in engines]
        assert torch.equal(batches[0].input_ids, batches[1].input_ids)
        assert batches[0].responses == batches[1].responses
    assert engines[1].static_length == len("12+34=") + 6


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_shared_prefill_samples_the_same_tokens_and_log_probs(tiny_dir, temperature, static):
    """rollout.share_prompt_prefill: one prefill per distinct prompt, its cache repeated for
    the n rows; the same seed gives the same responses and rollout log-probs as a plain
    generate, prompts of different lengths (left padding) included, with the reserved and with
    the static KV cache."""
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    examples = [Example(prompt=p) for p in ("1+1=", "12+34=", "7=", "99+99=")]
    sampling = SamplingParams(n=3, temperature=temperature, max_new_tokens=6)
    batches = []
    for share in (False, True):
        torch.manual_seed(3)
        engine = HFRolloutEngine(
            model, tok, return_logprobs=True, share_prefill=share, static_cache=static and share
        )
        batches.append(engine.generate(examples, sampling))
    plain, shared = batches
    assert torch.equal(plain.input_ids, shared.input_ids)
    assert plain.responses == shared.responses
    m = plain.response_mask.bool()
    torch.testing.assert_close(plain.rollout_logprobs[m], shared.rollout_logprobs[m])


@pytest.mark.parametrize("static", [False, True])
def test_the_shared_prefill_runs_each_distinct_prompt_once(tiny_dir, static):
    tok, model = load_tokenizer(tiny_dir), load_causal_lm(tiny_dir)
    shapes = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    engine = HFRolloutEngine(model, tok, share_prefill=True, static_cache=static)
    engine.generate([Example(prompt="1+1="), Example(prompt="12+34=")], SamplingParams(n=4))
    hook.remove()
    assert shapes[0] == (2, 5)  # the prefill: 2 prompts, all but their last token (6 − 1)
    assert shapes[1] == (8, 1)  # generate: 8 rows, only the last prompt token left to run


@pytest.mark.parametrize("stop_on_turn_end", [True, False])
def test_an_engine_asked_to_stops_on_the_chat_templates_turn_end(stop_on_turn_end):
    """stop_on_turn_end (keel serve's engine: chat requests arrive as messages, so `chat` is
    off): a response ends at the template's turn end (ChatML's <|im_end|>, not the tokenizer's
    </s>) though the model's generation config does not list it. The model here always
    predicts <|im_end|> (its head is a bias on that token)."""
    from keel.models.factory import TinyModelSpec, build_tiny_model
    from tests.data.test_encoding import CHATML_WITH_TOOLS, bpe_tokenizer

    tok = bpe_tokenizer(add_bos=False, template=CHATML_WITH_TOOLS)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    model = build_tiny_model(tok, TinyModelSpec(hidden_size=32, intermediate_size=64))
    head = torch.nn.Linear(32, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[im_end] = 10.0
    model.lm_head = head
    engine = HFRolloutEngine(model, tok, stop_on_turn_end=stop_on_turn_end)
    assert (im_end in engine.eos_ids) == stop_on_turn_end
    batch = engine.generate([Example("hi")], SamplingParams(temperature=0.0, max_new_tokens=4))
    length = int(batch.response_mask.sum().item())
    assert (length, batch.finish_reasons) == (
        (1, ["stop"]) if stop_on_turn_end else (4, ["length"])
    )
