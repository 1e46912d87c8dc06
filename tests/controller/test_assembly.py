"""Assembling a run: which roles exist, and which held-out data is used."""

import pytest

from keel.config import validate
from keel.controller.assembly import (
    Datasets,
    build_reward,
    build_roles,
    check_context_length,
    fit_prompt_lengths,
    load_datasets,
)
from keel.data import DataError, Example
from keel.models import ModelLoadError, build_char_tokenizer
from keel.recipes import build_spec


def assemble(tiny_dir, **algorithm):
    cfg = validate({"models": {"actor": str(tiny_dir)}, "algorithm": algorithm,
                    "data": {"arithmetic": {"eval_size": 10}}})  # fmt: skip
    spec = build_spec(cfg)
    return cfg, spec, build_roles(cfg, spec, build_reward(cfg))


def test_kl_coefficient_zero_loads_no_reference_model(tiny_dir):
    _, _, roles = assemble(tiny_dir, name="grpo", kl_loss_coef=0.0)
    assert roles.reference is None


def test_reference_is_a_separate_frozen_copy(tiny_dir):
    _, _, roles = assemble(tiny_dir, name="grpo", kl_loss_coef=0.01)
    actor = roles.actor.workers[0].model
    ref = roles.reference.workers[0].model
    assert ref is not actor
    assert not any(p.requires_grad for p in ref.parameters())


def test_rollout_engine_generates_with_the_actors_weights(tiny_dir):
    _, _, roles = assemble(tiny_dir, name="grpo")
    assert roles.rollout.workers[0].engine.model is roles.actor.workers[0].model


def test_eval_defaults_to_the_arithmetic_held_out_split_only_for_arithmetic(tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "a", "answer": "1"}\n')
    base = {"models": {"actor": "x"}, "algorithm": {"name": "grpo"}}
    own = validate({**base, "data": {"train": str(data)}})
    assert load_datasets(own, build_spec(own)).eval == []
    arith = validate({**base, "data": {"arithmetic": {"eval_size": 7}}})
    assert len(load_datasets(arith, build_spec(arith)).eval) == 7


# ------------------------------------------------------- prompt lengths and the context
def long_and_short():
    train = [Example("1+1=", "2", source="t.jsonl:1"), Example("1" * 20 + "=", source="t.jsonl:2")]
    return Datasets(train=train, eval=[Example("2" * 30 + "=", source="e.jsonl:5")])


def data_cfg(truncation: str):
    cfg = validate({"models": {"actor": "x"}, "algorithm": {"name": "grpo"},
                    "data": {"max_prompt_length": 8, "truncation": truncation}})  # fmt: skip
    return cfg.data


def test_a_prompt_over_the_limit_is_an_error_naming_its_line_and_the_value_to_set():
    """The first long prompt, how many there are, and the longest: its length is the setting."""
    with pytest.raises(DataError) as err:
        fit_prompt_lengths(build_char_tokenizer(), long_and_short(), data_cfg("error"))
    assert str(err.value) == (
        "t.jsonl:2: prompt is 21 tokens, more than data.max_prompt_length (8) (2 prompts are "
        "over it); the longest, e.jsonl:5, is 31 tokens: set data.max_prompt_length: 31 or "
        "more, or data.truncation: left (keep the last tokens) or drop"
    )
    cfg = data_cfg("error").model_copy(update={"max_prompt_length": 30})
    with pytest.raises(
        DataError,
        match=r"^e\.jsonl:5: prompt is 31 tokens, more than "
        r"data\.max_prompt_length \(30\): set data\.max_prompt_length: 31 or",
    ):
        fit_prompt_lengths(build_char_tokenizer(), long_and_short(), cfg)
    fit_prompt_lengths(
        build_char_tokenizer(), long_and_short(), cfg.model_copy(update={"max_prompt_length": 31})
    )  # the value the message names is enough


def test_drop_leaves_long_prompts_out_and_counts_them():
    data = fit_prompt_lengths(build_char_tokenizer(), long_and_short(), data_cfg("drop"))
    assert [ex.source for ex in data.train] == ["t.jsonl:1"] and data.eval == []
    assert data.dropped_prompts == 2 and data.truncated_prompts == 0
    assert data.long_prompts == ["t.jsonl:2 (21 tokens)", "e.jsonl:5 (31 tokens)"]


def test_drop_that_leaves_nothing_to_train_on_is_an_error():
    data = Datasets(train=[Example("1" * 20, source="t.jsonl:1")], eval=[])
    with pytest.raises(DataError, match="every prompt is longer"):
        fit_prompt_lengths(build_char_tokenizer(), data, data_cfg("drop"))


def test_left_keeps_long_prompts_and_counts_them():
    data = fit_prompt_lengths(build_char_tokenizer(), long_and_short(), data_cfg("left"))
    assert len(data.train) == 2 and len(data.eval) == 1
    assert data.truncated_prompts == 2 and data.dropped_prompts == 0


@pytest.mark.parametrize(
    ("sets", "keys"),
    [
        ({"data": {"max_prompt_length": 250}, "rollout": {"max_new_tokens": 7}},
         "data.max_prompt_length (250) + rollout.max_new_tokens (7) = 257 tokens"),
        ({"data": {"max_prompt_length": 200}, "eval": {"max_new_tokens": 60}},
         "data.max_prompt_length (200) + eval.max_new_tokens (60) = 260 tokens"),
    ],
)  # fmt: skip
def test_sequences_longer_than_the_models_context_are_refused(tiny_dir, sets, keys):
    cfg = validate({"models": {"actor": str(tiny_dir)}, "algorithm": {"name": "grpo"}, **sets})
    with pytest.raises(ModelLoadError) as info:
        check_context_length(cfg, build_spec(cfg))
    msg = str(info.value)
    assert keys in msg and f"models.actor ({tiny_dir})" in msg
    assert "at most 256 tokens (max_position_embeddings in its config.json)" in msg


def test_sequences_that_fit_the_context_pass(tiny_dir):
    sets = {"data": {"max_prompt_length": 240}, "rollout": {"max_new_tokens": 16}}
    cfg = validate({"models": {"actor": str(tiny_dir)}, "algorithm": {"name": "grpo"}, **sets})
    check_context_length(cfg, build_spec(cfg))  # 256 = 256


def test_lora_reference_is_the_actors_base_unless_another_folder_is_named(tiny_dir, tmp_path):
    import shutil

    from keel.models.lora import is_lora

    def roles(**models):
        cfg = validate({"models": {"actor": str(tiny_dir), "lora": {"r": 2}, **models},
                        "algorithm": {"name": "grpo", "kl_loss_coef": 0.01},
                        "data": {"arithmetic": {"eval_size": 10}}})  # fmt: skip
        return build_roles(cfg, build_spec(cfg), build_reward(cfg))

    same = roles(reference=str(tiny_dir))
    actor = same.actor.workers[0].model
    assert is_lora(actor) and same.rollout.workers[0].engine.model is actor  # adapter on
    assert same.reference.workers[0].model is actor and same.reference.workers[0].adapter_off
    assert any(p.requires_grad for p in actor.parameters())  # the reference froze nothing
    other = roles(reference=str(shutil.copytree(tiny_dir, tmp_path / "ref")))
    ref = other.reference.workers[0].model
    assert not is_lora(ref) and not any(p.requires_grad for p in ref.parameters())


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


def test_tool_definitions_the_prompts_cannot_show_are_a_warning_in_events_jsonl(tiny_dir, tmp_path):
    """A tools column with text prompts (data.apply_chat_template false): the warning is kept
    on the datasets and written to the run's events.jsonl, not only printed."""
    import json

    from keel.controller import run_training
    from keel.guard.events import read_events

    rows = [{"prompt": "1+1=", "response": "2", "tools": [TOOL]}] * 2
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = validate({
        "run_dir": str(tmp_path / "run"), "models": {"actor": str(tiny_dir)},
        "algorithm": {"name": "sft"}, "data": {"train": str(data)},
        "train": {"batch_size": 2, "steps": 1}, "monitor": {"progress": False},
    })  # fmt: skip
    with pytest.warns(UserWarning, match="tool definitions"):
        run_training(cfg)
    found = [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "warning"]
    assert [e["rule"] for e in found] == ["tools_ignored"]
    assert "sft.jsonl:1" in found[0]["message"] and "apply_chat_template" in found[0]["message"]


def test_a_missing_chat_template_names_the_model_and_the_setting(tiny_dir, tmp_path):
    """transformers' own error named neither the model nor data.apply_chat_template."""
    import shutil

    from keel.models import load_tokenizer

    folder = tmp_path / "no-template"
    shutil.copytree(tiny_dir, folder)
    (folder / "chat_template.jinja").unlink()
    tokenizer = load_tokenizer(folder)
    assert not tokenizer.chat_template
    chat = validate({"models": {"actor": str(folder)}, "algorithm": {"name": "grpo"},
                     "data": {"apply_chat_template": True}}).data  # fmt: skip
    with pytest.raises(ModelLoadError) as info:
        fit_prompt_lengths(tokenizer, long_and_short(), chat)
    assert str(info.value).startswith(f"{folder}: its tokenizer has no chat template, but "
                                      "data.apply_chat_template is true")  # fmt: skip
    messages = Datasets(train=[Example([{"role": "user", "content": "1+1="}], "2",
                                       source="m.jsonl:3")], eval=[])  # fmt: skip
    with pytest.raises(ModelLoadError, match=f"{folder}: .* the prompt of m.jsonl:3 is a list"):
        fit_prompt_lengths(tokenizer, messages, data_cfg("error"))
    assert fit_prompt_lengths(tokenizer, long_and_short(), data_cfg("left")).truncated_prompts


def test_training_rows_calling_undefined_tools_are_a_warning_for_events_jsonl():
    call = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
    data = Datasets(train=[Example("1+1=", response=call, source="t.jsonl:1"),
                           Example("2+2=", response="4", source="t.jsonl:2")], eval=[])  # fmt: skip
    with pytest.warns(UserWarning, match="1 of 2 rows call a tool that no row defines"):
        fitted = fit_prompt_lengths(build_char_tokenizer(), data, data_cfg("error"))
    assert [rule for rule, _ in fitted.warnings] == ["tools_undefined"]
    assert fitted.warnings[0][1].startswith("t.jsonl:1: 1 of 2 rows call a tool")
    defined = Datasets(train=[Example("1+1=", response=call, tools=[TOOL])], eval=[])
    with pytest.warns(UserWarning, match="tool definitions"):  # text prompts show no tools
        fitted = fit_prompt_lengths(build_char_tokenizer(), defined, data_cfg("error"))
    assert [rule for rule, _ in fitted.warnings] == ["tools_ignored"]  # but lookup is defined
