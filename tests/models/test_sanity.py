"""The tokenizer checks every model source goes through (keel.models.sanity, run by
keel.models.loading.resolve_model): each broken case built from Keel's char tokenizer in a tiny
model folder, and what the resolver and the CLI say about it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from keel.checkpoint.policy import resolve_policy
from keel.cli.main import main
from keel.models import (
    ModelLoadError,
    TokenizerWarning,
    build_char_tokenizer,
    create_tiny_model,
    resolve_model,
)
from keel.models.sanity import tokenizer_facts, tokenizer_problems

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def chatml_tokenizer(**special):
    """The char tokenizer with ChatML's two special tokens (START, END) and template."""
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tok.chat_template = CHATML
    for name, value in special.items():
        setattr(tok, name, value)
    return tok


START, END = chatml_tokenizer().convert_tokens_to_ids([IM_START, IM_END])


def folder_with(tmp_path: Path, tok, stops: int | list[int] | None = None) -> Path:
    """A tiny model folder whose tokenizer is `tok` and whose generation config stops on
    `stops` (default: the tiny model's, <eos> id 1)."""
    folder = create_tiny_model(tmp_path / "model")
    tok.save_pretrained(folder)
    if stops is not None:
        path = folder / "generation_config.json"
        config = json.loads(path.read_text())
        path.write_text(json.dumps({**config, "eos_token_id": stops}))
    return folder


def resolved_warnings(folder: Path) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_model(folder)
    return [str(w.message) for w in caught if issubclass(w.category, TokenizerWarning)]


def kinds(tok, stops: tuple[int, ...] = (1,)) -> list[str]:
    return [p.kind for p in tokenizer_problems(tokenizer_facts(tok, stops))]


def test_the_tiny_model_and_a_sound_chatml_tokenizer_have_no_problem(tmp_path, tiny_dir):
    assert resolved_warnings(tiny_dir) == []
    sound = chatml_tokenizer(eos_token=IM_END)
    assert kinds(sound, (END,)) == []
    facts = resolve_model(folder_with(tmp_path, sound, stops=END)).facts
    assert facts is not None
    assert (facts.eos_id, facts.template.turn_end_id, facts.template.opener_ids) == (
        END,
        END,
        (START,),
    )


def test_an_eos_that_opens_the_assistants_turn_is_an_error_naming_the_folder_and_ids(
    tmp_path, capsys
):
    # transformers' GGUF reading of SmolLM2: EOS = BOS = <|im_start|>
    folder = folder_with(tmp_path, chatml_tokenizer(eos_token=IM_START, bos_token=IM_START))
    with pytest.raises(ModelLoadError) as error:
        resolve_model(folder)
    message = str(error.value)
    assert str(folder) in message
    assert f"'<|im_start|>' (id {START})" in message and f"'<|im_end|>' (id {END})" in message
    with pytest.raises(ModelLoadError, match="opens the assistant's turn"):
        resolve_policy(folder)  # keel generate, eval and serve name their model so
    # through the CLI: bad input, exit 2, before any model is loaded
    assert main(["generate", str(folder), "hi", "--chat"]) == 2
    assert "opens the assistant's turn" in capsys.readouterr().err


def char_tokenizer(**special):
    tok = build_char_tokenizer()
    for name, value in special.items():
        setattr(tok, name, value)
    return tok


def test_eos_equal_to_bos_is_a_warning(tmp_path):
    (message,) = resolved_warnings(folder_with(tmp_path, char_tokenizer(bos_token="<eos>")))
    assert "EOS and BOS are one token, '<eos>' (id 1)" in message
    assert str(tmp_path / "model") in message


def test_a_missing_pad_token_is_a_warning(tmp_path):
    (message,) = resolved_warnings(folder_with(tmp_path, char_tokenizer(pad_token=None)))
    assert "no pad token" in message and "'<eos>' (id 1)" in message


def test_an_eos_the_chat_template_never_writes_is_a_warning(tmp_path):
    # ChatML closes turns with <|im_end|>; the EOS stays <eos>, which nothing in a chat writes,
    # and the generation config stops on <eos> alone
    (message,) = resolved_warnings(folder_with(tmp_path, chatml_tokenizer()))
    assert "never writes the EOS '<eos>' (id 1)" in message
    assert f"'<|im_end|>' (id {END})" in message and "eos_token_id: '<eos>' (id 1)" in message


def test_a_turn_end_the_generation_config_does_not_stop_on_is_a_warning(tmp_path):
    # the template writes the EOS (after the conversation) but closes turns with <|im_end|>
    tok = chatml_tokenizer()
    tok.chat_template = CHATML + "{% if not add_generation_prompt %}{{ eos_token }}{% endif %}"
    assert kinds(tok) == ["turn_end_not_stopped"]
    (message,) = resolved_warnings(folder_with(tmp_path, tok))
    assert f"closes turns with '<|im_end|>' (id {END})" in message
    # the generation config that stops on it silences it
    assert kinds(tok, (1, END)) == []


def test_each_folder_is_checked_once_per_version_of_its_files(tmp_path):
    folder = folder_with(tmp_path, char_tokenizer(bos_token="<eos>"))
    assert len(resolved_warnings(folder)) == 1
    assert resolved_warnings(folder) == []  # the same files: checked already
    char_tokenizer(pad_token=None).save_pretrained(folder)
    (message,) = resolved_warnings(folder)  # rewritten: checked again
    assert "no pad token" in message
