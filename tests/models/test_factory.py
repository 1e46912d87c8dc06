"""Tests for the tiny model factory: determinism, config, atomic saving, HF round trip, generate."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from keel.models import (
    TinyModelSpec,
    build_char_tokenizer,
    build_tiny_model,
    count_parameters,
    create_tiny_model,
)

SMALL = TinyModelSpec(
    hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64
)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_same_seed_identical_different_seed_differs(tok):
    a = build_tiny_model(tok, SMALL)
    b = build_tiny_model(tok, SMALL)
    c = build_tiny_model(tok, TinyModelSpec(**{**SMALL.__dict__, "seed": 1}))
    assert _same_weights(a, b)
    assert not _same_weights(a, c)
    emb_a = a.get_input_embeddings().weight
    assert not torch.equal(emb_a, c.get_input_embeddings().weight)
    assert emb_a.std() > 0


def test_global_rng_untouched(tok):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tok, SMALL)
    assert torch.equal(torch.rand(3), expected)


def test_config_matches_tokenizer_and_spec(tok):
    model = build_tiny_model(tok)
    cfg = model.config
    spec = TinyModelSpec()
    assert cfg.vocab_size == len(tok)
    assert model.get_input_embeddings().weight.shape == (len(tok), spec.hidden_size)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 4)
    assert (cfg.intermediate_size, cfg.max_position_embeddings) == (256, 256)
    assert (cfg.pad_token_id, cfg.eos_token_id, cfg.bos_token_id) == (0, 1, 1)
    gen = model.generation_config
    assert (gen.pad_token_id, gen.eos_token_id, gen.bos_token_id) == (0, 1, 1)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert model.lm_head.weight is model.get_input_embeddings().weight
    untied = build_tiny_model(tok, TinyModelSpec(tie_word_embeddings=False))
    assert untied.lm_head.weight is not untied.get_input_embeddings().weight
    assert count_parameters(untied) == count_parameters(model) + len(tok) * spec.hidden_size


def test_count_parameters(tok):
    model = build_tiny_model(tok, SMALL)
    h, v, i = 32, len(tok), 64
    per_layer = 4 * h * h + 3 * h * i + 2 * h  # attention, MLP, two RMSNorms
    assert count_parameters(model) == v * h + per_layer + h  # tied embedding + final norm


def test_create_tiny_model_loads_with_plain_hf(tiny_dir, tok):
    names = set(os.listdir(tiny_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert [p.name for p in tiny_dir.parent.iterdir()] == [tiny_dir.name]  # no staging left
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True)
    loaded_tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    fresh = build_tiny_model(tok).eval()
    assert _same_weights(model, fresh)
    ids = torch.tensor([loaded_tok("37+45=")["input_ids"]])
    assert ids.tolist() == [tok("37+45=")["input_ids"]]
    # The same weights bit for bit, but the loaded ones are views into the file's mapping (16,
    # not 64 bytes aligned here) and MKL may round differently by alignment (a misaligned
    # 2-row input moved a 64x64 product by 2-4 ulp here): equal up to rounding, not bitwise.
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, fresh(ids).logits, rtol=1e-5, atol=1e-6)
    assert model.dtype == torch.float32
    assert model.generation_config.eos_token_id == 1


def test_create_refuses_existing_folder(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="m"):
        create_tiny_model(target, SMALL)
    assert os.listdir(target) == ["keep.txt"]
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_create_crash_leaves_nothing(tmp_path, monkeypatch):
    def boom(self, *args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(type(build_char_tokenizer()), "save_pretrained", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        create_tiny_model(tmp_path / "m", SMALL)
    assert os.listdir(tmp_path) == []


def test_create_into_empty_folder(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    assert create_tiny_model(target, SMALL) == target
    assert (target / "config.json").is_file()


class _ForceEos(LogitsProcessor):
    """Row 0 must say <eos> at its second generated token; the other rows are left alone."""

    def __init__(self, prompt_len: int, eos_id: int):
        self.prompt_len, self.eos_id = prompt_len, eos_id

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.prompt_len + 1:
            scores[0] = float("-inf")
            scores[0, self.eos_id] = 0.0
        return scores


def test_generate_stops_at_eos(tok):
    model = build_tiny_model(tok, SMALL).eval()
    enc = tok(["12+3=", "45+6="], return_tensors="pt")
    prompt_len = enc["input_ids"].shape[1]
    out = model.generate(**enc, max_new_tokens=6, do_sample=False)
    assert out.shape[0] == 2 and prompt_len < out.shape[1] <= prompt_len + 6
    assert torch.equal(out[:, :prompt_len], enc["input_ids"])

    # With row 1 also forced to stop there, generation ends early instead of running to 6 tokens.
    class _ForceAll(_ForceEos):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] == self.prompt_len + 1:
                scores[:] = float("-inf")
                scores[:, self.eos_id] = 0.0
            return scores

    forced = LogitsProcessorList([_ForceAll(prompt_len, tok.eos_token_id)])
    out = model.generate(**enc, max_new_tokens=6, do_sample=False, logits_processor=forced)
    assert out.shape[1] == prompt_len + 2
    assert out[:, -1].tolist() == [tok.eos_token_id] * 2

    # Only row 0 forced: it ends with <eos> then pad while row 1 keeps going.
    one = LogitsProcessorList([_ForceEos(prompt_len, tok.eos_token_id)])
    out = model.generate(**enc, max_new_tokens=6, do_sample=False, logits_processor=one)
    assert out[0, prompt_len + 1].item() == tok.eos_token_id
    assert out[0, prompt_len + 2 :].tolist() == [tok.pad_token_id] * (out.shape[1] - prompt_len - 2)
