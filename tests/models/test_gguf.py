"""GGUF files as models (keel.models.gguf) on a tiny Llama written here as a GGUF file (float32
tensors, a byte-level BPE tokenizer, ChatML): `keel convert` writes an HF folder that
transformers loads with the original model's logits and the file's own ids, the resolver
converts a file once into the Keel cache, and bad input is a clear error. The real model
(SmolLM2's Q4_1 file) is tests/realmodel's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from keel.cli.main import main
from keel.models import load_tokenizer, resolve_model
from keel.models.gguf import GGUFError, file_sha256, gguf_cache_folder, read_gguf_facts

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HEADS, KV_HEADS, HIDDEN, LAYERS = 4, 2, 64, 2


def byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character table: the 256 characters a byte-level BPE spells bytes with."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def permute(w: torch.Tensor, heads: int) -> np.ndarray:
    """llama.cpp's order of a q/k projection's rows (GGUF stores them so; transformers undoes it
    when it reads the file)."""
    out = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
    return out.reshape(w.shape).numpy()


def write_tiny_gguf(path: Path) -> LlamaForCausalLM:
    """A seeded tiny Llama written as a GGUF file at `path` (bos 1, eos = pad 2, unk 0); the
    model it holds."""
    from gguf import GGUFWriter, TokenType

    tokens = [*SPECIALS, *byte_alphabet(), "hi", "hihi"]
    config = LlamaConfig(
        vocab_size=len(tokens), hidden_size=HIDDEN, intermediate_size=128,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(128)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    types = [TokenType.CONTROL] * len(SPECIALS) + [TokenType.NORMAL] * (len(tokens) - 3)
    writer.add_token_types(types)
    writer.add_token_merges(["h i", "hi hi"])  # (one merge alone reads back as a string)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }  # fmt: skip
    state = {k: v.detach().float() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    writer.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    for i in range(LAYERS):
        for hf, gg in names.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            if gg == "attn_q":
                array = permute(w, HEADS)
            elif gg == "attn_k":
                array = permute(w, KV_HEADS)
            else:
                array = w.numpy()
            writer.add_tensor(f"blk.{i}.{gg}.weight", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, LlamaForCausalLM]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_gguf(path)


def test_read_gguf_facts(tiny_gguf):
    facts = read_gguf_facts(tiny_gguf[0])
    assert facts.architecture == "llama" and facts.context_length == 256
    assert (facts.bos_id, facts.eos_id, facts.pad_id, facts.unk_id) == (1, 2, 2, 0)
    assert facts.token(2) == "<|im_end|>" and facts.add_bos is False
    assert facts.chat_template == CHATML and facts.vocab_size == 3 + 256 + 2


def test_keel_convert_writes_a_folder_transformers_loads_with_the_files_ids(
    tiny_gguf, tmp_path, capsys
):
    path, original = tiny_gguf
    out = tmp_path / "hf"
    assert main(["convert", str(path), str(out)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "eos '<|im_end|>' (id 2)" in printed and "warning" not in printed
    model = AutoModelForCausalLM.from_pretrained(out)  # a plain folder: no gguf, no keel
    ids = torch.tensor([[1, 30, 60, 90, 2, 259, 7]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, atol=1e-5, rtol=1e-5)
    tok = load_tokenizer(out)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (1, 2, 2, 0)
    assert tok.chat_template == CHATML and tok.model_max_length == 256
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["bos_token_id"]) == (2, 1)
    assert model.config.eos_token_id == 2 and "quantization_config" not in model.config.to_dict()
    # an existing folder is never overwritten
    assert main(["convert", str(path), str(out)]) == 2
    assert "refusing to write into" in capsys.readouterr().err


def test_the_resolver_converts_a_gguf_file_once_into_the_keel_cache(tiny_gguf, tmp_path):
    path = tiny_gguf[0]
    source = resolve_model(path)
    assert source.folder == gguf_cache_folder(file_sha256(path)) and source.gguf == path
    assert source.facts is not None and source.facts.eos_id == 2
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(path.read_bytes())
    assert resolve_model(copy).folder == source.folder  # by content: no second conversion


def test_bad_gguf_input_is_a_clear_error(tmp_path, capsys):
    fake = tmp_path / "model.gguf"
    fake.write_text("not a gguf file")
    with pytest.raises(GGUFError, match="is not a GGUF file"):
        resolve_model(fake)
    with pytest.raises(GGUFError, match="GGUF file not found"):
        resolve_model(tmp_path / "missing.gguf")
    assert main(["convert", str(fake), str(tmp_path / "out")]) == 2
    assert "is not a GGUF file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
