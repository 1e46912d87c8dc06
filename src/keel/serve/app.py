"""The ASGI app of `keel serve` (FastAPI): OpenAI's /v1/completions, /v1/chat/completions and
/v1/models over one `ServedPolicy`, and /healthz, /readyz, /metrics.

Every refusal is an OpenAI-shaped JSON error (keel.serve.errors) with a 4xx status, counted by
kind; a failed generation is a 500 and the server keeps serving."""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from keel.rollout.protocol import SamplingParams
from keel.serve.config import ServeConfig
from keel.serve.errors import APIError, bad_request
from keel.serve.policy import Prompt, ServedPolicy
from keel.serve.responses import (
    Reply,
    answer,
    chat_body,
    chat_chunks,
    completion_body,
    completion_chunks,
)
from keel.serve.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
)
from keel.serve.schema import (
    Request as APIRequest,
)

log = logging.getLogger(__name__)
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
KNOWN_PATHS = (*GENERATION_PATHS, "/v1/models", "/healthz", "/readyz", "/metrics")


def build_app(policy: ServedPolicy, cfg: ServeConfig) -> FastAPI:
    """The app; its lifespan's end drains the batching queue and releases the engine."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        policy.close(timeout=cfg.drain_timeout_s)

    app = FastAPI(
        title="keel serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.add_middleware(RequestMetrics, policy=policy)
    _error_handlers(app, policy)
    token = cfg.bearer_token()

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz() -> Response:
        status = "ready" if policy.ready else "draining" if policy.draining else "not ready"
        body = {"status": status, "model": policy.name, "step": policy.step}
        return _json(body, 200 if policy.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text, content_type = policy.metrics.exposition()
        return Response(text, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        _authorize(request, token)
        return _json({"object": "list", "data": [_model_card(policy)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> Response:
        _authorize(request, token)
        _check_model(policy, model_id, param=None)
        return _json(_model_card(policy))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _authorize(request, token)
        req: CompletionRequest = parse_body(await _body(request, cfg), CompletionRequest)
        _check_model(policy, req.model)
        prompts: list[Prompt] = list(req.prompts)
        logprobs = req.logprobs is not None
        return await _generate(policy, cfg, COMPLETIONS, req, prompts, req.max_tokens, logprobs)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        _authorize(request, token)
        req: ChatCompletionRequest = parse_body(await _body(request, cfg), ChatCompletionRequest)
        _check_model(policy, req.model)
        prompts: list[Prompt] = [req.template_messages]
        budget = req.token_budget(cfg.max_new_tokens)
        param = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        return await _generate(policy, cfg, CHAT, req, prompts, budget, req.logprobs, param)

    return app


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
) -> Response:
    """Check the limits, generate n answers per prompt, answer as JSON or as an SSE stream."""
    if max_tokens > cfg.max_new_tokens:
        raise bad_request(
            f"{budget_param} is {max_tokens}, more than this server allows "
            f"({cfg.max_new_tokens}, serve.max_new_tokens)",
            code="max_tokens_too_large", param=budget_param,
        )  # fmt: skip
    rows = len(prompts) * req.n
    if rows > cfg.max_batch_size:
        raise bad_request(
            f"{rows} completions asked (prompts × n), more than this server allows in one "
            f"request ({cfg.max_batch_size}, serve.max_batch_size)", param="n",
        )  # fmt: skip
    prompt_tokens = sum(_prompt_tokens(policy, p, cfg, endpoint.prompt_param) for p in prompts)
    sampling = SamplingParams(
        n=1, temperature=req.temperature, top_p=req.top_p, max_new_tokens=max_tokens
    )
    gens = await policy.generate(prompts, req.n, sampling)
    per_token = logprobs or req.stream
    answers = [answer(g, req.stops, policy.tokenizer, per_token) for g in gens]
    policy.metrics.add_tokens(prompt_tokens, sum(g.tokens for g in gens))
    reply = Reply.new(endpoint.id_prefix, policy.name, gens[0].step if gens else policy.step)
    if req.stream:
        events = endpoint.chunks(reply, answers, prompt_tokens, req.include_usage)
        return StreamingResponse(_iterate(events), media_type="text/event-stream")
    return _json(endpoint.body(reply, answers, prompt_tokens, logprobs))


async def _iterate(events: Iterable[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event


def _prompt_tokens(policy: ServedPolicy, prompt: Prompt, cfg: ServeConfig, param: str) -> int:
    """The prompt's token count; an empty or too long prompt is a 400."""
    try:
        count = policy.prompt_tokens(prompt)
    except Exception as exc:  # e.g. a tokenizer without a chat template
        raise bad_request(f"cannot tokenize the {param}: {exc}", param=param) from None
    if count == 0:
        raise bad_request(f"the {param} is empty", param=param)
    if count > cfg.max_prompt_tokens:
        raise bad_request(
            f"the {param} is {count} tokens, more than this server allows "
            f"({cfg.max_prompt_tokens}, serve.max_prompt_tokens)",
            code="context_length_exceeded", param=param,
        )  # fmt: skip
    return count


def _model_card(policy: ServedPolicy) -> dict[str, Any]:
    return {
        "id": policy.name,
        "object": "model",
        "created": int(policy.loaded_at),
        "owned_by": "keel",
        "root": str(policy.source.folder),
        "step": policy.step,
    }


def _check_model(policy: ServedPolicy, model: str, param: str | None = "model") -> None:
    if model != policy.name:
        raise APIError(
            404, f"the model {model!r} does not exist; this server serves {policy.name!r}",
            code="model_not_found", param=param,
        )  # fmt: skip


def _authorize(request: Request, token: str | None) -> None:
    """The bearer token, when the server has one (serve.api_key or its environment variable)."""
    if token is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if not header:
        raise APIError(401, "missing API key: send 'Authorization: Bearer KEY'",
                       code="missing_api_key")  # fmt: skip
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip(), token):
        raise APIError(401, "incorrect API key", code="invalid_api_key")


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


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    text = json.dumps(body, separators=(",", ":"))
    return Response(text, status_code=status, media_type="application/json", headers=headers)


def _error_handlers(app: FastAPI, policy: ServedPolicy) -> None:
    """APIErrors, unknown routes and unexpected exceptions, all in OpenAI's error shape."""

    def respond(err: APIError) -> Response:
        policy.metrics.error(err.code)
        return _json(err.body(), err.status, err.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return respond(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        msg = f"{request.method} {request.url.path}: {exc.detail}"
        return respond(APIError(exc.status_code, msg, code=code))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> Response:
        log.exception("internal error answering %s", request.url.path)
        return respond(APIError(500, f"internal error: {exc}", code="internal_error"))


class RequestMetrics:
    """ASGI middleware: latency until the last byte and the status of every request, by
    endpoint; generation requests in flight."""

    def __init__(self, app: ASGIApp, policy: ServedPolicy):
        self.app = app
        self.metrics = policy.metrics

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
            self.metrics.latency.labels(endpoint=endpoint).observe(time.perf_counter() - start)
            self.metrics.requests.labels(endpoint=endpoint, status=str(status)).inc()
