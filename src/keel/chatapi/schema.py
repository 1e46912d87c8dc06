"""The request bodies of the OpenAI-compatible endpoints, as pydantic models.

Unknown parameters are refused (400, naming the parameter), as OpenAI refuses them; parameters
OpenAI has and Keel does not implement are accepted only at their neutral value (penalties 0, no
logit bias, no echo). Numbers and booleans are strict, as OpenAI's are: `max_tokens: true`,
`n: "2"` or `max_tokens: 2.0` is a 400 naming the parameter (an integer is a number, so
`temperature: 1` stays valid). `seed` and `user` are accepted and ignored: rows of many
requests share one sampling pass, so a seed cannot make one request reproducible."""

from __future__ import annotations

import json
import sys
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from keel.chatapi.errors import APIError, bad_request
from keel.data.conversation import CallWriter, assistant_text, assistant_turn, hermes_calls

# `Any` in this module: JSON request bodies before pydantic checks them, and OpenAI's
# free-form JSON fields (tool parameters, response_format), a score row's answer.

M = TypeVar("M", bound=BaseModel)  # the request model a body is parsed into

MAX_STOP = 4  # OpenAI's limit on stop sequences


class Request(BaseModel):
    """What every generation request has."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str
    n: int = Field(default=1, ge=1, strict=True)
    temperature: float = Field(default=1.0, ge=0, le=2, strict=True)
    top_p: float = Field(default=1.0, gt=0, le=1, strict=True)
    stream: bool = Field(default=False, strict=True)
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, strict=True)
    frequency_penalty: float = Field(default=0.0, strict=True)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(default=None, strict=True)
    user: str | None = None

    @model_validator(mode="after")
    def _neutral(self) -> Request:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ValueError(f"{name} is not supported (only 0)")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise ValueError(f"stop: at most {MAX_STOP} sequences")
        if self.stop == "" or (isinstance(self.stop, list) and "" in self.stop):
            raise ValueError("stop: a stop sequence must not be empty")
        return self

    @property
    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(default=False, strict=True)


class CompletionRequest(Request):
    """POST /v1/completions."""

    prompt: str | list[str]
    max_tokens: int = Field(default=16, ge=1, strict=True)
    logprobs: int | None = Field(default=None, ge=0, le=5, strict=True)
    echo: bool = Field(default=False, strict=True)
    best_of: int | None = Field(default=None, strict=True)
    suffix: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo is not supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of = n)")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: the list is empty")
        return self

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class MessageToolCall(BaseModel):
    """One call of an assistant message's `tool_calls`, as the `openai` SDK sends it back."""

    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """A chat message; content as text or as a list of text parts. An assistant message may
    have `tool_calls` (and then a null content), a tool message answers one (`tool_call_id`)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # what the SDK echoes back of an answer; not rendered
    # More of an answer the SDK echoes back when its message object is passed on (as OpenAI's
    # own API returns it): accepted empty, not rendered.
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _shape(self) -> Message:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls: only an assistant message has tool calls (this "
                             f"one is {self.role!r})")  # fmt: skip
        if self.function_call is not None:
            raise ValueError("function_call: not supported (the deprecated form of a tool "
                             "call): send tool_calls")  # fmt: skip
        if self.audio is not None:
            raise ValueError("audio: not supported (text only)")
        if self.annotations and self.role != "assistant":
            raise ValueError("annotations: only an assistant message has annotations")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content: a {self.role} message needs a content (null only for "
                             "an assistant message with tool_calls)")  # fmt: skip
        return self

    @property
    def text(self) -> str:
        content = self.content
        if content is None:
            return ""
        return "".join(part.text for part in content) if isinstance(content, list) else content

    def as_template_message(self, write_calls: CallWriter = hermes_calls) -> dict[str, Any]:
        """The message the chat template renders: an assistant's tool calls written after its
        content in the model's tool-call format (`write_calls`, keel.data.conversation's
        `assistant_text`, as a training episode spells them); a tool message with its id."""
        if self.role == "assistant" and self.tool_calls:
            calls = [c.model_dump(exclude_none=True) for c in self.tool_calls]
            turn = assistant_turn({"role": "assistant", "content": self.text, "tool_calls": calls})
            return {"role": "assistant", "content": assistant_text(turn, write_calls)}
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.role == "tool" and self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.role == "tool" and self.name is not None:
            out["name"] = self.name
        return out


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = Field(default=None, strict=True)


class Tool(BaseModel):
    """One entry of `tools`: an OpenAI function schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: dict[str, Any]


class ChatCompletionRequest(Request):
    """POST /v1/chat/completions."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, strict=True)
    max_completion_tokens: int | None = Field(default=None, ge=1, strict=True)
    logprobs: bool = Field(default=False, strict=True)
    top_logprobs: int | None = Field(default=None, ge=0, le=20, strict=True)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(default=None, strict=True)
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.top_logprobs:
            raise ValueError("top_logprobs is not supported (only the sampled tokens' log-probs)")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise ValueError("response_format is not supported (only {'type': 'text'})")
        if self.tool_choice is not None and not self.tools:
            raise ValueError("tool_choice: only allowed when tools are given")
        if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required":
            raise ValueError(
                "tool_choice: 'required' and a named function are not supported (the model "
                "cannot be made to call a tool): use 'auto' or 'none'"
            )
        if self.parallel_tool_calls is False:
            raise ValueError("parallel_tool_calls: false is not supported (every call the "
                             "model writes is returned)")  # fmt: skip
        return self

    def token_budget(self, default: int) -> int:
        """max_completion_tokens, else max_tokens, else `default`."""
        return self.max_completion_tokens or self.max_tokens or default

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """`tools` as the chat template's `tools=` argument (OpenAI function schemas)."""
        if not self.tools:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    @property
    def parses_tool_calls(self) -> bool:
        """Whether answers are read for tool calls: tools given and tool_choice not 'none'."""
        return bool(self.tools) and self.tool_choice != "none"

    def chat_messages(self, write_calls: CallWriter = hermes_calls) -> list[dict[str, Any]]:
        """The messages the chat template renders (Message.as_template_message)."""
        return [m.as_template_message(write_calls) for m in self.messages]

    @property
    def template_messages(self) -> list[dict[str, Any]]:
        return self.chat_messages()


class ScoreItem(BaseModel):
    """One row to score (the protocol of keel.rewards.remote)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | list[Message]
    response: str
    answer: Any = None

    @property
    def template_prompt(self) -> str | list[dict[str, Any]]:
        if isinstance(self.prompt, str):
            return self.prompt
        return [m.as_template_message() for m in self.prompt]


class ScoreRequest(BaseModel):
    """POST /v1/score: `{"items": [{"prompt", "response", "answer"}], "kwargs": {}}`, what
    `reward.url` sends; `model`, when given, must be the served model's id."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    items: list[ScoreItem]
    kwargs: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None


def parse_body(body: bytes, model: type[M]) -> M:
    """The request `model` from a JSON body; malformed JSON, JSON past the parser's limits (an
    integer longer than Python's int-string limit, nesting deeper than its recursion limit)
    and invalid parameters are 400s naming the problem (and the parameter)."""
    try:
        data = json.loads(body, parse_int=_json_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(
            400, f"the request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    except RecursionError:
        raise _too_deep() from None
    except ValueError as exc:  # any other refusal of the parser is the body's too
        raise APIError(
            400, f"the request body cannot be parsed as JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return validate(data, model)


def _json_int(text: str) -> int:
    """A JSON integer; one past Python's int-string limit (sys.get_int_max_str_digits, 4300
    digits by default: int() raises ValueError past it) is a 400."""
    limit = sys.get_int_max_str_digits()
    digits = len(text) - text.startswith("-")
    if limit and digits > limit:
        raise APIError(
            400, f"the request body has an integer of {digits} digits; this server parses "
            f"integers of at most {limit} digits", code="invalid_json",
        )  # fmt: skip
    return int(text)


def _too_deep() -> APIError:
    return APIError(
        400, "the request body is nested too deeply to parse (arrays and objects inside one "
        "another, past the JSON parser's recursion limit)", code="invalid_json",
    )  # fmt: skip


def validate(data: dict[str, Any], model: type[M]) -> M:
    """The request `model` from a decoded body (JSON, or a gRPC message as a dict); invalid
    parameters are 400s naming the problem and the parameter."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc) from None
    except RecursionError:
        raise _too_deep() from None


def _invalid(exc: ValidationError) -> APIError:
    """The first problem of `exc` as a 400: the parameter in plain words (`messages[1].content`,
    never pydantic's `messages.1.content.str`); the alternatives of a union said together."""
    errors = exc.errors()
    err = errors[0]
    param = plain_path(err["loc"]) or None
    if err["type"] == "extra_forbidden":  # the unknown key itself, whatever its name
        param = plain_path(err["loc"][:-1])
        param = f"{param}.{err['loc'][-1]}" if param else str(err["loc"][-1])
        return bad_request(f"unrecognized request argument: {param}", code="unknown_parameter",
                           param=param)  # fmt: skip
    if err["type"] == "missing":
        return bad_request(f"missing required parameter: {param}", code="missing_parameter",
                           param=param)  # fmt: skip
    same = [e for e in errors if plain_path(e["loc"]) == plain_path(err["loc"])]
    msgs = list(dict.fromkeys(e["msg"].removeprefix("Value error, ") for e in same))
    msg = " or ".join(m[:1].lower() + m[1:] if i else m for i, m in enumerate(msgs))
    where = f"{param}: " if param else ""
    if err["type"] == "value_error":  # a validator's message may start with its field's name
        field, sep, rest = msg.partition(": ")
        if sep and field in _FIELD_NAMES:
            param = f"{param}.{field}" if param else field
            msg = rest
        elif not param:
            where = ""
        where = f"{param}: " if param else ""
    code = "unsupported_parameter" if "not supported" in msg else "invalid_value"
    return bad_request(f"{where}{msg}", code=code, param=param)


def plain_path(loc: tuple[Any, ...]) -> str:
    """A pydantic error location in plain words: field names joined by dots, list indexes in
    brackets, the names pydantic gives union alternatives (`str`, `list[TextPart]`,
    `function-after[...]`) left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _FIELD_NAMES:
            out += f".{part}" if out else part
    return out


Request.model_rebuild()
CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
ScoreRequest.model_rebuild()


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    names: set[str] = set()
    for model in models:
        names |= set(model.model_fields)
    return frozenset(names)


_FIELD_NAMES = _field_names(
    CompletionRequest, ChatCompletionRequest, StreamOptions, TextPart, Message, MessageToolCall,
    FunctionCall, Tool, FunctionDefinition, NamedToolChoice, ScoreItem, ScoreRequest,
)  # fmt: skip
