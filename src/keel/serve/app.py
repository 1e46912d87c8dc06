"""The ASGI app of `keel serve` (FastAPI): OpenAI's /v1/completions, /v1/chat/completions and
/v1/models over one `ServedPolicy` (and /v1/prompt_logprobs, keel.serve.prompt_logprobs), or
/v1/score and /v1/models over one `ServedReward` (`--reward`), and /healthz, /readyz, /metrics.

Every refusal is an OpenAI-shaped JSON error (keel.chatapi.errors) with a 4xx status, counted by
kind; a failed generation is a 500 and the server keeps serving. A client that hangs up before
its whole body came is counted as status 499, kind `client_disconnected`, never as an internal
error."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from keel.chatapi.chat_tools import chat_prompt, with_tool_calls
from keel.chatapi.errors import APIError
from keel.chatapi.responses import (
    DONE,
    Reply,
    StreamChunks,
    chat_body,
    chat_chunks,
    completion_body,
    completion_chunks,
)
from keel.chatapi.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    ScoreRequest,
    parse_body,
)
from keel.chatapi.schema import (
    Request as APIRequest,
)
from keel.serve.config import ServeConfig
from keel.serve.continuous import Delta
from keel.serve.handling import Plan, answers, authorize, check_model, plan_generation
from keel.serve.policy import Prompt, ServedPolicy
from keel.serve.prompt_logprobs import parse_request, prompt_logprobs
from keel.serve.scoring import ServedReward, check_score_model
from keel.serve.served import Served

log = logging.getLogger(__name__)
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/score")  # in flight
KNOWN_PATHS = (*GENERATION_PATHS, "/v1/prompt_logprobs", "/v1/models", "/healthz", "/readyz",
               "/metrics")  # fmt: skip
CLIENT_GONE = 499  # the status recorded for a request whose client hung up mid-body


def build_app(served: Served, cfg: ServeConfig) -> FastAPI:
    """The app; its lifespan's end drains the batching queue and releases the engine."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        served.close(timeout=cfg.drain_timeout_s)

    app = FastAPI(
        title="keel serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.add_middleware(RequestMetrics, served=served)
    _error_handlers(app, served)
    token = cfg.bearer_token()

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        status = "ready" if served.ready else "draining" if served.draining else "not ready"
        body = {"status": status, "model": served.name, "step": served.step}
        return _json(body, 200 if served.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text, content_type = served.metrics.exposition()
        return Response(text, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        """One entry per id the model answers to: its name first, then its versioned model
        id (a checkpoint's or an export's), both the same weights."""
        authorize(request.headers.get("authorization"), token)
        cards = [_model_card(served, name) for name in served.names()]
        return _json({"object": "list", "data": cards})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        authorize(request.headers.get("authorization"), token)
        check_model(served, model_id, param=None)
        return _json(_model_card(served, model_id))

    # by its kind, as each served model declares it (`Served.kind`); the casts name the class
    # that kind belongs to
    if served.kind == "reward":
        _score_route(app, cast(ServedReward, served), cfg, token)
    else:
        _generation_routes(app, cast(ServedPolicy, served), cfg, token)
    return app


def _generation_routes(app: FastAPI, policy: ServedPolicy, cfg: ServeConfig, token: str | None):
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request.headers.get("authorization"), token)
        req: CompletionRequest = parse_body(await _body(request, cfg), CompletionRequest)
        check_model(policy, req.model)
        prompts: list[Prompt] = list(req.prompts)
        logprobs = req.logprobs is not None
        return await _generate(policy, cfg, COMPLETIONS, req, prompts, req.max_tokens, logprobs)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        authorize(request.headers.get("authorization"), token)
        req: ChatCompletionRequest = parse_body(await _body(request, cfg), ChatCompletionRequest)
        check_model(policy, req.model)
        prompts: list[Prompt] = [chat_prompt(req, policy.chat_tools, policy.tokenizer)]
        budget = req.token_budget(cfg.max_new_tokens)
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        return await _generate(policy, cfg, CHAT, req, prompts, budget, req.logprobs, param,
                               tools=req.tool_schemas,
                               read_calls=req.parses_tool_calls)  # fmt: skip

    @app.post("/v1/prompt_logprobs")
    async def prompt_logprobs_route(request: Request) -> Response:
        """Every given token's log-prob given the tokens before it (a distillation teacher's
        scores; keel.serve.prompt_logprobs)."""
        authorize(request.headers.get("authorization"), token)
        req = parse_request(await _body(request, cfg))
        check_score_model(policy, req.model)  # optional, as a score request's
        return _json(await prompt_logprobs(policy, req))


def _score_route(app: FastAPI, reward: ServedReward, cfg: ServeConfig, token: str | None):
    @app.post("/v1/score")
    async def score(request: Request) -> Response:
        """The protocol of reward.url: {"items": [...], "kwargs": {...}} → {"scores": [...]}."""
        authorize(request.headers.get("authorization"), token)
        req: ScoreRequest = parse_body(await _body(request, cfg), ScoreRequest)
        check_score_model(reward, req.model)
        rows = reward.rows(req)
        scores = await reward.result(reward.submit(rows))
        reward.count(rows)
        return _json({"scores": scores})


@dataclass(frozen=True)
class Endpoint:
    """How a generation endpoint answers: its response id prefix, JSON body and SSE chunks, and
    the name of its prompt parameter (for errors)."""

    id_prefix: str
    body: Callable[..., dict[str, Any]]
    chunks: Callable[..., Iterable[bytes]]
    prompt_param: str


COMPLETIONS = Endpoint("cmpl", completion_body, completion_chunks, "prompt")
CHAT = Endpoint("chatcmpl", chat_body, chat_chunks, "messages")


async def _generate(
    policy: ServedPolicy,
    cfg: ServeConfig,
    endpoint: Endpoint,
    req: APIRequest,
    prompts: list[Prompt],
    max_tokens: int,
    logprobs: bool,
    budget_param: str = "max_tokens",
    tools: list[dict[str, Any]] | None = None,
    read_calls: bool = False,
) -> Response:
    """Check the limits, generate n answers per prompt (chat: rendered with `tools`, and with
    `read_calls` their tool calls parsed), answer as JSON or as an SSE stream."""
    plan = plan_generation(
        policy, cfg, req, prompts, max_tokens, logprobs or req.stream,
        prompt_param=endpoint.prompt_param, budget_param=budget_param, tools=tools,
    )  # fmt: skip
    if req.stream and policy.streams and not read_calls:
        return await _stream(policy, endpoint, req, plan, logprobs)
    gens = await policy.generate(plan.prompts, plan.n, plan.sampling, plan.tools, plan.stops)
    answered = answers(policy, plan, gens)
    if read_calls:
        answered = [with_tool_calls(a, policy.chat_tools.format) for a in answered]
    reply = Reply.new(endpoint.id_prefix, policy.name, gens[0].step if gens else policy.step)
    if req.stream:
        events = endpoint.chunks(reply, answered, plan.prompt_tokens, req.include_usage)
        return StreamingResponse(_iterate(events), media_type="text/event-stream")
    return _json(endpoint.body(reply, answered, plan.prompt_tokens, logprobs))


async def _stream(
    policy: ServedPolicy, endpoint: Endpoint, req: APIRequest, plan: Plan, logprobs: bool
) -> Response:
    """A stream of the tokens as they are decoded: the scheduler thread hands each row's new
    text (`Delta`) to this request's event loop (`Feed`), which sends what came since it last
    looked as OpenAI's chunks, in one write. The response starts with the first delta, so a
    generation that fails before it is a 500."""
    feed = Feed(asyncio.get_running_loop())
    future = policy.submit(plan.prompts, plan.n, plan.sampling, plan.tools, plan.stops, feed.put)
    future.add_done_callback(lambda _: feed.put(None))
    try:
        first = await feed.take()
        if first[0] is None:  # it ended before any text: it failed
            await policy.result(future)
    except BaseException:
        future.cancel()  # the client is gone: its rows leave the decoder
        raise
    reply = Reply.new(endpoint.id_prefix, policy.name, policy.step)  # the rows run on these
    chunks = StreamChunks(reply, endpoint is CHAT, plan.n * len(plan.prompts), logprobs)

    async def body() -> AsyncIterator[bytes]:
        try:
            events = list(chunks.start())
            deltas = first
            while True:
                for delta in deltas:
                    if delta is not None:
                        events.extend(chunks.delta(delta))
                if events:
                    yield b"".join(events)
                    events = []
                if deltas and deltas[-1] is None:
                    break
                deltas = await feed.take()
            answered = answers(policy, plan, await policy.result(future))
            tail = [chunks.usage(plan.prompt_tokens, answered)] if req.include_usage else []
            yield b"".join([*tail, DONE])
        finally:
            future.cancel()  # a no-op once it is done; else the client left mid-stream

    return StreamingResponse(body(), media_type="text/event-stream")


class Feed:
    """Deltas from the scheduler thread to one stream on the event loop: `put` from any thread
    (it wakes the loop once for however many deltas arrive before the loop looks), `take` on
    the loop: every delta that came, in order (None: the job ended, always last)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque[Delta | None] = deque()
        self.ready = asyncio.Event()
        self.waking = False

    def put(self, item: Delta | None) -> None:
        self.items.append(item)
        if not self.waking:
            self.waking = True
            self.loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self.waking = False
        self.ready.set()

    async def take(self) -> list[Delta | None]:
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        out = []
        while self.items:
            out.append(self.items.popleft())
        return out


async def _iterate(events: Iterable[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


def _model_card(served: Served, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(served.loaded_at),
        "owned_by": "keel",
        "root": str(Path(served.source.folder).resolve()),
        "step": served.step,
        "model_id": served.model_id,
        "kind": served.kind,
    }


async def _body(request: Request, cfg: ServeConfig) -> bytes:
    """The request body, refused (413) as soon as it passes serve.max_body_bytes."""
    limit = cfg.max_body_bytes
    declared = request.headers.get("content-length")
    too_large = APIError(
        413, f"the request body is larger than this server allows ({limit} bytes, "
        "serve.max_body_bytes)", code="request_too_large",
    )  # fmt: skip
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _json(body: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    text = json.dumps(body, separators=(",", ":"))
    return Response(text, status_code=status, media_type="application/json", headers=headers)


def _error_handlers(app: FastAPI, served: Served) -> None:
    """APIErrors, unknown routes and unexpected exceptions, all in OpenAI's error shape."""

    def respond(err: APIError) -> Response:
        served.metrics.error(err.code)
        return _json(err.body(), err.status, err.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return respond(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return respond(APIError(exc.status_code, msg, code=code))

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # The client hung up before its whole body came (a Content-Length it never sent): its
        # doing, not the server's. No traceback; 499 (nginx's "client closed request"), which
        # nobody receives, is what the request and error counters record.
        log.info("the client of %s %s hung up before its whole request came",
                 request.method, request.url.path)  # fmt: skip
        return respond(APIError(CLIENT_GONE, "the client closed the connection before its "
                                "whole request came", code="client_disconnected"))  # fmt: skip

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Response:
        log.exception("internal error answering %s", request.url.path)
        return respond(APIError(500, f"internal error: {exc}", code="internal_error"))


class RequestMetrics:
    """ASGI middleware: latency until the last byte and the status of every request, by
    endpoint; generation and score requests in flight."""

    def __init__(self, app: ASGIApp, served: Served):
        self.app = app
        self.metrics = served.metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in KNOWN_PATHS else "other"
        generation = path in GENERATION_PATHS
        status = 500
        start = time.perf_counter()

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        if generation:
            self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_and_note)
        finally:
            if generation:
                self.metrics.in_flight.dec()
            self.metrics.answered(endpoint, str(status), time.perf_counter() - start)
