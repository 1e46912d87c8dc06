"""Conversations in the token layout of a played episode: multi-turn SFT rows and observations.

An episode (keel.envs.episodes.EpisodeRunner) is one token sequence: the opening prompt as any
prompt is rendered (`encode_prompts`), then in the response columns each assistant turn's text
tokens followed by the EOS that ended it, and between two turns the observation's tokens
(`ObservationEncoder`): text as it is, or chat messages through the tokenizer's chat template
(the closing of the assistant turn less the EOS, the messages, the next turn's opening).

A multi-turn SFT row (`Conversation`) is encoded into exactly that layout by
`encode_conversations`, with `response_mask` 1 on the trained assistant tokens (and the EOS
that ends each of them) and 0 on observations, as the runner's mask has holes there
(`data.train_on: all_assistant` trains every assistant turn, `last` the last one only).

Assistant turns may carry OpenAI-style `tool_calls`
(`[{"type": "function", "function": {"name": …, "arguments": …}}]`, arguments a JSON string or
object); they are written in the model's tool-call text format (Hermes / Qwen2.5's
`<tool_call>\\n{json}\\n</tool_call>` by default; `data.tool_format`, keel.data.tool_calls) after
the turn's content. A call that cannot be read (bad JSON, an unknown shape, a broken call
written in the content) is a DataError naming the row and the message.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from keel.data.encoding import assemble, encode_prompts, stop_ids, turn_end_id
from keel.data.errors import DataError
from keel.data.examples import Example
from keel.data.tool_calls import FORMATS, HERMES, ToolCall, ToolCallFormat, call_from_object
from keel.types import Batch

# `Any` in this module: chat messages and tool calls as a data file or a model wrote them,
# before they are checked; the tokenizer: transformers types its ids and decode() wider than
# they are.

TRAIN_ON = ("last", "all_assistant")
TEXT_OBSERVATION = "observation"  # the runner's role for a text observation (appended as is)

_USER = {"role": "user", "content": "keel-user-sentinel"}
_ANSWER = "keel-assistant-sentinel"


# --- observations -------------------------------------------------------------------------------


class ObservationEncoder:
    """encode(observation, stopped) → token ids of what follows a policy's turn. `stopped`: the
    turn ended with an EOS (the template's closing is then kept only after its EOS; a turn cut
    at the length budget gets the whole closing, EOS text included).

    The pieces are found by rendering a fixed two-message conversation with and without the
    observation and taking the difference, so any template that renders a conversation turn by
    turn works (Llama-2/3, Gemma, ChatML, Keel's char one)."""

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.eos_texts = [tokenizer.decode([i]) for i in eos_ids]
        self._base: tuple[str | None, str] | None = None  # (template, its base rendering)

    def encode(self, observation: str | list[dict[str, Any]] | None, stopped: bool) -> list[int]:
        if observation is None:
            return []
        if isinstance(observation, str):
            return self._ids(observation)
        if not isinstance(observation, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in observation
        ):
            raise TypeError(
                "an environment's observation must be text or a list of chat messages "
                f"({{'role': …, 'content': …}}), got {observation!r:.200}"
            )
        closing, opening = self._template_pieces(observation)
        if stopped:
            closing = self.after_eos(closing)
        return self._ids(closing + opening)

    def _template_pieces(self, messages: list[dict[str, Any]]) -> tuple[str, str]:
        """(the closing of an assistant turn, the messages rendered with the next turn's
        opening)."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                "the environment returned chat messages but the tokenizer has no chat template: "
                "return text observations, or use a model whose tokenizer has one"
            )
        base = [_USER, {"role": "assistant", "content": _ANSWER}]
        template = self.tokenizer.chat_template
        if self._base is None or self._base[0] != template:  # rendered once per template
            self._base = (template, self._render(base, generation_prompt=False))
        before = self._base[1]
        after = self._render(base + list(messages), generation_prompt=True)
        if not after.startswith(before) or _ANSWER not in before:
            raise ValueError(
                "the tokenizer's chat template does not render a conversation turn by turn "
                "(adding messages changes the text before them): use text observations"
            )
        added = after[len(before) :]
        for message in messages:
            content = message["content"]
            if isinstance(content, str) and content.strip() and content.strip() not in added:
                role = message["role"]
                raise ValueError(
                    f"the tokenizer's chat template renders no {role!r} messages: the "
                    f"observation's {role!r} content does not appear in the rendered "
                    f"conversation, so the model would never see it; use a template that "
                    f"renders role {role!r}, or return text observations"
                )
        closing = before[before.rindex(_ANSWER) + len(_ANSWER) :]
        return closing, added

    def _render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def after_eos(self, closing: str) -> str:
        """The closing of a turn the policy ended with an EOS: its text after the first EOS
        (`' </s>'` → `''`, `'<|im_end|>\\n'` → `'\\n'`), all of it when it holds no EOS (the
        char template's `'\\n'`)."""
        found = [(closing.find(t), t) for t in self.eos_texts if t and t in closing]
        if not found:
            return closing
        start, text = min(found)
        return closing[start + len(text) :]

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


# --- conversation rows --------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversation(Example):
    """An SFT row that is a whole conversation. `prompt` is its opening (text, or the messages
    before the first assistant turn), `turns` the rest as the runner records an episode
    (Batch.episodes[i]["messages"]): assistant turns (`assistant_turn`: content text and tool
    calls, written out in the model's tool-call format when encoded), and between them the
    observations (chat messages, or one `{"role": "observation"}` text). `response` is the last
    assistant turn's text, its calls in the Hermes format."""

    turns: tuple[dict[str, Any], ...] = ()


def hermes_calls(calls: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """(name, arguments) calls in the Hermes / Qwen2.5 text format, one block per call,
    joined by newlines (keel.data.tool_calls.HERMES)."""
    return HERMES.format([ToolCall(name, arguments) for name, arguments in calls])


def call_writer(tool_format: ToolCallFormat) -> CallWriter:
    """The CallWriter of a tool-call format (keel.data.tool_calls.tool_call_format_for)."""
    return lambda calls: tool_format.format([ToolCall(n, a) for n, a in calls])


CallWriter = Callable[[Sequence[tuple[str, dict[str, Any]]]], str]


def _openai_call(call: Any) -> tuple[str, dict[str, Any]]:
    """(name, arguments) of one OpenAI-style tool call; ValueError saying what is wrong."""
    if not isinstance(call, dict):
        raise ValueError(f"a tool call must be an object, got {call!r:.80}")
    if call.get("type", "function") != "function" or not isinstance(call.get("function"), dict):
        raise ValueError(
            'unknown tool-call format (expected {"type": "function", "function": '
            f'{{"name", "arguments"}}}}), got {call!r:.120}'
        )
    parsed = call_from_object(call["function"])
    if isinstance(parsed, str):
        raise ValueError(parsed)
    return parsed.name, parsed.arguments


def _check_call_text(text: str) -> None:
    """ValueError when `text` writes a tool call (Hermes `<tool_call>` blocks, Mistral
    `[TOOL_CALLS]`) that does not parse: no closing tag, bad JSON, no name, arguments that are
    not an object."""
    for tool_format in (HERMES, FORMATS["mistral"]):
        if tool_format.has_call_syntax(text):
            errors = tool_format.parse(text).errors
            if errors:
                raise ValueError(f"{tool_format.name}: {errors[0]}")


def assistant_turn(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message with its content as text ("" for none) and its `tool_calls` read
    into `calls`, [(name, arguments object)]. ValueError for a malformed call (in `tool_calls`
    or written in the content)."""
    content = message.get("content")
    if content is None:
        content = ""
    elif not isinstance(content, str):
        content = json.dumps(content)
    _check_call_text(content)
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list")
    turn = {"role": "assistant", "content": content, "calls": [_openai_call(c) for c in calls]}
    if message.get("weight") is not None:
        turn["weight"] = message["weight"]
    return turn


def assistant_text(turn: dict[str, Any], write_calls: CallWriter = hermes_calls) -> str:
    """The text an assistant turn's tokens spell: its content, then its calls (`assistant_turn`)
    as `write_calls` writes them (the model's tool-call format), joined by a newline."""
    calls = turn.get("calls") or []
    parts = [turn["content"]] if turn["content"] else []
    return "\n".join([*parts, write_calls(calls)] if calls else parts)


def _normal_messages(value: Any, where: str, key: str) -> list[dict[str, Any]]:
    """The messages of a conversation, assistant turns read by `assistant_turn`; DataError
    naming `where` and the message for anything malformed."""
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {key!r} must be a list of {{role, content}} messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise DataError(f"{where}: field {key!r}, message {i}: not a {{role, content}} message")
        if message["role"] == "assistant":
            if message.get("weight") not in (None, 0, 1) or isinstance(message.get("weight"), bool):
                raise DataError(
                    f"{where}: field {key!r}, message {i}: weight must be 0 (not trained) or 1"
                )
            try:
                out.append(assistant_turn(message))
            except ValueError as exc:
                raise DataError(
                    f"{where}: field {key!r}, message {i}: malformed tool call: {exc}"
                ) from None
            continue
        if "content" not in message:
            raise DataError(
                f"{where}: field {key!r}, message {i} ({message['role']}): no 'content'"
            )
        out.append(dict(message))
    return out


def _check_observations(turns: list[dict[str, Any]], where: str, key: str) -> None:
    """Between two assistant turns: chat messages, or text observations only (not both)."""
    group: list[dict[str, Any]] = []
    for message in [*turns, {"role": "assistant"}]:
        if message["role"] != "assistant":
            group.append(message)
            continue
        text = [m["role"] == TEXT_OBSERVATION for m in group]
        if any(text) and not all(text):
            raise DataError(
                f"{where}: field {key!r}: a text observation (role {TEXT_OBSERVATION!r}) and chat "
                "messages between the same two assistant turns"
            )
        if any(text) and not all(isinstance(m["content"], str) for m in group):
            raise DataError(
                f"{where}: field {key!r}: an {TEXT_OBSERVATION!r} message must hold text"
            )
        group = []


def conversation_row(
    messages: Any, where: str, key: str, *, opening: Any = None, train_on: str = "last"
) -> tuple[Any, str | None, tuple[dict[str, Any], ...] | None]:
    """(prompt, response, turns) of a row's `messages` (files.load_examples).

    Without `opening` (the row's prompt field) the messages before the first assistant turn
    are the opening; with it, the messages must start with the first assistant turn (an
    episode's messages after its prompt). A conversation that ends with an assistant turn
    gives its text as the response; its turns are returned (a Conversation is made) when the
    opening is a separate prompt or `train_on` is all_assistant; otherwise, as before multi-
    turn SFT, the prompt is every message before the last (rendered by the chat template) and
    turns is None. A conversation without a final assistant turn is a prompt only."""
    value = _normal_messages(messages, where, key)
    response = assistant_text(value[-1]) if value[-1]["role"] == "assistant" else None
    first = next((i for i, m in enumerate(value) if m["role"] == "assistant"), None)
    if opening is not None:
        if first != 0:
            raise DataError(
                f"{where}: field {key!r} after a prompt must start with an assistant turn"
            )
        if response is None:
            raise DataError(f"{where}: the last message of {key!r} must have role 'assistant'")
        _check_observations(value, where, key)
        return opening, response, tuple(value)
    if first == 0:
        raise DataError(f"{where}: field {key!r} has no message before the assistant's reply")
    if response is None:
        return _for_template(messages), None, None
    if train_on == "all_assistant":
        _check_observations(value[first:], where, key)
        return value[:first], response, tuple(value[first:])
    return _for_template(messages[:-1]), response, None


def _for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages the chat template renders as they are (an assistant message's tool_calls
    stay for it), a missing or null content as ""."""
    return [m if m.get("content") is not None else {**m, "content": ""} for m in messages]


# --- encoding -----------------------------------------------------------------------------------


def conversation_tokens(
    tokenizer: Any,
    observations: ObservationEncoder,
    turns: Sequence[dict[str, Any]],
    *,
    eos_id: int,
    train_on: str,
    write_calls: CallWriter = hermes_calls,
) -> tuple[list[int], list[int]]:
    """(tokens, mask) of a conversation's response columns, both of length R_i: each assistant
    turn's text tokens and `eos_id` (mask 1 when trained: every turn with all_assistant, the
    last with last, never a turn with `"weight": 0`, OpenAI's fine-tuning key), then the
    observation before the next turn (mask 0), as EpisodeRunner._record_turn and _after_step
    append them."""
    last = max(i for i, m in enumerate(turns) if m["role"] == "assistant")
    tokens: list[int] = []
    mask: list[int] = []
    pending: list[dict[str, Any]] = []
    for i, message in enumerate(turns):
        if message["role"] != "assistant":
            pending.append(message)
            continue
        if pending:
            ids = observations.encode(_observation(pending), stopped=True)
            tokens += ids
            mask += [0] * len(ids)
            pending = []
        text = assistant_text(message, write_calls)
        ids = [*tokenizer(text, add_special_tokens=False)["input_ids"], eos_id]
        trained = (train_on == "all_assistant" or i == last) and message.get("weight", 1) != 0
        tokens += ids
        mask += [int(trained)] * len(ids)
    return tokens, mask


def _observation(messages: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    if all(m["role"] == TEXT_OBSERVATION for m in messages):
        return "".join(m["content"] for m in messages)
    return messages


def has_conversations(examples: Sequence[Example]) -> bool:
    """Whether any example is a whole conversation (encoded by encode_conversations)."""
    return any(isinstance(ex, Conversation) for ex in examples)


def encode_conversations(
    tokenizer: Any,
    examples: Sequence[Example],
    *,
    chat: bool,
    max_prompt_length: int | None,
    truncation: str = "error",
    train_on: str = "all_assistant",
    write_calls: CallWriter = hermes_calls,
) -> Batch:
    """SFT batch in the episode runner's layout: input_ids / attention_mask [B, P+R] (the
    openings left-padded to P, encoded as the runner encodes them; the turns right-padded to
    R), response_mask [B, R] 1 on trained assistant tokens and their EOS, 0 on observations,
    untrained turns and padding. A plain Example is a one-turn conversation (its response +
    EOS, the layout of encode_sft). `write_calls` writes an assistant turn's tool calls (the
    model's tool-call format; default Hermes)."""
    if train_on not in TRAIN_ON:
        raise ValueError(f"data.train_on must be one of {TRAIN_ON}, got {train_on!r}")
    prompts = encode_prompts(
        tokenizer, examples, chat=chat, max_prompt_length=max_prompt_length, truncation=truncation
    )
    eos, turn_end = tokenizer.eos_token_id, turn_end_id(tokenizer)
    observations = ObservationEncoder(tokenizer, stop_ids([eos], tokenizer, chat=True))
    rows, masks = [], []
    for ex in examples:
        # a chat row's turns end as its template ends them (the rollout stops on that token)
        end = turn_end if chat or isinstance(ex.prompt, list) else eos
        if end is None:
            raise DataError("the tokenizer has no EOS token, which ends every SFT answer")
        if isinstance(ex, Conversation):
            turns: Sequence[dict[str, Any]] = ex.turns
        elif ex.response is None:
            raise DataError(f"{ex.source}: SFT needs a target response (data.columns.response)")
        else:
            turns = ({"role": "assistant", "content": ex.response},)
        try:
            tokens, mask = conversation_tokens(
                tokenizer,
                observations,
                turns,
                eos_id=end,
                train_on=train_on,
                write_calls=write_calls,
            )
        except ValueError as exc:
            raise DataError(f"{ex.source}: {exc}") from None
        rows.append(tokens)
        masks.append(mask)
    batch = assemble(prompts, rows, [len(r) for r in rows], tokenizer.pad_token_id)
    width = batch.response_length
    batch.response_mask = torch.tensor(
        [m + [0] * (width - len(m)) for m in masks], dtype=torch.float32
    )
    batch.prompts = [ex.prompt for ex in examples]
    batch.answers = [ex.answer for ex in examples]
    return batch


# --- tool calls the data makes and defines ------------------------------------------------------


class UndefinedToolsWarning(UserWarning):
    """Training rows call tools that no row's definitions (data.tools, data.columns.tools) name."""


def called_tools(example: Example) -> set[str]:
    """The names of the tools an example's assistant text calls: the calls of its turns (a
    Conversation), of the assistant messages of a message-list prompt (OpenAI `tool_calls`, or
    written in the content), and those written in its response (Hermes or Mistral format)."""
    texts: list[str] = []
    names: set[str] = set()
    assistant = [*getattr(example, "turns", ())]
    if isinstance(example.prompt, list):
        assistant += [m for m in example.prompt if isinstance(m, dict)]
    for message in assistant:
        if message.get("role") != "assistant":
            continue
        names |= {name for name, _ in message.get("calls") or ()}
        for call in message.get("tool_calls") or ():
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                names.add(function["name"].strip())
        if isinstance(message.get("content"), str):
            texts.append(message["content"])
    if example.response:
        texts.append(example.response)
    for text in texts:
        for tool_format in (HERMES, FORMATS["mistral"]):
            if tool_format.has_call_syntax(text):
                names |= {call.name for call in tool_format.parse(text).calls}
    return names


def defined_tools(example: Example) -> set[str]:
    """The names of the tools an example's definitions (`Example.tools`) describe."""
    names: set[str] = set()
    for tool in example.tools or ():
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            names.add(function["name"])
    return names


def warn_undefined_tools(examples: Sequence[object]) -> str | None:
    """The warning (also issued as an UndefinedToolsWarning; call it once per dataset) when
    rows call tools that no row defines: the model learns calls to a tool its prompts never
    describe. Names the first such row, counts the rows, lists the tools. None when every
    called tool is defined, or no row calls one."""
    rows = [ex for ex in examples if isinstance(ex, Example)]
    defined = set().union(*(defined_tools(ex) for ex in rows))
    calling = [(ex, called_tools(ex) - defined) for ex in rows]
    calling = [(ex, names) for ex, names in calling if names]
    if not calling:
        return None
    tools = sorted(set().union(*(names for _, names in calling)))
    message = (
        f"{calling[0][0].source}: {len(calling)} of {len(rows)} rows call a tool that no row "
        f"defines ({', '.join(tools)}): the model learns to call tools its prompts never "
        "describe; define them in data.tools or each row's data.columns.tools field"
    )
    warnings.warn(message, UndefinedToolsWarning, stacklevel=2)
    return message
