"""The training-time gateway: an OpenAI-compatible chat-completions endpoint on 127.0.0.1, backed
by the rollout engine with the current weights, that records every session's tokens.

A user's agent (`rollout.env.name: agent`, keel.envs.agents) talks to it through the official
`openai` client; its API key is the episode's session id. The gateway answers with keel serve's
own code (keel.chatapi: the request models and their checks, the tool-call formats, the answer
bodies and stream chunks) and keeps, per session, exactly the token ids the engine consumed and
produced, their log-probs and a loss mask: the episode's training row, in the layout of the
in-process EpisodeRunner (keel.envs.episodes):

- the first request's messages are rendered through the chat template (with its `tools` when
  the template renders tools, as the runner gives an environment's tools) into the prompt; with
  `chat` off (data.apply_chat_template: false) a lone user message is the prompt as written,
  as a text example's prompt is;
- every answer's tokens, the closing EOS included, are appended with mask 1 and their log-probs;
- a later request must continue the session's conversation: its first messages are the ones the
  session knows (the earlier requests' and the gateway's answers), and only the messages after
  them (the tail: tool results, the user's next message) are appended, rendered as the runner
  renders an environment's observation messages (keel.data.conversation.ObservationEncoder),
  with mask 0. The session's tokens are the truth: when the request's copy of an earlier
  message differs from what the session holds (an agent that edits an answer, a framework that
  rebuilds a tool call), the sampled tokens are kept and the request counts one
  `retokenize_mismatch`; nothing is ever re-tokenised into the row.

Requests are batched by turn (`TurnBatcher`): the gateway's batcher, on the rollout worker's
thread, makes one `engine.generate_ids` call over the waiting requests of every running
episode once each of them is waiting for an answer or has ended (or `wait_s` after the first
one waited), rows in episode order, so the calls and their random draws do not depend on
thread timing and a run is reproducible from its seed.

The server is the standard library's threaded HTTP server (one thread per connection: each
agent thread blocks on its own request), started for one `generate` call and stopped after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from keel.chatapi.chat_tools import ChatTools, check_tool_results, with_tool_calls
from keel.chatapi.errors import APIError, bad_request
from keel.chatapi.responses import Generation, Reply, answer, chat_body, chat_chunks
from keel.chatapi.schema import ChatCompletionRequest, Message, parse_body
from keel.data.conversation import ObservationEncoder
from keel.data.encoding import encode_prompt_text, render_prompt
from keel.rollout.protocol import Completions, RolloutEngine, SamplingParams

# `Any` in this module: JSON bodies of the OpenAI API an agent sends, before they are checked.

MODEL_NAME = "keel-policy"  # what GET /v1/models lists; requests may name any model
MAX_BODY_BYTES = 8 << 20
# The batcher answers the requests that wait once every running episode waits, or this long
# after the first one waited (one slow agent does not hold the others forever).
WAIT_S = 30.0


class EpisodeOver(APIError):
    """A request past the episode's limits (rollout.env.max_turns, max_episode_tokens): the
    episode has ended; the agent's exception after it is not a failure."""

    def __init__(self, why: str, message: str):
        super().__init__(400, message, code="episode_over")
        self.why = why


@dataclass
class Turn:
    """What the session knows of one message: its role, its text as the request gave it (for a
    non-assistant message) or, for the gateway's answers, the content and the calls returned."""

    role: str
    text: str
    calls: list[tuple[str, Any]] = field(default_factory=list)


@dataclass
class Session:
    """One episode's record (the response columns so far, as in keel.envs.episodes.Episode) and
    its counters. `served`: (the ids the engine consumed, the ids it produced) per answer."""

    index: int
    key: str
    prompt_ids: list[int] | None = None
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    known: list[Turn] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    served: list[tuple[list[int], list[int]]] = field(default_factory=list)
    turns: int = 0
    requests: int = 0
    mismatches: int = 0
    tool_calls: int = 0
    last_text: str = ""
    last_finish: str = "stop"
    ended: str | None = None  # "max_turns" | "budget": the gateway refused a request past them
    lock: threading.Lock = field(default_factory=threading.Lock)


class TurnBatcher:
    """Requests of running episodes, answered in batched engine calls on the thread that runs
    `run` (the rollout worker's): one call once every running episode waits for an answer (or
    `wait_s` after the first one waited), its rows in episode order."""

    def __init__(self, engine: RolloutEngine, sampling: SamplingParams, wait_s: float):
        self.engine = engine
        self.sampling = sampling
        self.wait_s = wait_s
        self.cond = threading.Condition()
        self.pending: dict[int, tuple[list[int], int, Future[Completions]]] = {}
        self.running: set[int] = set()
        self.first_wait: float | None = None
        self.keys: dict[int, str] = {}  # each episode's current session key (its attempt's)
        self.calls = 0
        self.logprobs = False  # the engine returned log-probs (for every row, or for none)
        self.error: BaseException | None = None

    def start(self, keys: list[str]) -> None:
        with self.cond:
            self.running = set(range(len(keys)))
            self.keys = dict(enumerate(keys))

    def submit(
        self, index: int, prompt_ids: list[int], budget: int, key: str | None = None
    ) -> Future[Completions]:
        """The answer to episode `index`'s request; refused (an error as its result) when `key`
        is not the episode's current session (an attempt given up on, still asking)."""
        future: Future[Completions] = Future()
        with self.cond:
            if key is not None and self.keys.get(index) != key:
                future.set_exception(_abandoned())
                return future
            self.pending[index] = (prompt_ids, budget, future)
            if self.first_wait is None:
                self.first_wait = time.monotonic()
            self.cond.notify_all()
        return future

    def retire(self, index: int, key: str) -> None:
        """Episode `index` starts another attempt with session `key`: a request of the attempt
        given up on that still waits is answered with an error, and a later one refused."""
        with self.cond:
            self.keys[index] = key
            waiting = self.pending.pop(index, None)
            if not self.pending:
                self.first_wait = None
            self.cond.notify_all()
        if waiting is not None:
            waiting[2].set_exception(_abandoned())

    def finish(self, index: int) -> None:
        """Episode `index` will send no more requests (its agent returned or raised)."""
        with self.cond:
            self.running.discard(index)
            self.cond.notify_all()

    def run(self) -> None:
        """Answer requests until every episode has finished."""
        while True:
            with self.cond:
                while True:
                    if not self.running and not self.pending:
                        return
                    if self.pending and self._due():
                        break
                    timeout = None
                    if self.first_wait is not None:
                        timeout = max(0.0, self.first_wait + self.wait_s - time.monotonic())
                    self.cond.wait(timeout)
                taken = sorted(self.pending.items())
                self.pending.clear()
                self.first_wait = None
            self._answer(taken)

    def _due(self) -> bool:
        waiting = all(i in self.pending for i in self.running)
        late = self.first_wait is not None and time.monotonic() - self.first_wait >= self.wait_s
        return waiting or late

    def _answer(self, taken: list[tuple[int, tuple[list[int], int, Future[Completions]]]]):
        rows = [ids for _, (ids, _, _) in taken]
        budget = max(b for _, (_, b, _) in taken)
        sampling = dataclasses.replace(self.sampling, n=1, max_new_tokens=budget)
        try:
            out = self.engine.generate_ids(rows, sampling)
        except BaseException as exc:
            self.error = exc
            for _, (_, _, future) in taken:
                future.set_exception(exc)
            return
        self.calls += 1
        self.logprobs = out.logprobs is not None
        for j, (_, (_, _, future)) in enumerate(taken):
            logprobs = None if out.logprobs is None else [out.logprobs[j]]
            future.set_result(Completions([out.token_ids[j]], logprobs, [out.finish_reasons[j]]))


class Gateway:
    """The endpoint and its sessions for one `generate` call of keel.envs.agents.AgentRunner.

    `open(count)` makes the sessions (their keys are the agents' API keys), `serve()` starts the
    HTTP server (`base_url`), `batcher.run()` answers until every episode finished, `close()`
    stops the server. max_turns / max_episode_tokens / max_prompt_length: the episode limits
    of rollout.env and data."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        sampling: SamplingParams,
        *,
        eos_ids: list[int],
        max_turns: int,
        max_episode_tokens: int | None,
        max_prompt_length: int | None,
        tool_format: str = "auto",
        wait_s: float = WAIT_S,
        chat: bool = True,
    ):
        self.tokenizer = tokenizer
        self.chat_prompt = chat  # off: a lone user message is a text prompt
        self.sampling = sampling
        self.eos_ids = list(eos_ids)
        self.max_turns = max_turns
        self.max_episode_tokens = max_episode_tokens
        self.max_prompt_length = max_prompt_length
        self.tools = ChatTools.of(tokenizer, tool_format)
        self.observations = ObservationEncoder(tokenizer, self.eos_ids)
        self.batcher = TurnBatcher(engine, sampling, wait_s)
        self.sessions: dict[str, Session] = {}
        self.server: GatewayServer | None = None
        self.thread: threading.Thread | None = None

    # -- sessions --------------------------------------------------------------------------

    def open(self, count: int) -> list[Session]:
        sessions = [Session(i, _new_key()) for i in range(count)]
        self.sessions = {s.key: s for s in sessions}
        self.batcher.start([s.key for s in sessions])
        return sessions

    def reopen(self, old: Session) -> Session:
        """A fresh session for the next attempt of `old`'s episode (a retry, keel.envs.agents):
        nothing of `old` is kept, its key is refused from now on (401), and a request of it
        that still waits for an answer gets an error."""
        fresh = Session(old.index, _new_key())
        self.sessions[fresh.key] = fresh
        self.sessions.pop(old.key, None)
        self.batcher.retire(old.index, fresh.key)
        return fresh

    def session(self, header: str | None) -> Session:
        """The session whose key the request's bearer token is (401 otherwise)."""
        if not header:
            raise APIError(401, "missing API key: the gateway's API key is the episode's "
                           "session id", code="missing_api_key")  # fmt: skip
        scheme, _, key = header.partition(" ")
        found = self.sessions.get(key.strip()) if scheme.lower() == "bearer" else None
        if found is None:
            raise APIError(401, "unknown API key: not a session of this step (each episode's "
                           "client carries its own)", code="invalid_api_key")  # fmt: skip
        return found

    # -- a request -------------------------------------------------------------------------

    def chat(self, session: Session, body: bytes) -> tuple[ChatCompletionRequest, list, int]:
        """Answer one chat request of `session`: (the request, its answers, prompt tokens)."""
        req: ChatCompletionRequest = parse_body(body, ChatCompletionRequest)
        if req.n != 1:
            raise bad_request("n: the gateway answers one choice per request (n = 1): an "
                              "episode is one conversation", param="n")  # fmt: skip
        if req.stops:
            raise bad_request("stop: not supported by the training gateway (the policy's "
                              "tokens are kept as sampled)", code="unsupported_parameter",
                              param="stop")  # fmt: skip
        if req.messages[-1].role == "assistant":
            raise bad_request("messages: the last message is an assistant message (a prefill "
                              "is not supported: the policy writes its own turns)",
                              param="messages")  # fmt: skip
        if not session.lock.acquire(blocking=False):
            raise APIError(409, "the session has a request in flight: an episode's requests "
                           "come one at a time", code="concurrent_request")  # fmt: skip
        try:
            answers, prompt_tokens = self._chat(session, req)
            return req, answers, prompt_tokens
        finally:
            session.lock.release()

    def _chat(self, s: Session, req: ChatCompletionRequest) -> tuple[list, int]:
        """The answer to one request and the tokens of its context (usage.prompt_tokens)."""
        s.requests += 1
        if s.ended is not None:
            raise EpisodeOver(s.ended, f"the episode is over ({s.ended})")
        if s.turns >= self.max_turns:
            s.ended = "max_turns"
            raise EpisodeOver("max_turns", f"the episode is over: its {self.max_turns} turns "
                              "(rollout.env.max_turns) are used")  # fmt: skip
        if s.prompt_ids is None:
            self._open_conversation(s, req)
        else:
            self._continue_conversation(s, req)
        budget = min(req.token_budget(self.sampling.max_new_tokens), self.sampling.max_new_tokens)
        budget = min(budget, self._room(s))
        context = self._context(s)
        done = self.batcher.submit(s.index, context, budget, s.key).result()
        tokens = done.token_ids[0][:budget]
        finish = done.finish_reasons[0] if len(tokens) == len(done.token_ids[0]) else "length"
        logprobs = done.logprobs[0][: len(tokens)] if done.logprobs is not None else None
        s.served.append((context, list(tokens)))
        s.tokens += tokens
        s.mask += [1] * len(tokens)
        s.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        s.turns += 1
        s.last_finish = finish
        visible = (
            tokens[:-1] if finish == "stop" and tokens and tokens[-1] in self.eos_ids else tokens
        )
        text = self.tokenizer.decode(visible, skip_special_tokens=True)
        s.last_text = text
        s.messages.append({"role": "assistant", "content": text})
        gen = Generation(
            token_ids=list(visible),
            text=text,
            logprobs=None if logprobs is None else logprobs[: len(visible)],
            tokens=len(tokens),
            finish_reason=finish,
            step=None,
        )
        answered = answer(gen, [], self.tokenizer, per_token=req.logprobs or req.stream)
        if req.parses_tool_calls:
            answered = with_tool_calls(answered, self.tools.format)
        calls = [_call(c) for c in answered.tool_calls or []]
        s.tool_calls += len(calls)
        s.known.append(Turn("assistant", answered.text, calls))
        return [answered], len(context)

    def _open_conversation(self, s: Session, req: ChatCompletionRequest) -> None:
        messages = self._template_messages(req)
        tools = req.tool_schemas if self.tools.renders_tools else None
        if any(m["role"] == "tool" for m in messages):
            check_tool_results(self.tokenizer, messages, tools)
        if not self.chat_prompt and [m["role"] for m in messages] == ["user"]:
            text = messages[0]["content"]  # a text prompt, as written (apply_chat_template off)
        else:
            text = render_prompt(self.tokenizer, messages, chat=True, tools=tools)
        ids = encode_prompt_text(self.tokenizer, text)
        if not ids:
            raise bad_request("the messages render an empty prompt", param="messages")
        if self.max_prompt_length is not None and len(ids) > self.max_prompt_length:
            raise bad_request(
                f"the messages are {len(ids)} tokens, more than data.max_prompt_length "
                f"({self.max_prompt_length})", code="context_length_exceeded", param="messages",
            )  # fmt: skip
        s.prompt_ids = ids
        s.known = [_turn(m) for m in req.messages]
        s.messages = [dict(m) for m in messages]

    def _continue_conversation(self, s: Session, req: ChatCompletionRequest) -> None:
        """Match the request's messages against the session's; append the tail's tokens."""
        given = req.messages
        if len(given) <= len(s.known):
            raise self._forked(s, len(given), "it has no message after the session's "
                               f"{len(s.known)}")  # fmt: skip
        mismatch = False
        for i, (held, sent) in enumerate(zip(s.known, given, strict=False)):
            if held.role != sent.role:
                raise self._forked(s, i, f"its role is {sent.role!r}, the session's "
                                   f"{held.role!r}")  # fmt: skip
            mismatch |= _turn(sent) != held
        if mismatch:
            s.mismatches += 1
        tail = self._template_messages(req)[len(s.known) :]
        try:
            ids = self.observations.encode(tail, s.last_finish == "stop")
        except ValueError as exc:  # a template that renders no message of a role in the tail
            raise bad_request(f"messages: {exc}", param="messages") from None
        if len(ids) >= self._room(s):  # no room left for a turn after it
            s.ended = "budget"
            raise EpisodeOver("budget", "the episode is over: no room for another turn "
                              "(rollout.env.max_episode_tokens)")  # fmt: skip
        s.tokens += ids
        s.mask += [0] * len(ids)
        s.logprobs += [0.0] * len(ids)
        s.known += [_turn(m) for m in given[len(s.known) :]]
        s.messages += [dict(m) for m in tail]

    def _forked(self, s: Session, index: int, why: str) -> APIError:
        return bad_request(
            f"messages[{index}]: the request does not continue the episode's conversation "
            f"({why}); a session is one conversation that grows: send the earlier messages, "
            "the answers included, then the new ones", code="conversation_forked",
            param=f"messages[{index}]",
        )  # fmt: skip

    def _template_messages(self, req: ChatCompletionRequest) -> list[dict[str, Any]]:
        out = []
        for i, message in enumerate(req.messages):
            try:
                out.append(message.as_template_message(self.tools.write_calls))
            except ValueError as exc:
                where = f"messages[{i}].tool_calls"
                raise bad_request(f"{where}: {exc}", param=where) from None
        return out

    def _context(self, s: Session) -> list[int]:
        return (s.prompt_ids or []) + s.tokens

    def _room(self, s: Session) -> int:
        if self.max_episode_tokens is None:
            return 1 << 30
        return self.max_episode_tokens - len(s.tokens)

    # -- the server ------------------------------------------------------------------------

    def serve(self) -> str:
        """Start the HTTP server on a free port of 127.0.0.1; returns the base URL (…/v1)."""
        gateway = self

        class Handler(GatewayHandler):
            pass

        Handler.gateway = gateway
        self.server = GatewayServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="keel-gateway", daemon=True
        )
        self.thread.start()
        return self.base_url

    @property
    def base_url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None


class GatewayServer(ThreadingHTTPServer):
    """A thread per connection; a listen backlog for every episode of a step connecting at once
    (socketserver's default of 5 resets connections past the fifth)."""

    daemon_threads = True
    request_queue_size = 1024


class GatewayHandler(BaseHTTPRequestHandler):
    """POST /v1/chat/completions and GET /v1/models; everything else a 404 in OpenAI's shape."""

    gateway: Gateway
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: no line per request
        pass

    def do_GET(self) -> None:
        if self.path.rstrip("/") != "/v1/models":
            self._error(APIError(404, f"GET {self.path}: not found", code="not_found"))
            return
        card = {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "keel"}
        self._json(200, {"object": "list", "data": [card]})

    def do_POST(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if 0 < length <= MAX_BODY_BYTES else b""
        if self.path.rstrip("/") != "/v1/chat/completions":
            self._error(APIError(404, f"POST {self.path}: not found (the training gateway "
                                 "answers /v1/chat/completions)", code="not_found"))  # fmt: skip
            return
        if length > MAX_BODY_BYTES:
            self._error(APIError(413, "the request body is too large", code="request_too_large"))
            self.close_connection = True
            return
        try:
            session = self.gateway.session(self.headers.get("authorization"))
            req, answers, prompt_tokens = self.gateway.chat(session, body)
        except APIError as exc:
            self._error(exc)
            return
        except Exception as exc:  # the engine failed: the batcher keeps the error for generate
            self._error(APIError(500, f"generation failed: {exc}", code="generation_failed"))
            return
        reply = Reply.new("chatcmpl", req.model, None)
        if req.stream:
            events = chat_chunks(reply, answers, prompt_tokens, req.include_usage)
            self._stream(b"".join(events))
        else:
            self._json(200, chat_body(reply, answers, prompt_tokens, req.logprobs))

    def _error(self, exc: APIError) -> None:
        self._json(exc.status, exc.body())

    def _json(self, status: int, body: Any) -> None:
        data = json.dumps(body, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, events: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(events)))
        self.end_headers()
        self.wfile.write(events)


def _new_key() -> str:
    return f"keel-session-{uuid.uuid4().hex}"


def _abandoned() -> APIError:
    return APIError(409, "this attempt at the episode was given up on (it failed or ran past "
                    "rollout.env.timeout_s) and another started with a fresh session",
                    code="attempt_abandoned")  # fmt: skip


def _turn(message: Message) -> Turn:
    """What the session compares of a request's message: role, text, calls (name, arguments
    decoded: a framework that re-serialises the same arguments sends the same call)."""
    calls = []
    for c in message.tool_calls or []:
        arguments = c.function.arguments
        if isinstance(arguments, str):
            with contextlib.suppress(json.JSONDecodeError):
                arguments = json.loads(arguments)
        calls.append((c.function.name, arguments))
    return Turn(message.role, message.text, calls)


def _call(call: dict[str, Any]) -> tuple[str, Any]:
    """(name, arguments) of one of the gateway's OpenAI tool calls."""
    function = call["function"]
    return function["name"], json.loads(function["arguments"])
