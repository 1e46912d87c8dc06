"""Tools in `keel serve`'s chat API: the request's tools through the chat template, the
`openai` SDK's tool-call round trip rendered in the model's format, answers read into
`message.tool_calls` by the training parser, and the refusals (a template without tools, a
validation error in plain words)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import openai
import pytest

from keel.chatapi.chat_tools import check_tool_results, read_calls, with_tool_calls
from keel.chatapi.errors import APIError
from keel.chatapi.responses import Answer, Reply, chat_body, chat_chunks
from keel.cli.main import main
from keel.data.encoding import encode_prompt_text, render_prompt
from keel.data.tool_calls import HERMES, MistralFormat, ToolCall, tool_call_format_for
from keel.models import load_tokenizer
from tests.data.test_encoding import CHATML_WITH_TOOLS, LOOKUP, bpe_tokenizer
from tests.models.families import FAMILIES, build_family
from tests.serve.live_server import InProcessServer

CALL = '<tool_call>\n{"name": "lookup", "arguments": {"word": "cat"}}\n</tool_call>'
ASK = [{"role": "user", "content": "define cat"}]
STEPS, LR = 400, 1e-2  # measured: last SFT loss 0.0005, the greedy answer is CALL


# ------------------------------------------------------------------------- reading answers
def test_hermes_calls_are_read_and_the_text_outside_them_is_the_content():
    text = f"Let me look.\n{CALL}\n<tool_call>\nnot json\n</tool_call>"
    read = read_calls(HERMES, text)
    assert read.calls == [ToolCall("lookup", {"word": "cat"})]
    assert read.content == "Let me look.\n\n<tool_call>\nnot json\n</tool_call>"  # bad one kept
    assert read_calls(HERMES, "no calls").content == "no calls"
    assert read_calls(HERMES, CALL).content == ""
    mistral = MistralFormat()
    got = read_calls(mistral, 'Sure.[TOOL_CALLS][{"name": "lookup", "arguments": {"w": 1}}]')
    assert (got.content, got.calls) == ("Sure.", [ToolCall("lookup", {"w": 1})])
    llama = tool_call_format_for(None, "llama3_json")
    got = read_calls(llama, '{"name": "lookup", "parameters": {"word": "dog"}}')
    assert (got.content, got.calls) == ("", [ToolCall("lookup", {"word": "dog"})])


def test_an_answer_with_calls_is_openais_tool_calls_message_whole_and_streamed():
    a = with_tool_calls(Answer(CALL, "stop", 20), HERMES)
    assert a.finish_reason == "tool_calls" and a.text == ""
    (call,) = a.tool_calls
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "lookup"
    assert json.loads(call["function"]["arguments"]) == {"word": "cat"}
    assert with_tool_calls(Answer(CALL, "length", 20), HERMES).finish_reason == "length"
    plain = Answer("hello", "stop", 2)
    assert with_tool_calls(plain, HERMES) is plain
    reply = Reply.new("chatcmpl", "m", None)
    message = chat_body(reply, [a], 5, False)["choices"][0]["message"]
    assert message["content"] is None and message["tool_calls"] == a.tool_calls
    events = [json.loads(e[len(b"data: ") :]) for e in list(chat_chunks(reply, [a], 5, False))[:-1]]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[1] == {"tool_calls": [{"index": 0, **call}]}
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


# ------------------------------------------------------------------------- a served model
@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    """A tiny Qwen2 (byte-level BPE, EOS <|im_end|>) with a ChatML template that lists tools in
    a system turn, SFT'd on one row to answer "define cat" (with the lookup tool) by CALL."""
    root = tmp_path_factory.mktemp("tool-model")
    base = build_family(FAMILIES["qwen2"], root / "base")
    tok = load_tokenizer(base)
    tok.chat_template = CHATML_WITH_TOOLS
    tok.save_pretrained(base)
    row = {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "lookup", "arguments": '{"word": "cat"}'}}]}],
        "tools": [LOOKUP]}  # fmt: skip
    data = root / "calls.jsonl"
    data.write_text(json.dumps(row) + "\n")
    config = {
        "seed": 0, "run_dir": str(root / "sft"), "models": {"actor": str(base)},
        "algorithm": {"name": "sft"},
        "data": {"train": str(data), "apply_chat_template": True, "max_prompt_length": 256},
        "rollout": {"max_new_tokens": 4},
        "train": {"steps": STEPS, "batch_size": 1, "lr": LR, "warmup_steps": 0,
                  "weight_decay": 0.0},
        "eval": {"every": 0}, "checkpoint": {"save_steps": 0}, "monitor": {"progress": False},
    }  # fmt: skip
    path = root / "sft.yaml"
    path.write_text(json.dumps(config))
    assert main(["train", str(path)]) == 0
    return root / "sft" / "model"


@pytest.fixture(scope="module")
def served(tool_model):
    server = InProcessServer(tool_model, "--set", "serve.model_name=tools",
                             "--set", "serve.max_new_tokens=96")  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.base_url, api_key="x", max_retries=0, timeout=60)


def expected_prompt_tokens(folder: Path, messages: list[dict], tools=None) -> int:
    tok = load_tokenizer(folder)
    return len(encode_prompt_text(tok, render_prompt(tok, messages, chat=True, tools=tools)))


def test_a_call_the_model_writes_comes_back_as_tool_calls_and_the_round_trip_continues(
    client, tool_model
):
    out = client.chat.completions.create(
        model="tools", messages=ASK, tools=[LOOKUP], max_tokens=80, temperature=0
    )
    (choice,) = out.choices
    assert choice.finish_reason == "tool_calls", choice.message
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.type, call.function.name) == ("function", "lookup")
    assert json.loads(call.function.arguments) == {"word": "cat"}
    # the tools are in the prompt: the template's system turn lists them
    assert out.usage.prompt_tokens == expected_prompt_tokens(tool_model, ASK, [LOOKUP])
    assert out.usage.prompt_tokens > expected_prompt_tokens(tool_model, ASK) + 20

    # the SDK's round trip: the assistant message (content None, tool_calls), a tool result
    followup = [*ASK, choice.message,  # the SDK's own object, as its docs pass it back
                {"role": "tool", "tool_call_id": call.id, "content": "a small feline"}]  # fmt: skip
    again = client.chat.completions.create(
        model="tools", messages=followup, tools=[LOOKUP], max_tokens=8, temperature=0
    )
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    rendered = [*ASK, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "a small feline"}]  # fmt: skip
    assert again.usage.prompt_tokens == expected_prompt_tokens(tool_model, rendered, [LOOKUP])


def test_a_message_object_as_openais_api_returns_it_is_accepted(client, tool_model):
    """The assistant message of an answer from OpenAI's own API carries `annotations`,
    `audio` and `function_call` beside `content: null` and `tool_calls`; passed back through
    the SDK, it is rendered as Keel's own answer would be (the call in the model's format)."""
    from openai.types.chat import ChatCompletionMessage

    message = ChatCompletionMessage.model_validate({
        "role": "assistant", "content": None, "refusal": None, "annotations": [], "audio": None,
        "function_call": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "lookup", "arguments": json.dumps({"word": "cat"})}}],
    })  # fmt: skip
    tool = {"role": "tool", "tool_call_id": "call_1", "content": "a small feline"}
    out = client.chat.completions.create(
        model="tools", messages=[*ASK, message, tool], tools=[LOOKUP], max_tokens=1
    )
    rendered = [*ASK, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "a small feline"}]  # fmt: skip
    assert out.usage.prompt_tokens == expected_prompt_tokens(tool_model, rendered, [LOOKUP])


def test_tool_choice_none_returns_the_call_as_text(client):
    out = client.chat.completions.create(
        model="tools", messages=ASK, tools=[LOOKUP], tool_choice="none", max_tokens=80,
        temperature=0,
    )  # fmt: skip
    (choice,) = out.choices
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert CALL in choice.message.content


def test_a_streamed_answer_delivers_the_tool_calls(client):
    stream = client.chat.completions.create(
        model="tools", messages=ASK, tools=[LOOKUP], max_tokens=80, temperature=0, stream=True
    )
    calls, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("lookup", {"word": "cat"})
    ]


BAD = {
    "required": ({"tool_choice": "required", "tools": [LOOKUP]}, "tool_choice"),
    "tool_choice without tools": ({"tool_choice": "auto"}, "tool_choice"),
    "null content": ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    "content of a wrong type": ({"messages": [{"role": "user", "content": 5}]},
                                "messages[0].content"),
    "bad call arguments": ({"messages": [*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{no"}}]}]},
        "messages[1].tool_calls"),
    "response_format": ({"response_format": {"type": "json_object"}}, None),
    "an unknown key of a message": ({"messages": [{"role": "user", "content": "x", "colour": 1}]},
                                    "messages[0].colour"),
    "a function_call": ({"messages": [*ASK, {"role": "assistant", "content": "x",
                         "function_call": {"name": "f", "arguments": "{}"}}]},
                        "messages[1].function_call"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
def test_refusals_name_the_field_in_plain_words(served, case):
    extra, param = BAD[case]
    status, answer = served.request("POST", "/v1/chat/completions",
                                    {"model": "tools", "messages": ASK, **extra})  # fmt: skip
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == param, error
    assert (param or case) in error["message"]
    assert ".str" not in error["message"] and "list[" not in error["message"]


def test_a_template_without_tools_is_a_400_naming_tools(tiny_dir):
    """The built-in char model's template renders the same prompt with and without tools; and
    its /v1/models root is absolute though MODEL was given relative to the working directory."""
    server = InProcessServer(os.path.relpath(tiny_dir), "--set", "serve.model_name=tiny")
    try:
        body = {"model": "tiny", "messages": ASK, "tools": [LOOKUP]}
        status, answer = server.request("POST", "/v1/chat/completions", body)
        _, models = server.request("GET", "/v1/models")
        _, plain = server.request("POST", "/v1/chat/completions",
                                  {"model": "tiny", "messages": ASK, "max_tokens": 2})  # fmt: skip
    finally:
        server.stop()
    assert status == 400, answer
    assert answer["error"]["param"] == "tools"
    assert "does not render tools" in answer["error"]["message"]
    root = models["data"][0]["root"]
    assert Path(root).is_absolute() and Path(root) == Path(tiny_dir).resolve()
    assert "choices" in plain


def test_a_template_that_drops_tool_messages_is_a_400_naming_the_message():
    no_tool_role = (
        "{% for m in messages %}{% if m['role'] != 'tool' %}<|im_start|>{{ m['role'] }}\n"
        "{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}<|im_start|>assistant\n"
    )
    messages = [*ASK, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "a small feline"}]  # fmt: skip
    check_tool_results(bpe_tokenizer(False, CHATML_WITH_TOOLS), messages, [LOOKUP])  # shown
    with pytest.raises(APIError, match=r"messages\[2\]: .* renders no 'tool' messages") as err:
        check_tool_results(bpe_tokenizer(False, no_tool_role), messages, None)
    assert err.value.param == "messages[2]" and err.value.status == 400


def test_the_served_engine_stops_on_the_templates_turn_end(tmp_path):
    """keel serve's engine (chat off: requests arrive as messages) still stops on the chat
    template's turn end, here ChatML's <|im_end|> beside the tokenizer's </s>."""
    from keel.models.factory import TinyModelSpec, build_tiny_model
    from keel.serve.config import ServeFileConfig
    from keel.serve.policy import build_engine
    from tests.data.test_encoding import CHATML_WITH_TOOLS, bpe_tokenizer

    tok = bpe_tokenizer(add_bos=False, template=CHATML_WITH_TOOLS)
    build_tiny_model(tok, TinyModelSpec(hidden_size=32, intermediate_size=64)).save_pretrained(
        tmp_path
    )
    tok.save_pretrained(tmp_path)
    engine = build_engine(tmp_path, ServeFileConfig(), tok)
    assert tok.eos_token_id in engine.eos_ids
    assert tok.convert_tokens_to_ids("<|im_end|>") in engine.eos_ids
