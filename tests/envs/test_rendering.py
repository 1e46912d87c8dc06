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


# The four template styles of tests/models/families.py, each with the tokenizer kind its family
# uses and the ids a policy may stop on (the tokenizer's EOS and the generation config's).
STYLES = {
    "llama2": ("sentencepiece", ["</s>"]),
    "llama3": ("byte-bpe-bos", ["<|eot_id|>", "<|end_of_text|>"]),
    "chatml": ("byte-bpe", ["<|im_end|>", "<|endoftext|>"]),
    "gemma": ("gemma", ["<eos>", "<end_of_turn>"]),
}


def _style(template: str):
    from tests.models.families import build_tokenizer

    kind, stops = STYLES[template]
    tok = build_tokenizer(kind, template)
    return tok, tok.convert_tokens_to_ids(stops)


@pytest.mark.parametrize("template", list(STYLES))
def test_no_eos_twice_in_a_row_between_turns(template):
    """After a turn the policy ended with any of its EOS ids, the observation starts past the
    template's own EOS: Llama-2's closing ` </s>` (the space first) included."""
    tok, stops = _style(template)
    enc = ObservationEncoder(tok, stops)
    tool = [{"role": "user", "content": "The tool says 5."}]
    eos_texts = {tok.decode([i]) for i in stops}
    for stop in stops:
        tokens = enc.encode(tool, stopped=True)
        pieces = [t for t in tok.convert_ids_to_tokens([stop, *tokens]) if t.strip("▁Ġ\n")]
        assert pieces[0] in eos_texts and pieces[1] not in eos_texts, (template, pieces[:3])
        assert "The tool says 5." in tok.decode(tokens)
    cut = enc.encode(tool, stopped=False)  # a turn cut at its budget: the whole closing
    assert any(i in stops for i in cut[:3]), template


def test_llama2_closing_after_eos_is_dropped_with_its_space():
    tok, stops = _style("llama2")
    enc = ObservationEncoder(tok, stops)
    assert enc.after_eos(" </s>") == ""
    tokens = enc.encode([{"role": "user", "content": "higher"}], stopped=True)
    assert tokens[0] == tok.bos_token_id  # the next [INST] right after the policy's </s>
    assert tok.decode(tokens).replace(" ", "") == "<s>[INST]higher[/INST]"


def test_a_template_that_drops_the_observations_role_is_an_error_naming_it():
    tok = build_char_tokenizer()
    tok.chat_template = (  # renders user and assistant turns only
        "{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}"
        "{{ '<|' + m['role'] + '|>' + m['content'] + '\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
    )
    enc = ObservationEncoder(tok, [tok.eos_token_id])
    with pytest.raises(ValueError, match=r"renders no 'tool' messages.*text observations"):
        enc.encode([{"role": "tool", "content": "2146"}], stopped=True)
    user = enc.encode([{"role": "user", "content": "again"}], stopped=True)
    assert tok.decode(user) == "\n<|user|>again\n<|assistant|>"
