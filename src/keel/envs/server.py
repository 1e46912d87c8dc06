"""Serving a Python environment over HTTP (the keel-env protocol of keel.envs.remote), so that
a run plays its episodes in another process or on another host:

    keel env serve builtin:guess_number --port 8711
    keel env serve my_env.py:Countdown --kwargs '{"start": 5}' --host 0.0.0.0 --port 8711

(keel.cli.main parses the command, `serve_main` runs it), or from Python,
`EnvServer(factory).start()` (a thread) / `.serve_forever()`. Each session is one
episode and gets an environment of its own, built by the factory (`Class(**kwargs)`, the
reset's `kwargs` on top of the server's) at its reset; a session's calls run one at a time, and
different sessions' concurrently (one thread per request). A session is forgotten at its close,
or when it has been idle for `session_ttl_s`; at most `max_sessions` live at once (a reset past
that is answered 503, which the client retries). The standard library's HTTP server: no
dependency beyond Python."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, TypeVar

from keel.envs.protocol import Environment, StepResult
from keel.envs.remote import PROTOCOL, VERSION, example_from_json

# `Any` in this module: JSON bodies of the keel-env protocol, before they are checked.


class ProtocolError(Exception):
    """A request the server answers with an error status; `code` goes in the reply."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Session:
    env: Environment
    lock: threading.Lock = field(default_factory=threading.Lock)
    turn: int = 0  # the last turn stepped
    last: dict[str, Any] | None = None  # its reply, for a retried step
    touched: float = field(default_factory=time.monotonic)


class _Listener(ThreadingHTTPServer):
    # socketserver's backlog of 5 drops the connections past it when a rollout opens dozens at
    # once, and each dropped one waits for its SYN's retransmission (1 s)
    request_queue_size = 1024


class EnvServer:
    """An HTTP server of the environments `factory` builds (a class or any callable; keyword
    arguments from each reset's `kwargs`). `port` 0 picks a free one (`url` says which)."""

    def __init__(
        self,
        factory: Callable[..., Environment],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_sessions: int = 256,
        session_ttl_s: float = 600.0,
        name: str = "environment",
    ):
        self.factory = factory
        self.name = name
        self.max_sessions = max_sessions
        self.session_ttl_s = session_ttl_s
        self.sessions: dict[str, Session] = {}
        self.lock = threading.Lock()
        self.httpd = _Listener((host, port), _handler(self))
        self.httpd.daemon_threads = True
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> EnvServer:
        """Serve on a daemon thread; returns self."""
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        return self

    def serve_forever(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- the calls -------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return {
            "protocol": PROTOCOL,
            "version": VERSION,
            "environment": self.name,
            "sessions": len(self.sessions),
            "max_sessions": self.max_sessions,
        }

    def reset(self, body: Mapping[str, Any]) -> dict[str, Any]:
        sid = _field(body, "session", str)
        example = _parsed(lambda: example_from_json(body.get("example")))
        kwargs = body.get("kwargs") or {}
        if not isinstance(kwargs, Mapping):
            raise ProtocolError(400, "bad_request", "kwargs: must be an object")
        try:
            inspect.signature(self.factory).bind(**kwargs)
        except TypeError as exc:
            raise ProtocolError(
                400, "bad_request", f"kwargs do not fit {self.name}: {exc}"
            ) from None
        except ValueError:  # no signature to check
            pass
        self._make_room(sid)
        env = _environment_call(lambda: self.factory(**kwargs), "building the environment")
        opening = _environment_call(lambda: env.reset(example), "reset")
        schemas = getattr(env, "tool_schemas", None)
        tools = _environment_call(schemas, "tool_schemas") if callable(schemas) else None
        with self.lock:
            self.sessions[sid] = Session(env)  # a retried reset replaces the session
        return {"session": sid, "observation": opening, "tools": tools}

    def step(self, body: Mapping[str, Any]) -> dict[str, Any]:
        sid = _field(body, "session", str)
        turn = _field(body, "turn", int)
        response = _field(body, "response", str)
        session = self._session(sid)
        with session.lock:
            session.touched = time.monotonic()
            if turn == session.turn and session.last is not None:
                return session.last  # a retried step: its first answer
            if turn != session.turn + 1:
                raise ProtocolError(
                    409,
                    "turn",
                    f"session {sid} is at turn {session.turn}; got a step of turn {turn}",
                )
            result = _environment_call(lambda: session.env.step(response), "step")
            if not isinstance(result, StepResult):
                raise ProtocolError(
                    422, "environment", f"step must return a StepResult, got {result!r:.200}"
                )
            session.last = {
                "observation": result.observation,
                "reward": float(result.reward),
                "done": bool(result.done),
                "info": result.info,
            }
            session.turn = turn
            return session.last

    def close_session(self, body: Mapping[str, Any]) -> dict[str, Any]:
        sid = _field(body, "session", str)
        with self.lock:
            session = self.sessions.pop(sid, None)
        if session is not None:
            closer = getattr(session.env, "close", None)
            if callable(closer):
                # the episode is over; its environment's cleanup is its own business
                with contextlib.suppress(Exception):
                    closer()
        return {"closed": session is not None}

    def _session(self, sid: str) -> Session:
        with self.lock:
            session = self.sessions.get(sid)
        if session is None:
            raise ProtocolError(
                404, "unknown_session", f"no session {sid} (never reset, closed, expired after "
                f"{self.session_ttl_s:g}s idle, or the server restarted)"
            )  # fmt: skip
        return session

    def _make_room(self, sid: str) -> None:
        """Forget sessions idle past session_ttl_s; 503 when max_sessions still live."""
        now = time.monotonic()
        with self.lock:
            for key in [
                k for k, s in self.sessions.items() if now - s.touched > self.session_ttl_s
            ]:
                del self.sessions[key]
            if sid not in self.sessions and len(self.sessions) >= self.max_sessions:
                raise ProtocolError(
                    503, "busy", f"{self.max_sessions} sessions live (--max-sessions)"
                )


T = TypeVar("T")


def _field(body: Mapping[str, Any], key: str, kind: type[T]) -> T:
    value = body.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ProtocolError(
            400, "bad_request", f"{key}: must be a {kind.__name__}, got {value!r:.80}"
        )
    return value


def _parsed(parse: Callable[[], T]) -> T:
    try:
        return parse()
    except (TypeError, ValueError) as exc:
        raise ProtocolError(400, "bad_request", str(exc)) from None


def _environment_call(call: Callable[[], T], what: str) -> T:
    """`call()`; the environment's own exception as a 422 naming `what`."""
    try:
        return call()
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(422, "environment", f"{what} raised {exc!r}") from exc


ROUTES = {
    "/v1/reset": EnvServer.reset,
    "/v1/step": EnvServer.step,
    "/v1/close": EnvServer.close_session,
}


def _handler(server: EnvServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # the headers and the body go in two writes: without TCP_NODELAY the body waits for
        # the client's delayed ACK of the headers (40 ms a call on Linux)
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] == "/v1/health":
                self._reply(200, {"version": VERSION, **server.health()})
            else:
                self._error(ProtocolError(404, "not_found", f"no GET {self.path}; try /v1/health"))

        def do_POST(self) -> None:
            try:
                route = ROUTES.get(self.path.split("?", 1)[0])
                if route is None:
                    raise ProtocolError(
                        404, "not_found", f"no POST {self.path} ({', '.join(ROUTES)})"
                    )
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"null")
                except ValueError:
                    raise ProtocolError(400, "bad_request", "the body is not JSON") from None
                if not isinstance(body, dict):
                    raise ProtocolError(400, "bad_request", "the body must be a JSON object")
                if body.get("version") != VERSION:
                    raise ProtocolError(
                        400, "version", f"this server speaks {PROTOCOL} version {VERSION}; the "
                        f"request says version {body.get('version')!r}"
                    )  # fmt: skip
                self._reply(200, {"version": VERSION, **route(server, body)})
            except ProtocolError as exc:
                self._error(exc)
            except Exception as exc:  # a bug of the server: the client retries a 500
                self._error(ProtocolError(500, "internal", repr(exc)))

        def _error(self, exc: ProtocolError) -> None:
            body = {"version": VERSION, "error": {"code": exc.code, "message": str(exc)}}
            self._reply(exc.status, body, retry_after=exc.status == 503)

        def _reply(self, status: int, body: dict[str, Any], retry_after: bool = False) -> None:
            data = json.dumps(body, default=repr).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if retry_after:
                self.send_header("Retry-After", "1")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:  # no access log on stderr
            pass

    return Handler


def serve_main(args: argparse.Namespace) -> int:
    """`keel env serve`: build the server from the parsed arguments and serve until killed.
    Prints one line with its URL when it listens."""
    from keel.envs.builtin import ENVIRONMENTS
    from keel.envs.loading import EnvLoadError, load_environment

    try:
        kwargs = json.loads(args.kwargs)
    except ValueError as exc:
        raise EnvLoadError(f"--kwargs: not JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise EnvLoadError("--kwargs: must be a JSON object")
    try:
        factory = load_environment(args.env, kwargs, ENVIRONMENTS)
    except EnvLoadError as exc:  # its fields are rollout.env's; here they are the command's
        text = str(exc).replace("rollout.env.kwargs", "--kwargs").replace("rollout.env", "ENV")
        raise EnvLoadError(text) from None
    try:
        server = EnvServer(
            factory,
            host=args.host,
            port=args.port,
            max_sessions=args.max_sessions,
            session_ttl_s=args.session_ttl_s,
            name=args.env,
        )
    except OSError as exc:
        raise EnvLoadError(
            f"--port: cannot listen on {args.host}:{args.port} ({exc.strerror or exc}); "
            "choose another (0 picks a free one)"
        ) from None
    print(f"keel env serve: {args.env} on {server.url} ({PROTOCOL} {VERSION})", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()
    return 0
