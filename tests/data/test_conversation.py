"""Multi-turn SFT rows are encoded exactly as the EpisodeRunner lays out a played episode (token
for token, mask for mask), every assistant turn trained with data.train_on: all_assistant, and
malformed tool calls in demonstrations are errors naming the file and line. The episodes are
played by a scripted engine (fixed turns, no model), so the file takes about a second."""

import functools
import json
from collections.abc import Sequence

import pytest
import torch

from keel.data.conversation import Conversation, encode_conversations
from keel.data.encoding import encode_sft
from keel.data.examples import Example
from keel.data.files import DataError, load_examples
from keel.envs.builtin import GuessNumberEnvironment, ToolEnvironment
from keel.envs.episodes import EpisodeRunner
from keel.models import build_char_tokenizer
from keel.rollout.protocol import Completions, SamplingParams

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HERMES_CALL = (
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*58"}}\n</tool_call>'
)
OPENAI_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "37*58"}'},
        }
    ],
}


class ScriptedEngine:
    """generate_ids for one episode: turn k answers `turns[k]` then the tokenizer's EOS."""

    def __init__(self, tokenizer, turns: Sequence[str]):
        self.tokenizer, self.turns, self.calls = tokenizer, list(turns), 0

    def generate_ids(self, prompts: list[list[int]], sampling: SamplingParams) -> Completions:
        assert len(prompts) == 1 and sampling.n == 1
        text = self.turns[self.calls]
        self.calls += 1
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return Completions(
            token_ids=[[*ids, self.tokenizer.eos_token_id]], logprobs=None, finish_reasons=["stop"]
        )


def chatml_tokenizer():
    """The char tokenizer with ChatML's turn markers as special tokens, `<|im_end|>` its EOS."""
    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML
    return tok


def play(tokenizer, make_env, example: Example, turns: Sequence[str], *, chat: bool):
    runner = EpisodeRunner(
        ScriptedEngine(tokenizer, turns),
        tokenizer,
        make_env,
        eos_ids=[tokenizer.eos_token_id],
        pad_id=tokenizer.pad_token_id,
        max_turns=len(turns),
        chat=chat,
        workers=1,
    )
    return runner.generate([example], SamplingParams(n=1, max_new_tokens=128))


def load_one(tmp_path, row: dict, train_on: str = "all_assistant") -> Example:
    path = tmp_path / "demos.jsonl"
    path.write_text(json.dumps(row) + "\n")
    (example,) = load_examples(path, require=("prompt", "response"), train_on=train_on)
    return example


def assert_same_layout(played, encoded):
    """The SFT batch is the played episode: ids, attention and response masks (trained tokens
    = the policy's tokens, holes on the observations)."""
    assert encoded.input_ids.shape == played.input_ids.shape
    assert torch.equal(encoded.input_ids, played.input_ids)
    assert torch.equal(encoded.attention_mask, played.attention_mask)
    assert torch.equal(encoded.response_mask, played.response_mask)
    assert (
        0 < encoded.response_mask.sum() < encoded.attention_mask[0, -played.response_length :].sum()
    )


CALCULATOR = functools.partial(ToolEnvironment, tools=["calculator"])


def test_a_text_prompt_tool_episode_with_the_char_template(tmp_path):
    """builtin:tools, text prompt (data.apply_chat_template: false), the char template renders
    the tool's message: the row is {prompt, messages: the episode's messages}."""
    tok = build_char_tokenizer()
    example = Example(prompt="37*58=", answer="2146")
    played = play(tok, CALCULATOR, example, [HERMES_CALL, "2146"], chat=False)
    assert played.episodes[0]["tool_calls"] == 1 and played.episodes[0]["tool_errors"] == 0
    row = {"prompt": example.prompt, "messages": played.episodes[0]["messages"]}
    demo = load_one(tmp_path, row)
    assert isinstance(demo, Conversation) and demo.response == "2146"
    encoded = encode_conversations(tok, [demo], chat=False, max_prompt_length=64)
    assert_same_layout(played, encoded)


@pytest.mark.parametrize("openai_style", [False, True], ids=["content", "tool_calls"])
def test_a_chat_tool_episode_with_a_chatml_template(tmp_path, openai_style):
    """A ChatML conversation (system and user opening, tool_calls or the call as text, a tool
    message) is the episode the runner plays from the same opening, `<|im_end|>` its EOS."""
    tok = chatml_tokenizer()
    opening = [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "37*58="},
    ]
    played = play(tok, CALCULATOR, Example(prompt=opening), [HERMES_CALL, "It is 2146."], chat=True)
    messages = [dict(m) for m in played.episodes[0]["messages"]]
    assert messages[1]["role"] == "tool" and messages[1]["content"] == "2146"
    if openai_style:
        messages[0] = OPENAI_CALL
    demo = load_one(tmp_path, {"messages": opening + messages})
    assert demo.prompt == opening
    encoded = encode_conversations(tok, [demo], chat=True, max_prompt_length=64)
    assert_same_layout(played, encoded)
    text = tok.decode(encoded.input_ids[0])
    assert text.count("<|im_end|>") == 5  # system, user, call, tool, answer: none doubled


def test_a_guess_number_episode_with_text_observations(tmp_path):
    tok = build_char_tokenizer()
    example = Example(prompt="guess 1-9:", answer="3")
    played = play(tok, GuessNumberEnvironment, example, ["5", "2", "3"], chat=False)
    assert played.episodes[0]["turns"] == 3 and played.episodes[0]["termination"] == "done"
    row = {"prompt": example.prompt, "messages": played.episodes[0]["messages"]}
    encoded = encode_conversations(tok, [load_one(tmp_path, row)], chat=False, max_prompt_length=64)
    assert_same_layout(played, encoded)
    trained = encoded.input_ids[0, -encoded.response_length :][encoded.response_mask[0].bool()]
    assert tok.decode(trained) == "5<eos>2<eos>3<eos>"


def test_train_on_last_masks_the_earlier_turns(tmp_path):
    tok = build_char_tokenizer()
    turns = [
        {"role": "assistant", "content": "5"},
        {"role": "observation", "content": " lower\n"},
        {"role": "assistant", "content": "3"},
    ]
    demo = load_one(tmp_path, {"prompt": "guess 1-9:", "messages": turns}, train_on="last")
    assert isinstance(demo, Conversation)
    every, last = (
        encode_conversations(tok, [demo], chat=False, max_prompt_length=64, train_on=mode)
        for mode in ("all_assistant", "last")
    )
    assert torch.equal(every.input_ids, last.input_ids)
    responses = every.input_ids[0, -every.response_length :]
    assert tok.decode(responses[every.response_mask[0].bool()]) == "5<eos>3<eos>"
    assert tok.decode(responses[last.response_mask[0].bool()]) == "3<eos>"


def test_messages_rows_keep_todays_layout_under_train_on_last(tmp_path):
    """train_on: last (the default) trains the last assistant message of a messages row with
    the messages before it rendered as the prompt, as before."""
    chat = [
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
    ]
    last = load_one(tmp_path, {"messages": chat}, train_on="last")
    assert type(last) is Example and last.prompt == chat[:3] and last.response == "4"
    every = load_one(tmp_path, {"messages": chat})
    assert every.prompt == chat[:1] and [m["content"] for m in every.turns] == ["2", "2+2=", "4"]


def test_a_plain_example_is_a_one_turn_conversation():
    tok = build_char_tokenizer()
    examples = [Example(prompt="3+4=", response="7"), Example(prompt="12-5=", response="7")]
    plain = encode_sft(tok, examples, chat=False, max_prompt_length=64)
    encoded = encode_conversations(tok, examples, chat=False, max_prompt_length=64)
    for field in ("input_ids", "attention_mask", "response_mask"):
        assert torch.equal(getattr(plain, field), getattr(encoded, field)), field


BAD_CALLS = {
    "arguments not JSON": {
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}]
    },
    "unknown format": {"tool_calls": [{"name": "f", "parameters": {}}]},
    "broken block in the text": {"content": '<tool_call>{"name": "f", </tool_call>'},
    "no closing tag": {"content": '<tool_call>{"name": "f"}'},
}


@pytest.mark.parametrize("bad", list(BAD_CALLS))
def test_a_malformed_tool_call_names_the_file_and_line(tmp_path, bad):
    good = {"prompt": "37*58=", "messages": [{"role": "assistant", "content": "2146"}]}
    broken = {
        "prompt": "37*58=",
        "messages": [
            {"role": "assistant", **BAD_CALLS[bad]},
            {"role": "tool", "content": "error"},
            {"role": "assistant", "content": "2146"},
        ],
    }
    path = tmp_path / "demos.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in (good, broken, broken, good)) + "\n")
    with pytest.raises(DataError, match=f"{path}:2: field 'messages', message 0: malformed"):
        load_examples(path, require=("prompt", "response"), train_on="all_assistant")
    skipped: list[str] = []
    kept = load_examples(path, require=("prompt", "response"), on_bad_row="skip", bad_rows=skipped)
    assert len(kept) == 2 and len(skipped) == 2  # counted, the first naming line 2
    assert skipped[0].startswith(f"{path}:2:") and "malformed tool call" in skipped[0]


def test_openai_tool_calls_are_written_in_the_hermes_format(tmp_path):
    row = {"messages": [{"role": "user", "content": "37*58="}, OPENAI_CALL]}
    demo = load_one(tmp_path, row)
    assert demo.response == HERMES_CALL
    both = {**OPENAI_CALL, "content": "Let me compute."}
    demo = load_one(tmp_path, {"messages": [row["messages"][0], both]})
    assert demo.response == "Let me compute.\n" + HERMES_CALL


def test_a_turn_with_weight_0_is_in_the_sequence_but_not_trained(tmp_path):
    tok = build_char_tokenizer()
    turns = [
        {"role": "assistant", "content": "5", "weight": 0},
        {"role": "observation", "content": " lower\n"},
        {"role": "assistant", "content": "3"},
    ]
    demo = load_one(tmp_path, {"prompt": "guess 1-9:", "messages": turns})
    batch = encode_conversations(tok, [demo], chat=False, max_prompt_length=64)
    responses = batch.input_ids[0, -batch.response_length :]
    assert tok.decode(responses) == "5<eos> lower\n3<eos>"
    assert tok.decode(responses[batch.response_mask[0].bool()]) == "3<eos>"
    turns[0]["weight"] = 0.5
    with pytest.raises(DataError, match="message 0: weight must be 0"):
        load_one(tmp_path, {"prompt": "guess 1-9:", "messages": turns})


def test_tool_calls_are_written_in_the_configured_format(tmp_path):
    from keel.data.conversation import call_writer
    from keel.data.tool_calls import FORMATS

    tok = build_char_tokenizer()
    row = {"messages": [{"role": "user", "content": "37*58="}, OPENAI_CALL]}
    demo = load_one(tmp_path, row)
    mistral = call_writer(FORMATS["mistral"])
    batch = encode_conversations(tok, [demo], chat=True, max_prompt_length=64, write_calls=mistral)
    trained = batch.input_ids[0, -batch.response_length :][batch.response_mask[0].bool()]
    assert tok.decode(trained) == (
        '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "37*58"}}]<eos>'
    )


# ------------------------------------------------------- tools called but never defined
def write_rows(tmp_path, rows) -> list:
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_examples(path, train_on="all_assistant")


CALC = {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}


def test_rows_calling_a_tool_no_row_defines_are_a_warning_with_their_count(tmp_path):
    """issue 37: such data trained without a word. Calls count in every form a row can write
    them: OpenAI tool_calls, a Hermes block in a turn, a message-list prompt, a response."""
    from keel.data.conversation import UndefinedToolsWarning, warn_undefined_tools

    mistral = '[TOOL_CALLS][{"name": "search", "arguments": {"q": "x"}}]'
    rows = [
        {"prompt": "37*58=", "messages": [OPENAI_CALL, {"role": "tool", "content": "2146"},
                                          {"role": "assistant", "content": "2146"}]},
        {"prompt": "2*3=", "messages": [{"role": "assistant", "content": HERMES_CALL},
                                        {"role": "tool", "content": "6"},
                                        {"role": "assistant", "content": "6"}]},
        {"prompt": "1+1=", "response": "2"},
        {"prompt": "find x", "response": mistral},
    ]  # fmt: skip
    examples = write_rows(tmp_path, rows)
    with pytest.warns(UndefinedToolsWarning) as caught:
        message = warn_undefined_tools(examples)
    assert message == str(caught[0].message)
    assert message.startswith(f"{tmp_path / 'sft.jsonl'}:1: 3 of 4 rows call a tool that no row "
                              "defines (calculator, search)")  # fmt: skip
    assert "data.tools" in message


def test_tools_defined_by_any_row_or_data_tools_are_no_warning(tmp_path):
    import warnings

    from keel.data.conversation import warn_undefined_tools

    rows = [
        {"prompt": "37*58=", "tools": [CALC], "messages": [
            OPENAI_CALL, {"role": "tool", "content": "2146"},
            {"role": "assistant", "content": "2146"}]},
        {"prompt": "2*3=", "messages": [{"role": "assistant", "content": HERMES_CALL},
                                        {"role": "tool", "content": "6"},
                                        {"role": "assistant", "content": "6"}]},
    ]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_undefined_tools(write_rows(tmp_path, rows)) is None
        assert warn_undefined_tools([Example("1+1=", response="2")]) is None
    path = tmp_path / "shared.jsonl"
    path.write_text(json.dumps(rows[1]) + "\n")
    shared = load_examples(path, train_on="all_assistant", tools=[CALC])
    assert warn_undefined_tools(shared) is None
