"""Environments over HTTP: the client side of the keel-env protocol (`rollout.env: {name: http,
url: …}`); the server side is keel.envs.server (`keel env serve`). The protocol, version 1,
JSON over HTTP (docs/environments.md, "Environments over HTTP"):

    GET  /v1/health → {"protocol": "keel-env", "version": 1, "environment": str,
                       "sessions": int, "max_sessions": int}
    POST /v1/reset  {"version": 1, "session": str, "example": {prompt, answer, source, tools,
                     response}, "kwargs": {...}}
                    → {"version": 1, "session": str, "observation": str | [messages] | null,
                       "tools": [schemas] | null}
    POST /v1/step   {"version": 1, "session": str, "turn": int, "response": str}
                    → {"version": 1, "observation": …, "reward": float, "done": bool,
                       "info": {...}}
    POST /v1/close  {"version": 1, "session": str} → {"version": 1, "closed": bool}
    an error        → {"version": 1, "error": {"code": str, "message": str}} with status 400
                      (bad_request, version), 404 (unknown_session), 409 (turn), 422
                      (environment: the environment itself raised), 503 (busy), 500

The client names the session (a fresh random id per episode) and numbers the turns, so every
call can be retried: a reset builds the session's environment anew, a step whose turn the
server has already played is answered from the server's record of it, close is a no-op on an
unknown session. A call that fails to connect, times out (`rollout.env.timeout_s`, 30 s by
default) or gets 429/500/502/503/504 is retried (`rollout.env.http_retries`, after 0.2 s · 2^k);
a rollout worker has at most `rollout.env.workers` calls in flight to the server (its runner's
threads, and its client's limit when a step's rollout and an evaluation run at once). What
still fails raises EnvServerError (the server is gone, or lost the session: 404 after a
restart) or RemoteEnvironmentError (the environment raised on the server), which the episode
runner counts as a failed attempt and retries with a fresh environment (rollout.env.retries),
not as a failed run."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from keel.data.examples import Example
from keel.envs.protocol import Observation, StepResult
from keel.rewards.remote import RETRIED_STATUS  # the statuses every Keel HTTP client retries

# `Any` in this module: JSON bodies of the keel-env protocol, before they are checked.

PROTOCOL = "keel-env"
VERSION = 1


class EnvServerError(RuntimeError):
    """The environment server failed a call (after its retries), refused it, or lost the
    episode's session; the message names the server and what went wrong."""


class RemoteEnvironmentError(RuntimeError):
    """The environment raised on the server (HTTP 422); the message is the server's."""


def example_json(example: Example) -> dict[str, Any]:
    """An Example as the JSON object a reset sends (every field of keel.data.Example)."""
    return dataclasses.asdict(example)


def example_from_json(raw: Any) -> Example:
    """The Example a reset's `example` object describes; ValueError naming what is wrong."""
    if not isinstance(raw, Mapping) or "prompt" not in raw:
        raise ValueError("example: must be an object with at least a prompt")
    known = {f.name for f in dataclasses.fields(Example)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"example: unknown fields {unknown} (it takes {sorted(known)})")
    return Example(**dict(raw))


class EnvServerClient:
    """The calls to one environment server: JSON POSTs, each attempt with a time limit, retried
    on a connection error, a time-out or a retried status; at most `max_concurrency` in flight
    (the attempts of every HTTPEnvironment of this client)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        max_concurrency: int = 8,
    ):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.slots = threading.BoundedSemaphore(max_concurrency)

    def call(self, endpoint: str, body: dict[str, Any], retries: int | None = None) -> Any:
        """POST `body` (with the protocol version) to /v1/<endpoint>; the reply's JSON object.
        Retried while `retries` (default: the client's) allow on a connection error, a
        time-out or a retried status."""
        data = json.dumps({"version": VERSION, **body}).encode()
        retries = self.retries if retries is None else retries
        for attempt in range(retries + 1):
            try:
                with self.slots:
                    return self._post(endpoint, data)
            except _Retry as exc:
                reason = str(exc)
            except OSError as exc:  # refused, reset, timed out (URLError is an OSError)
                cause = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                reason = (
                    f"no answer within {self.timeout_s:g}s (rollout.env.timeout_s)"
                    if isinstance(cause, TimeoutError)
                    else repr(cause)
                )
            if attempt == retries:
                raise EnvServerError(
                    f"the environment server {self.url}: {endpoint} failed {attempt + 1} "
                    f"time{'s' if attempt else ''}, the last with {reason}"
                )
            time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def _post(self, endpoint: str, data: bytes) -> Any:
        request = urllib.request.Request(
            f"{self.url}/v1/{endpoint}",
            data=data,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            error = _error_of(exc.read())
            if exc.code in RETRIED_STATUS:
                raise _Retry(f"HTTP {exc.code}: {error}") from None
            if exc.code == 422:
                raise RemoteEnvironmentError(f"{self.url}: {error}") from None
            raise EnvServerError(
                f"the environment server {self.url} refused {endpoint}: HTTP {exc.code}: {error}"
            ) from None
        except json.JSONDecodeError:
            raise EnvServerError(
                f"the environment server {self.url} answered {endpoint} with something that "
                "is not JSON"
            ) from None
        if not isinstance(reply, dict) or reply.get("version") != VERSION:
            raise EnvServerError(
                f"the environment server {self.url} answered {endpoint} without "
                f'"version": {VERSION} (keel-env protocol version {VERSION}): {str(reply)[:200]}'
            )
        return reply

    def health(self) -> dict[str, Any]:
        """GET /v1/health (one attempt)."""
        with urllib.request.urlopen(f"{self.url}/v1/health", timeout=self.timeout_s) as response:
            return json.loads(response.read())


class HTTPEnvironment:
    """One episode's environment on a server (keel.envs.protocol.Environment): a session of
    its own, named here, closed when the episode is over (`close`)."""

    def __init__(self, client: EnvServerClient, kwargs: Mapping[str, Any] | None = None):
        self.client = client
        self.kwargs = dict(kwargs or {})
        self.session = uuid.uuid4().hex
        self.turn = 0
        self.tools: list[dict[str, Any]] | None = None

    def reset(self, example: Example) -> Observation | None:
        self.turn = 0
        reply = self.client.call(
            "reset",
            {"session": self.session, "example": example_json(example), "kwargs": self.kwargs},
        )
        self.tools = reply.get("tools") or None
        return reply.get("observation")

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """The tools the server's environment describes (its reset's `tools`)."""
        return self.tools

    def step(self, response: str) -> StepResult:
        self.turn += 1
        reply = self.client.call(
            "step", {"session": self.session, "turn": self.turn, "response": response}
        )
        try:
            return StepResult(
                observation=reply.get("observation"),
                reward=float(reply.get("reward", 0.0)),
                done=bool(reply.get("done", False)),
                info=dict(reply.get("info") or {}),
            )
        except (TypeError, ValueError) as exc:
            raise EnvServerError(
                f"the environment server {self.client.url} answered step with {exc}"
            ) from None

    def close(self) -> None:
        """Drop the session on the server (one attempt: the server forgets idle sessions
        anyway)."""
        self.client.call("close", {"session": self.session}, retries=0)


def http_environment_factory(
    url: str, kwargs: Mapping[str, Any], **client_options: Any
) -> Callable[[], HTTPEnvironment]:
    """A factory of HTTPEnvironments on the server at `url`, all sharing one client; `kwargs`
    go with each reset for the server to build the environment with (rollout.env.kwargs)."""
    client = EnvServerClient(url, **client_options)
    return lambda: HTTPEnvironment(client, kwargs)


def _error_of(body: bytes) -> str:
    try:
        error = json.loads(body)["error"]
        return f"{error['code']}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return body[:300].decode("utf-8", "replace")


class _Retry(Exception):
    """A status worth retrying (429, 5xx)."""
