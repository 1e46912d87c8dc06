"""LoRA adapters (keel.models.lora): what trains, the adapter-disabled base, the adapter's state,
and the merged plain folder."""

import json
import warnings

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from keel.models import ModelLoadError, load_causal_lm, load_tokenizer
from keel.models.lora import (
    adapted_module_names,
    adapter_config,
    adapter_disabled,
    adapter_state_dict,
    base_model_eval,
    is_lora,
    load_adapter_state_dict,
    merged_from_state,
    merged_state_dict,
    peft_saved_names,
    save_adapter,
    save_merged,
    wrap_lora,
)
from keel.models.tokenizer import build_char_tokenizer

IDS = torch.tensor([[5, 9, 14, 22, 7, 30, 41, 3], [12, 12, 8, 50, 61, 2, 19, 33]])
# Merged weights (W + s·B·A, rounded once) against the unmerged adapter (W·x + s·B·(A·x)): two
# computations, equal up to float32 rounding. Logits here are below 0.7 and were up to 5.8e-6
# apart (0.9e-6 to 5.8e-6 over ATEN_CPU_CAPABILITY default, avx2, avx512); a q_proj merged at
# half its scale moves them by 0.6. The adapter off (or a zero B, which adds exact zeros)
# against the base stays bitwise: peft's layer runs its base layer's forward on the same tensors.
MERGED = {"atol": 1e-4, "rtol": 1e-5}


def logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def trained(tiny_dir, **kwargs):
    """A LoRA model on the tiny model whose adapter is no longer zero (as after training)."""
    model = wrap_lora(load_causal_lm(tiny_dir), **{"r": 4, "alpha": 8.0, **kwargs}).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def test_only_the_adapter_trains_and_a_new_adapter_computes_the_base(tiny_dir):
    base = load_causal_lm(tiny_dir)
    model = wrap_lora(load_causal_lm(tiny_dir), r=4, alpha=8.0).eval()
    assert is_lora(model) and not is_lora(base)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert not any("lm_head" in n or "embed" in n for n in trainable)  # all-linear: no head
    assert torch.equal(logits(model), logits(base))  # B starts at zero


def test_target_modules_pick_the_adapted_layers_and_unknown_names_are_errors(tiny_dir):
    model = wrap_lora(load_causal_lm(tiny_dir), r=2, alpha=2.0, target_modules=["q_proj"])
    names = {n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert names and all(n.endswith("self_attn.q_proj") for n in names)
    with pytest.raises(ModelLoadError, match=r"models\.lora\.target_modules"):
        wrap_lora(load_causal_lm(tiny_dir), r=2, alpha=2.0, target_modules=["nonexistent"])
    with pytest.raises(ModelLoadError, match="tied to another weight"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft's own warning about adapting a tied layer
        wrap_lora(load_causal_lm(tiny_dir), r=2, alpha=2.0, target_modules=["embed_tokens"])


def test_the_adapter_disabled_is_the_base_model_bit_for_bit(tiny_dir):
    base, model = load_causal_lm(tiny_dir), trained(tiny_dir)
    on = logits(model)
    assert not torch.allclose(on, logits(base))
    with adapter_disabled(model):
        assert torch.equal(logits(model), logits(base))
    model.train()
    with base_model_eval(model):
        assert not model.training and torch.equal(logits(model), logits(base))
    assert model.training  # the trainer's mode comes back, and so does the adapter
    assert torch.equal(logits(model.eval()), on)


def test_the_merged_folder_loads_without_peft_and_computes_the_live_model(tiny_dir, tmp_path):
    model = trained(tiny_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    save_merged(model, load_tokenizer(tiny_dir), tmp_path / "out")
    for k, v in model.state_dict().items():  # merging never touches the live weights
        assert torch.equal(v, before[k]), k
    assert not (tmp_path / "out" / "adapter_config.json").exists()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(plain) is LlamaForCausalLM and not is_lora(plain)
    torch.testing.assert_close(logits(plain), logits(model), **MERGED)
    # the same tensors as a plain HF folder (the tied lm_head stored once)
    assert (
        load_file(tmp_path / "out/model.safetensors").keys()
        == load_file(tiny_dir / "model.safetensors").keys()
    )
    assert (tmp_path / "out" / "tokenizer.json").is_file()


def test_merged_weights_load_into_a_plain_copy_by_name(tiny_dir):
    model = trained(tiny_dir, target_modules=["q_proj", "down_proj"])
    plain = load_causal_lm(tiny_dir)
    state = merged_state_dict(model)
    assert state.keys() == plain.state_dict().keys()
    plain.load_state_dict(state)  # strict
    torch.testing.assert_close(logits(plain), logits(model), **MERGED)


def test_the_adapter_state_round_trips_exactly_and_names_must_match(tiny_dir):
    model = trained(tiny_dir)
    state = adapter_state_dict(model)
    assert state.keys() == {n for n, p in model.named_parameters() if p.requires_grad}
    fresh = wrap_lora(load_causal_lm(tiny_dir), r=4, alpha=8.0).eval()
    load_adapter_state_dict(fresh, state)
    assert torch.equal(logits(fresh), logits(model))
    other = wrap_lora(load_causal_lm(tiny_dir), r=4, alpha=8.0, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="adapter weights do not match"):
        load_adapter_state_dict(other, state)


def tiny_moe_dir(path):
    """A tiny random Qwen3-MoE folder (hidden 32, 2 layers, 4 experts, top-2) with the char
    tokenizer: fused experts hold 3-D parameters, not nn.Linear layers."""
    tokenizer = build_char_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_lora_on_fused_moe_experts_trains_and_merges_into_a_plain_model(tmp_path):
    folder = tiny_moe_dir(tmp_path / "moe")
    model = wrap_lora(load_causal_lm(folder), r=2, alpha=4.0)  # all-linear
    adapted = {n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert any(n.endswith("mlp.experts") for n in adapted)  # the fused experts are adapted
    assert any(n.endswith("self_attn.q_proj") for n in adapted)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    model.train()
    model(input_ids=IDS, labels=IDS).loss.backward()
    optimizer.step()
    model.eval()
    experts_b = [p for n, p in model.named_parameters() if "experts" in n and "lora_B" in n]
    assert experts_b and all(p.abs().max() > 0 for p in experts_b)  # B ≠ 0 after one step
    live = logits(model)
    with adapter_disabled(model):
        assert not torch.allclose(live, logits(model), **MERGED)  # the adapter matters
    plain = Qwen3MoeForCausalLM.from_pretrained(folder).eval()
    state = merged_state_dict(model)
    assert state.keys() == plain.state_dict().keys()
    plain.load_state_dict(state)  # strict
    torch.testing.assert_close(logits(plain), live, **MERGED)
    # the FSDP2 path computes the same merge from a full state dict of the LoRA model
    from_state = merged_from_state(model, model.state_dict())
    assert from_state.keys() == state.keys()
    for key, value in state.items():
        torch.testing.assert_close(from_state[key], value, **MERGED)
    save_merged(model, load_tokenizer(folder), tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(reloaded) is Qwen3MoeForCausalLM and not is_lora(reloaded)
    torch.testing.assert_close(logits(reloaded), live, **MERGED)


def test_lora_dropout_on_fused_moe_experts_is_an_error_naming_the_field(tmp_path):
    folder = tiny_moe_dir(tmp_path / "moe")
    with pytest.raises(ModelLoadError, match=r"models\.lora\.dropout \(0\.1\) must be 0"):
        wrap_lora(load_causal_lm(folder), r=2, alpha=4.0, dropout=0.1)


def test_the_adapter_folder_of_fused_moe_experts_reloads_with_peft(tmp_path):
    folder = tiny_moe_dir(tmp_path / "moe")
    model = wrap_lora(load_causal_lm(folder), r=2, alpha=4.0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    model.eval()
    save_adapter(model, tmp_path / "adapter", base="acme/moe", revision="v2")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == ("acme/moe", "v2")
    assert model.peft_config["default"].revision is None  # the live config is left as it was
    base = AutoModelForCausalLM.from_pretrained(folder).eval()
    reloaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    torch.testing.assert_close(logits(reloaded), logits(model), **MERGED)


def test_the_pushed_adapter_is_a_peft_folder_that_computes_the_lora_model(tiny_dir, tmp_path):
    """What an adapter push carries (peft_saved_names of the adapter's tensors, adapter_config)
    written as vLLM's load_adapter writes it: the names are peft's own saved names, and the
    folder loads with PeftModel.from_pretrained onto the base and computes the live model."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    model = trained(tiny_dir, target_modules=["q_proj", "v_proj", "down_proj"])
    tensors = peft_saved_names(adapter_state_dict(model))
    assert set(tensors) == set(get_peft_model_state_dict(model, save_embedding_layers=False))
    config = adapter_config(model)
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert adapted_module_names(config) == {"q_proj", "v_proj", "down_proj"}
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    loaded = PeftModel.from_pretrained(load_causal_lm(tiny_dir), tmp_path).eval()
    torch.testing.assert_close(logits(loaded), logits(model), atol=0, rtol=0)
    assert not torch.allclose(logits(loaded), logits(load_causal_lm(tiny_dir)), atol=1e-3)
