"""Tests for the built-in char tokenizer: ids, round trips, specials, chat template, save/load."""

import pytest
from transformers import AutoTokenizer

from keel.models import CHAR_VOCAB, build_char_tokenizer

SAMPLES = ["37+45=82", "a b\nc", "(x) = [y]; {z}!", "", "  \n\n", "é 1€2"]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def test_vocab_layout(tok):
    assert len(set(CHAR_VOCAB)) == len(CHAR_VOCAB)
    for ch in "09azAZ \n+-*/=()<>|.,:;!?'\"_[]{}#%&@^~$\\`":
        assert ch in CHAR_VOCAB
    assert (tok.pad_token, tok.eos_token, tok.unk_token) == ("<pad>", "<eos>", "<unk>")
    assert (tok.pad_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2)
    assert tok.bos_token is None
    assert tok.bos_token_id is None
    assert len(tok) == 3 + len(CHAR_VOCAB)
    assert tok.padding_side == "right"
    assert tok.model_max_length == 2048


def test_every_char_is_one_token(tok):
    ids = tok(CHAR_VOCAB)["input_ids"]
    assert ids == list(range(3, 3 + len(CHAR_VOCAB)))
    for i, ch in enumerate(CHAR_VOCAB):
        assert tok.convert_tokens_to_ids(ch) == i + 3


def test_round_trip_exact(tok):
    ids = tok("37+45=82")["input_ids"]
    assert len(ids) == 8
    assert tok.decode(ids) == "37+45=82"
    for text in ["a b\nc", "(x) = [y]; {z}!", "  two  spaces  ", "'quote' \"dq\" \\ `tick`"]:
        assert tok.decode(tok(text)["input_ids"]) == text


def test_no_special_tokens_added(tok):
    ids = tok("37+45=")["input_ids"]
    assert ids == [tok.convert_tokens_to_ids(c) for c in "37+45="]
    assert tok.encode("37+45=") == ids
    assert tok("")["input_ids"] == []
    batch = tok(["1", "123"])["input_ids"]
    assert all(0 not in row and 1 not in row for row in batch)


def test_unknown_char_is_unk(tok):
    assert tok("é")["input_ids"] == [tok.unk_token_id]
    ids = tok("1€€2")["input_ids"]
    assert ids == [tok.convert_tokens_to_ids("1"), 2, 2, tok.convert_tokens_to_ids("2")]
    assert tok.decode([1, 3, 0], skip_special_tokens=True) == "0"


def test_right_padding_with_pad_id(tok):
    enc = tok(["1", "123"], padding=True)
    assert enc["input_ids"][0] == [tok.convert_tokens_to_ids("1"), 0, 0]
    assert enc["attention_mask"] == [[1, 0, 0], [1, 1, 1]]


def test_chat_template(tok):
    msgs = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>hi\n<|assistant|>"
    convo = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    text = tok.apply_chat_template(convo, tokenize=False)
    assert text == "<|system|>be brief\n<|user|>2+2?\n<|assistant|>4\n"
    # Every marker character is in the vocab, so rendering never produces <unk>.
    assert tok.unk_token_id not in tok(text)["input_ids"]


def test_save_load_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert loaded.is_fast
    for text in SAMPLES:
        assert loaded(text)["input_ids"] == tok(text)["input_ids"]
        assert loaded.decode(loaded(text)["input_ids"]) == tok.decode(tok(text)["input_ids"])
    assert loaded.special_tokens_map == tok.special_tokens_map
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 2)
    assert loaded.bos_token is None
    assert len(loaded) == len(tok)
    assert loaded.get_vocab() == tok.get_vocab()
    assert loaded.padding_side == "right"
    assert loaded.model_max_length == 2048
    assert loaded.chat_template == tok.chat_template
    msgs = [{"role": "user", "content": "37+45="}]
    assert loaded.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    ) == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
