"""Encoding: left-padded prompts, right-padded responses, masks (keel.data.encoding)."""

import json

import pytest
import torch

from keel.data import DataError, Example, load_examples
from keel.data.encoding import (
    ToolsIgnoredWarning,
    assemble,
    encode_prompt_text,
    encode_prompts,
    encode_sft,
    start_ids,
    template_renders_tools,
    warn_ignored_tools,
)
from keel.models import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def sft_batch(tok):
    examples = [Example("1+2=", "3", "3", "a:1"), Example("10+20=", "30", "30", "a:2")]
    return encode_sft(tok, examples, chat=False, max_prompt_length=16)


def test_encode_sft_left_pads_prompts_and_right_pads_responses_with_eos(tok):
    pad, eos = tok.pad_token_id, tok.eos_token_id
    expected = torch.tensor(
        [
            [pad, pad, *ids(tok, "1+2="), *ids(tok, "3"), eos, pad],
            [*ids(tok, "10+20="), *ids(tok, "30"), eos],
        ]
    )
    assert torch.equal(sft_batch(tok).input_ids, expected)


def test_encode_sft_masks_cover_response_and_eos_only(tok):
    batch = sft_batch(tok)
    assert batch.response_mask.tolist() == [[1, 1, 0], [1, 1, 1]]
    assert batch.attention_mask.tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 0], [1] * 9]
    assert (batch.prompt_length, batch.response_length) == (6, 3)


def test_encode_sft_keeps_prompts_and_answers(tok):
    batch = sft_batch(tok)
    assert (batch.prompts, batch.answers) == (["1+2=", "10+20="], ["3", "30"])


def test_assemble_layout_on_hand_example():
    # Row 1's tokens past its length (after EOS=1) are replaced by padding.
    batch = assemble([[5, 6], [7]], [[8, 9, 1], [10, 1, 11, 12]], [3, 2], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 8, 9, 1, 0], [0, 7, 10, 1, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]


def test_prompt_over_max_length_names_source(tok):
    with pytest.raises(DataError, match=r"data\.jsonl:7"):
        encode_prompts(
            tok, [Example("123456=", source="data.jsonl:7")], chat=False, max_prompt_length=5
        )


def test_prompt_at_max_length_is_accepted(tok):
    assert len(encode_prompts(tok, [Example("1234=")], chat=False, max_prompt_length=5)[0]) == 5


def test_sft_without_response_names_source(tok):
    with pytest.raises(DataError, match=r"data\.jsonl:3"):
        encode_sft(
            tok, [Example("1+1=", "2", None, "data.jsonl:3")], chat=False, max_prompt_length=16
        )


def test_chat_prompt_goes_through_the_template(tok):
    messages = [{"role": "user", "content": "1+1="}]
    got = encode_prompts(tok, [Example(messages)], chat=False, max_prompt_length=64)
    assert got == [ids(tok, "<|user|>1+1=\n<|assistant|>")]


def test_left_truncation_keeps_the_last_tokens(tok):
    ex = Example("123456=", source="data.jsonl:7")
    got = encode_prompts(tok, [ex], chat=False, max_prompt_length=4, truncation="left")
    assert got == [ids(tok, "456=")]
    with pytest.raises(DataError, match=r"data\.jsonl:7: prompt is 7 tokens"):
        encode_prompts(tok, [ex], chat=False, max_prompt_length=4, truncation="error")


def test_no_limit_measures_every_prompt(tok):
    got = encode_prompts(tok, [Example("1" * 300)], chat=False, max_prompt_length=None)
    assert len(got[0]) == 300


# --- BOS as the tokenizer says, and tools into the chat template -------------------------------

CHATML_WITH_TOOLS = (  # Qwen2.5's layout: the tools listed in a system turn
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n<tools>"
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_LIKE = (
    "{{ bos_token }}{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
    },
}


def bpe_tokenizer(add_bos: bool, template: str | None = None):
    """A character-level `tokenizers` BPE with <s>/</s>, wrapped as PreTrainedTokenizerFast; with
    add_bos a TemplateProcessing post-processor puts <s> before every text, as Llama's does."""
    import string

    from tokenizers import Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", fuse_unk=False))
    backend.decoder = decoders.Fuse()
    if add_bos:
        backend.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tokenizer.chat_template = template
    return tokenizer


def test_the_char_tokenizer_adds_no_bos_so_its_layout_is_unchanged(tok):
    assert start_ids(tok) == []
    got = encode_prompts(tok, [Example("1+2=")], chat=False, max_prompt_length=16)
    assert got == [ids(tok, "1+2=")]


def test_a_text_prompt_gets_exactly_one_bos_when_the_tokenizer_adds_one():
    llama = bpe_tokenizer(add_bos=True)
    assert start_ids(llama) == [llama.bos_token_id]
    got = encode_prompts(llama, [Example("1+2=")], chat=False, max_prompt_length=16)
    assert got == [[llama.bos_token_id, *ids(llama, "1+2=")]]
    assert got[0].count(llama.eos_token_id) == 0  # never an EOS after the prompt


def test_a_template_that_writes_the_bos_itself_gets_no_second_one():
    llama = bpe_tokenizer(add_bos=True, template=LLAMA3_LIKE)
    got = encode_prompts(llama, [Example("hi")], chat=True, max_prompt_length=64)[0]
    assert got[0] == llama.bos_token_id
    assert got.count(llama.bos_token_id) == 1
    assert llama.decode(got) == "<s><|im_start|>user\nhi<|im_end|><|im_start|>assistant\n"


def test_a_tokenizer_without_bos_gets_none():
    plain = bpe_tokenizer(add_bos=False, template=CHATML_WITH_TOOLS)
    assert start_ids(plain) == []
    for chat in (False, True):
        got = encode_prompts(plain, [Example("hi")], chat=chat, max_prompt_length=64)[0]
        assert plain.bos_token_id not in got


def test_sft_puts_the_bos_before_the_prompt_only():
    llama = bpe_tokenizer(add_bos=True)
    batch = encode_sft(llama, [Example("1+2=", "3", "3", "a:1")], chat=False, max_prompt_length=8)
    bos, eos = llama.bos_token_id, llama.eos_token_id
    assert batch.input_ids.tolist() == [[bos, *ids(llama, "1+2="), *ids(llama, "3"), eos]]
    assert batch.response_mask.tolist() == [[1, 1]]


def test_left_truncation_keeps_the_bos():
    llama = bpe_tokenizer(add_bos=True)
    got = encode_prompts(
        llama, [Example("123456=")], chat=False, max_prompt_length=4, truncation="left"
    )
    assert got == [[llama.bos_token_id, *ids(llama, "56=")]]


def test_encode_prompt_text_is_the_rule_for_one_text():
    llama = bpe_tokenizer(add_bos=True)
    bos = llama.bos_token_id
    assert encode_prompt_text(llama, "ab") == [bos, *ids(llama, "ab")]
    assert encode_prompt_text(llama, "<s>ab") == [bos, *ids(llama, "ab")]
    assert encode_prompt_text(llama, "") == []


def test_tools_reach_a_chat_template_that_renders_them():
    chatml = bpe_tokenizer(add_bos=False, template=CHATML_WITH_TOOLS)
    assert template_renders_tools(chatml)
    with_tools = Example("define cat", tools=[LOOKUP])
    got = encode_prompts(
        chatml, [with_tools, Example("define cat")], chat=True, max_prompt_length=512
    )
    shown, plain = (chatml.decode(x) for x in got)
    assert shown.startswith('<|im_start|>system\nYou may call these tools:\n<tools>{"type"')
    assert '"name": "lookup"' in shown and "lookup" not in plain
    assert shown.endswith(plain)  # the tools only add the system turn
    assert warn_ignored_tools(chatml, [with_tools], chat=True) is None


def test_tools_a_template_cannot_show_are_a_warning(tok):
    rows = [Example("1+2="), Example("2+2=", source="data.jsonl:2", tools=[LOOKUP])]
    assert not template_renders_tools(tok)
    with pytest.warns(ToolsIgnoredWarning, match=r"data\.jsonl:2: .*data\.columns\.tools"):
        message = warn_ignored_tools(tok, rows, chat=True)
    assert "renders the same text with and without tools" in message
    chatml = bpe_tokenizer(add_bos=False, template=CHATML_WITH_TOOLS)
    with pytest.warns(ToolsIgnoredWarning):
        message = warn_ignored_tools(chatml, rows, chat=False)
    assert message is not None and "data.apply_chat_template is false" in message
    assert warn_ignored_tools(tok, rows[:1], chat=True) is None


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def test_a_tools_column_and_data_tools_reach_the_examples(tmp_path):
    bare = {"name": "clock", "description": "The time.", "parameters": {"type": "object"}}
    path = write_rows(
        tmp_path / "calls.jsonl",
        [
            {"prompt": "define cat", "tools": [LOOKUP]},
            {"prompt": "what time is it", "functions": json.dumps([bare])},  # JSON text
            {"prompt": "hello"},
        ],
    )
    shared = [LOOKUP]
    rows = load_examples(path, tools_key="functions", tools=shared)
    assert rows[0].tools == shared  # its `tools` field is not data.tools_key here
    assert rows[1].tools == [{"type": "function", "function": bare}]
    assert rows[2].tools == shared
    assert load_examples(path)[0].tools == [LOOKUP]
    assert load_examples(path)[2].tools is None


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ({"type": "function"}, r"field 'tools' must be a list of tool definitions"),
        ("[not json", r"field 'tools' is text that is not JSON"),
        ([{"type": "code", "function": {"name": "x"}}], r"tools'\[0\]: type must be 'function'"),
        ([LOOKUP, {"function": {"name": ""}}], r"tools'\[1\]: function\.name must be"),
        ([{"function": {"name": "x", "parameters": [1]}}], r"parameters of 'x' must be a JSON"),
        ([7], r"tools'\[0\]: a tool definition is"),
    ],
)
def test_bad_tool_definitions_name_the_file_and_line(tmp_path, tools, message):
    path = write_rows(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"prompt": "x", "tools": tools}])
    with pytest.raises(DataError, match=rf"bad\.jsonl:2: .*{message}"):
        load_examples(path)


def test_bad_data_tools_name_the_config_key(tmp_path):
    path = write_rows(tmp_path / "ok.jsonl", [{"prompt": "ok"}])
    with pytest.raises(DataError, match=r"data\.tools: data\.tools\[0\]: function\.name"):
        load_examples(path, tools=[{"function": {}}])


def test_sft_rows_carry_their_tools_into_the_prompt():
    chatml = bpe_tokenizer(add_bos=False, template=CHATML_WITH_TOOLS)
    rows = [Example("define cat", response="a pet", tools=[LOOKUP]), Example("hi", response="yo")]
    batch = encode_sft(chatml, rows, chat=True, max_prompt_length=512)
    texts = [chatml.decode(ids, skip_special_tokens=False) for ids in batch.input_ids.tolist()]
    assert '"name": "lookup"' in texts[0] and "lookup" not in texts[1]
    # a chat answer ends as the template ends a turn (turn_end_id), not with the tokenizer's </s>
    assert texts[0].endswith("<|im_start|>assistant\na pet<|im_end|>")


def test_a_chat_turn_ends_with_the_special_token_its_template_closes_it_with():
    """turn_end_id: ChatML's <|im_end|>; a template whose closing is plain text (Keel's char
    one: a newline) or no template: the EOS. A chat rollout also stops on it."""
    from keel.data.encoding import stop_ids, turn_end_id
    from keel.models import build_char_tokenizer

    chatml = bpe_tokenizer(add_bos=False, template=CHATML_WITH_TOOLS)
    im_end = chatml.convert_tokens_to_ids("<|im_end|>")
    assert im_end != chatml.eos_token_id and turn_end_id(chatml) == im_end
    assert stop_ids([chatml.eos_token_id], chatml, chat=True) == (chatml.eos_token_id, im_end)
    assert stop_ids([chatml.eos_token_id], chatml, chat=False) == (chatml.eos_token_id,)
    char = build_char_tokenizer()
    assert turn_end_id(char) == char.eos_token_id
    rows = [Example("2+2=", response="4")]
    text_row = encode_sft(chatml, rows, chat=False, max_prompt_length=64)
    assert text_row.input_ids[0, -1].item() == chatml.eos_token_id  # text SFT: still the EOS


def test_the_rollout_engine_generates_from_prompts_with_one_bos():
    """Both engines' generate encode prompts with encode_prompts (keel.rollout.responses), so the
    vLLM engine is handed these same ids as prompt_token_ids."""
    from keel.models.factory import TinyModelSpec, build_tiny_model
    from keel.rollout import HFRolloutEngine, SamplingParams

    llama = bpe_tokenizer(add_bos=True, template=LLAMA3_LIKE)
    model = build_tiny_model(llama, TinyModelSpec(hidden_size=32, intermediate_size=64))
    engine = HFRolloutEngine(model, llama, chat=False, max_prompt_length=16)
    rows = [Example("1+2="), Example("10+20=")]
    batch = engine.generate(rows, SamplingParams(n=2, temperature=0.0, max_new_tokens=2))
    p = batch.prompt_length
    expected = encode_prompts(llama, rows, chat=False, max_prompt_length=16)
    for i, row in enumerate(batch.input_ids[:, :p].tolist()):
        prompt = [
            t for t, keep in zip(row, batch.attention_mask[i, :p].tolist(), strict=True) if keep
        ]
        assert prompt == expected[i // 2] and prompt.count(llama.bos_token_id) == 1
        assert prompt[0] == llama.bos_token_id
