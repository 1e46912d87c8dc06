"""Parameter counts computed from config.json equal those of the models transformers builds
(on the meta device: no weights), for every family Keel tests."""

import pytest
import torch
import transformers as T

from keel.engine.memory import ShapeError, shape_from_config

SMALL = dict(vocab_size=99, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
FAMILIES = {
    "llama": lambda: T.LlamaConfig(**SMALL, tie_word_embeddings=False, attention_bias=True,
                                   mlp_bias=True),
    "mistral": lambda: T.MistralConfig(**SMALL),
    "qwen2": lambda: T.Qwen2Config(**SMALL, tie_word_embeddings=True),
    "qwen3": lambda: T.Qwen3Config(**SMALL, head_dim=32),
    "qwen3_moe": lambda: T.Qwen3MoeConfig(**{**SMALL, "num_hidden_layers": 3},
                                          moe_intermediate_size=48, num_experts=4,
                                          num_experts_per_tok=2, mlp_only_layers=[1]),
    "gemma2": lambda: T.Gemma2Config(**SMALL, head_dim=16),
    "phi3": lambda: T.Phi3Config(**SMALL, pad_token_id=0),
    "olmo2": lambda: T.Olmo2Config(**SMALL),
    "gpt2": lambda: T.GPT2Config(vocab_size=99, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                 bos_token_id=0, eos_token_id=0),
}  # fmt: skip


def built_count(config, head: str = "lm") -> int:
    cls = {"lm": T.AutoModelForCausalLM, "value": T.AutoModelForTokenClassification,
           "score": T.AutoModelForSequenceClassification}[head]  # fmt: skip
    if head != "lm":
        config.num_labels = 1
    with torch.device("meta"):
        model = cls.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_parameter_count_from_the_config_is_the_built_models(family):
    config = FAMILIES[family]()
    shape = shape_from_config(config.to_dict())
    assert shape.model_type == family and not shape.assumed
    assert shape.parameters() == built_count(config)


@pytest.mark.parametrize("head", ["value", "score"])
def test_critic_and_reward_heads_are_counted(head):
    config = FAMILIES["llama"]()
    assert shape_from_config(config.to_dict()).parameters(head) == built_count(config, head)


def test_lora_adapter_parameters_are_peft_s():
    from peft import LoraConfig, get_peft_model

    config = FAMILIES["qwen2"]()
    with torch.device("meta"):
        model = get_peft_model(
            T.AutoModelForCausalLM.from_config(config),
            LoraConfig(r=4, target_modules="all-linear"),
        )
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = shape_from_config(config.to_dict())
    assert shape.lora_parameters(4, "all-linear") == trained
    assert shape.lora_parameters(4, ["q_proj", "v_proj"]) == 2 * 4 * (64 + 64 + 64 + 32)


def test_an_unknown_type_is_read_as_llama_like_and_a_missing_key_is_named():
    config = {**FAMILIES["llama"]().to_dict(), "model_type": "my_llama"}
    assert shape_from_config(config).assumed
    del config["intermediate_size"]
    with pytest.raises(ShapeError, match=r"m/config.json: `intermediate_size` is missing"):
        shape_from_config(config, "m/config.json")
    with pytest.raises(ShapeError, match="`hidden_size` must be a non-negative integer"):
        shape_from_config({**config, "hidden_size": "64"})
