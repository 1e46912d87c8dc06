"""The gRPC front end of `keel serve` (`--grpc-port N`): Generate, GenerateStream and Score of
keel_serve.proto, answered from the served model's one batching queue, so gRPC and HTTP
requests share batches.

grpcio's synchronous server runs each call on a thread of its pool (serve.grpc_workers); a call
checks the bearer token in its `authorization` metadata, turns the message into the HTTP API's
request model (the same validation, limits and error codes: keel.chatapi.schema and
keel.serve.handling), submits its rows and blocks on their future (GenerateStream with
continuous batching: reads each token's text from a queue the scheduler thread fills, and
yields its chunk at once; a cancelled call's rows leave the decoder). Refusals are status codes
(`STATUS`), their detail `CODE: message` with the HTTP API's error code; every call is counted in
the same metrics as HTTP's, with endpoint `grpc/METHOD` and its status code's name. Bytes that
do not decode as the method's message (malformed, or nested past protobuf's depth limit) are the
client's: INVALID_ARGUMENT `invalid_message` (grpcio alone would answer INTERNAL and log a
traceback).
"""

from __future__ import annotations

import logging
import queue
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from keel.chatapi.errors import APIError, bad_request
from keel.chatapi.responses import Answer, Reply, fingerprint, usage
from keel.chatapi.schema import ChatCompletionRequest, CompletionRequest, ScoreRequest, validate
from keel.config.loading import ConfigError
from keel.serve import keel_serve_pb2 as pb
from keel.serve import keel_serve_pb2_grpc as pb_grpc
from keel.serve.config import ServeConfig
from keel.serve.continuous import Delta
from keel.serve.handling import Plan, answers, authorize, check_model, plan_generation
from keel.serve.policy import Prompt, ServedPolicy
from keel.serve.scoring import ServedReward, check_score_model
from keel.serve.served import Served

log = logging.getLogger(__name__)

# The HTTP status of an APIError → the gRPC status code it is answered with.
STATUS = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
}


R = TypeVar("R")  # what an RPC's work gives


class KeelServicer(pb_grpc.KeelServicer):
    """The Keel service over one served model (a policy, or a reward model with --reward)."""

    def __init__(self, served: Served, cfg: ServeConfig):
        self.served = served
        self.cfg = cfg
        self.token = cfg.bearer_token()

    # ------------------------------------------------------------------ the RPCs
    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> pb.GenerateResponse:
        def run() -> pb.GenerateResponse:
            reply, plan, answered = self._generate(request, context)
            choices = [
                pb.Choice(
                    index=i,
                    text=a.text,
                    finish_reason=a.finish_reason,
                    logprobs=_token_logprobs(a) if request.logprobs else [],
                )
                for i, a in enumerate(answered)
            ]
            return pb.GenerateResponse(
                id=reply.id, model=reply.model, choices=choices,
                usage=pb.Usage(**usage(plan.prompt_tokens, answered)),
                system_fingerprint=fingerprint(reply.step),
            )  # fmt: skip

        return self._answer("Generate", request, context, run)

    def GenerateStream(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateChunk]:
        policy = self.served
        if isinstance(policy, ServedPolicy) and policy.streams:
            return self._stream(policy, request, context)

        def run() -> list[pb.GenerateChunk]:
            reply, plan, answered = self._generate(request, context, stream=True)
            chunks = []
            for i, a in enumerate(answered):
                pieces = a.pieces if a.pieces is not None else [a.text]
                logprobs = a.logprobs if request.logprobs and a.logprobs is not None else None
                for k, piece in enumerate(pieces):
                    lp = logprobs[k] if logprobs is not None else None  # None: not set
                    chunks.append(pb.GenerateChunk(id=reply.id, index=i, text=piece, logprob=lp))
                chunks.append(pb.GenerateChunk(id=reply.id, index=i, finish_reason=a.finish_reason))
            last = pb.Usage(**usage(plan.prompt_tokens, answered))
            chunks.append(pb.GenerateChunk(id=reply.id, usage=last))
            return chunks

        # serve.batching=batch: answered in full before the first chunk (as the HTTP stream
        # is then): an error is a status.
        return iter(self._answer("GenerateStream", request, context, run))

    def _stream(
        self,
        policy: ServedPolicy,
        request: pb.GenerateRequest | Undecodable,
        context: grpc.ServicerContext,
    ) -> Iterator[pb.GenerateChunk]:
        """GenerateStream with continuous batching: each token's chunk leaves as it is decoded
        (the scheduler thread puts the rows' `Delta`s on a queue this call's thread reads);
        a refusal or a failure is the call's status, counted as `_answer` counts it."""
        metrics = policy.metrics
        endpoint, code = "grpc/GenerateStream", grpc.StatusCode.OK
        start = time.perf_counter()
        metrics.in_flight.inc()
        failure: tuple[str, str] | None = None
        finished = False
        try:
            authorize(_authorization(context), self.token)
            if isinstance(request, Undecodable):
                raise bad_request(str(request), code="invalid_message")
            plan, prefix = self._plan(policy, request, stream=True)
            deltas: queue.SimpleQueue[Delta | None] = queue.SimpleQueue()
            future = policy.submit(plan.prompts, plan.n, plan.sampling, stops=plan.stops,
                                   on_delta=deltas.put)  # fmt: skip
            future.add_done_callback(lambda _: deltas.put(None))
            _cancel_with_call(context, future)  # a cancelled call leaves the decoder
            reply = Reply.new(prefix, policy.name, policy.step)
            while (delta := deltas.get()) is not None:
                for piece, logprob in zip(delta.pieces, delta.logprobs, strict=True):
                    lp = logprob if request.logprobs else None  # None: not set
                    yield pb.GenerateChunk(id=reply.id, index=delta.index, text=piece, logprob=lp)
                if delta.finish is not None:
                    yield pb.GenerateChunk(id=reply.id, index=delta.index,
                                           finish_reason=delta.finish)  # fmt: skip
            answered = answers(policy, plan, policy.wait(future))
            yield pb.GenerateChunk(id=reply.id, usage=pb.Usage(**usage(plan.prompt_tokens,
                                                                       answered)))  # fmt: skip
            finished = True
        except APIError as err:
            code = STATUS.get(err.status, grpc.StatusCode.INTERNAL)
            failure = (err.code, f"{err.code}: {err.message}")
        except Exception as exc:
            log.exception("internal error answering gRPC GenerateStream")
            code = grpc.StatusCode.INTERNAL
            failure = ("internal_error", f"internal_error: {exc}")
        finally:
            if failure is None and not finished:
                code = grpc.StatusCode.CANCELLED  # the client went away mid-stream
            metrics.in_flight.dec()
            metrics.answered(endpoint, code.name, time.perf_counter() - start)
        if failure is not None:
            metrics.error(failure[0])
            context.abort(code, failure[1])  # raises

    def Score(self, request: pb.ScoreRequest, context: grpc.ServicerContext) -> pb.ScoreResponse:
        def run() -> pb.ScoreResponse:
            reward = self.served
            if not isinstance(reward, ServedReward):
                raise APIError(501, "this server serves a policy: Generate, not Score "
                               "(keel serve MODEL --reward serves a reward model)",
                               code="unimplemented")  # fmt: skip
            items = [_score_item(item, i) for i, item in enumerate(request.items)]
            kwargs = json_format.MessageToDict(request.kwargs)
            req = validate({"items": items, "kwargs": kwargs, "model": request.model or None},
                           ScoreRequest)  # fmt: skip
            check_score_model(reward, req.model)
            rows = reward.rows(req)
            future = reward.submit(rows)
            _cancel_with_call(context, future)  # a call cancelled while queued is not scored
            scores = reward.wait(future)
            reward.count(rows)
            return pb.ScoreResponse(scores=scores)

        return self._answer("Score", request, context, run)

    # ------------------------------------------------------------------ the shared parts
    def _answer(
        self, method: str, request: object, context: grpc.ServicerContext, run: Callable[[], R]
    ) -> R:
        """run() after the token check (and, for a request that did not decode, a 400); an
        APIError becomes its status code (the call ends), and the call is counted like an HTTP
        request."""
        metrics = self.served.metrics
        endpoint, code = f"grpc/{method}", grpc.StatusCode.OK
        start = time.perf_counter()
        metrics.in_flight.inc()
        try:
            authorize(_authorization(context), self.token)
            if isinstance(request, Undecodable):
                raise bad_request(str(request), code="invalid_message")
            return run()
        except APIError as err:
            code = STATUS.get(err.status, grpc.StatusCode.INTERNAL)
            failure = (err.code, f"{err.code}: {err.message}")
        except Exception as exc:
            log.exception("internal error answering gRPC %s", method)
            code = grpc.StatusCode.INTERNAL
            failure = ("internal_error", f"internal_error: {exc}")
        finally:
            metrics.in_flight.dec()
            metrics.answered(endpoint, code.name, time.perf_counter() - start)
        metrics.error(failure[0])
        context.abort(code, failure[1])  # raises

    def _generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext, stream: bool = False
    ) -> tuple[Reply, Plan, list[Answer]]:
        """The request checked as the HTTP API checks its body, generated, and answered."""
        policy = self.served
        if not isinstance(policy, ServedPolicy):
            raise APIError(501, "this server serves a reward model: Score, not Generate",
                           code="unimplemented")  # fmt: skip
        plan, prefix = self._plan(policy, request, stream)
        future = policy.submit(plan.prompts, plan.n, plan.sampling, stops=plan.stops)
        _cancel_with_call(context, future)  # a call cancelled while queued is not generated
        gens = policy.wait(future)
        answered = answers(policy, plan, gens)
        reply = Reply.new(prefix, policy.name, gens[0].step if gens else policy.step)
        return reply, plan, answered

    def _plan(
        self, policy: ServedPolicy, request: pb.GenerateRequest, stream: bool
    ) -> tuple[Plan, str]:
        """The request checked as the HTTP API checks its body; its response id prefix."""
        if bool(request.prompt) == bool(request.messages):
            raise bad_request("give exactly one of prompt and messages", param="prompt")
        data: dict[str, Any] = {"model": request.model or policy.name, "n": request.n or 1}
        for name in ("temperature", "top_p", "max_tokens"):
            if request.HasField(name):
                data[name] = getattr(request, name)
        if request.stop:
            data["stop"] = list(request.stop)
        if request.messages:
            data["messages"] = [{"role": m.role, "content": m.content} for m in request.messages]
            chat: ChatCompletionRequest = validate(
                {**data, "logprobs": request.logprobs}, ChatCompletionRequest
            )
            prompts: list[Prompt] = [chat.template_messages]
            req, param = chat, "messages"
            budget = chat.token_budget(self.cfg.max_new_tokens)
            prefix = "chatcmpl"
        else:
            data["prompt"] = request.prompt
            text: CompletionRequest = validate(data, CompletionRequest)
            req, param = text, "prompt"
            prompts = list(text.prompts)
            budget, prefix = text.max_tokens, "cmpl"
        check_model(policy, req.model)
        plan = plan_generation(policy, self.cfg, req, prompts, budget,
                               request.logprobs or stream, prompt_param=param)  # fmt: skip
        return plan, prefix


def _authorization(context: grpc.ServicerContext) -> str | None:
    """The call's authorization metadata (a text key: never bytes, which only -bin keys carry)."""
    value = dict(context.invocation_metadata()).get("authorization")
    return value if isinstance(value, str) else None


def _cancel_with_call(context: grpc.ServicerContext, future: Future[R]) -> None:
    """`future` is cancelled when the call ends: a call cancelled (or its client gone) while
    queued or decoding stops its work."""

    def cancel() -> None:
        future.cancel()

    context.add_callback(cancel)


def _token_logprobs(a: Answer) -> list[pb.TokenLogprob]:
    if a.pieces is None or a.logprobs is None:
        return []
    pairs = zip(a.pieces, a.logprobs, strict=False)
    return [pb.TokenLogprob(token=p, logprob=lp) for p, lp in pairs]


def _score_item(item: pb.ScoreItem, i: int) -> dict[str, Any]:
    if item.prompt and item.messages:
        raise bad_request(f"items.{i}: give one of prompt and messages", param=f"items.{i}")
    prompt: Prompt = item.prompt
    if item.messages:
        prompt = [{"role": m.role, "content": m.content} for m in item.messages]
    answer = item.answer if item.HasField("answer") else None
    return {"prompt": prompt, "response": item.response, "answer": answer}


class Undecodable:
    """What the request deserializer gives for bytes that are not a message of its type: the
    servicer answers it with INVALID_ARGUMENT (grpcio would abort a deserializer's exception
    with INTERNAL and log it)."""

    def __init__(self, message: str, error: Exception):
        self.message = message
        self.error = error

    def __str__(self) -> str:
        return f"the request is not a {self.message} message: {self.error}"


def _decoder(message: type[Message]) -> Callable[[bytes], Message | Undecodable]:
    def decode(data: bytes) -> Message | Undecodable:
        try:
            return message.FromString(data)
        except Exception as exc:  # DecodeError: malformed, or nested past the depth limit
            return Undecodable(message.DESCRIPTOR.full_name, exc)

    return decode


def add_servicer(servicer: KeelServicer, server: grpc.Server) -> None:
    """keel_serve_pb2_grpc.add_KeelServicer_to_server, with request deserializers that hand an
    undecodable message to the servicer (`Undecodable`) instead of failing the call."""
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate, request_deserializer=_decoder(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream, request_deserializer=_decoder(pb.GenerateRequest),
            response_serializer=pb.GenerateChunk.SerializeToString,
        ),
        "Score": grpc.unary_unary_rpc_method_handler(
            servicer.Score, request_deserializer=_decoder(pb.ScoreRequest),
            response_serializer=pb.ScoreResponse.SerializeToString,
        ),
    }  # fmt: skip
    service = pb.DESCRIPTOR.services_by_name["Keel"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    # grpcio has this method since 1.63; typeshed's grpcio stubs lack it
    server.add_registered_method_handlers(service, handlers)  # pyright: ignore[reportAttributeAccessIssue]


def start_grpc(served: Served, cfg: ServeConfig, host: str, port: int) -> grpc.Server:
    """The gRPC server on host:port, started (TLS with serve.tls_certfile/keyfile when set);
    a port it cannot listen on is a ConfigError. Says where it listens on stderr."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=cfg.grpc_workers, thread_name_prefix="keel-grpc"),
        maximum_concurrent_rpcs=cfg.max_pending_requests,
        options=[
            ("grpc.max_receive_message_length", cfg.max_body_bytes),
            ("grpc.so_reuseport", 0),  # a port another server holds is an error, not shared
        ],
    )
    add_servicer(KeelServicer(served, cfg), server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        if cfg.tls_certfile and cfg.tls_keyfile:
            key, cert = Path(cfg.tls_keyfile).read_bytes(), Path(cfg.tls_certfile).read_bytes()
            bound = server.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ConfigError(f"--grpc-port: cannot listen on {address}: {exc}") from None
    if not bound:
        raise ConfigError(f"--grpc-port: cannot listen on {address}")
    server.start()
    scheme = "grpcs" if cfg.tls_certfile else "grpc"
    print(f"keel serve: {served.name} gRPC on {scheme}://{host}:{bound}",
          file=sys.stderr, flush=True)  # fmt: skip
    return server
