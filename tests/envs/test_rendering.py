"""Observations as tokens: text as it is, messages through the chat template turn by turn."""

import pytest

from keel.envs.rendering import ObservationEncoder
from keel.models import build_char_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_text_is_appended_as_it_is():
    tok = build_char_tokenizer()
    enc = ObservationEncoder(tok, [tok.eos_token_id])
    assert tok.decode(enc.encode(" lower\n", stopped=True)) == " lower\n"
    assert enc.encode(None, stopped=True) == []


def test_messages_close_the_turn_and_open_the_next():
    tok = build_char_tokenizer()
    enc = ObservationEncoder(tok, [tok.eos_token_id])
    tool = [{"role": "tool", "content": "2146"}]
    assert tok.decode(enc.encode(tool, stopped=True)) == "\n<|tool|>2146\n<|assistant|>"
    tok.chat_template = CHATML  # the turn closes with the EOS the policy generated itself
    closed = enc.encode(tool, stopped=True)
    assert tok.decode(closed) == "\n<|im_start|>tool\n2146<eos>\n<|im_start|>assistant\n"
    assert closed[0] != tok.eos_token_id
    cut = enc.encode(tool, stopped=False)  # a turn cut at its budget gets the EOS too
    assert cut[0] == tok.eos_token_id and cut[1:] == closed


def test_bad_observations_are_clear_errors():
    tok = build_char_tokenizer()
    enc = ObservationEncoder(tok, [tok.eos_token_id])
    with pytest.raises(TypeError, match="text or a list of chat messages"):
        enc.encode([{"content": "no role"}], stopped=True)
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        enc.encode([{"role": "tool", "content": "1"}], stopped=True)
