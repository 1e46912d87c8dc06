"""Locust load on an OpenAI-compatible completions API (`keel serve`, or any other).

Run headless by `bench/serve_locust.py` (`make bench-serve`), or by hand:

  locust -f bench/locustfile.py --headless --users 1 --spawn-rate 1 --run-time 90s \\
      --host http://127.0.0.1:8000 --csv /tmp/load --qps 100 --duration 60 --max-tokens 8

How requests leave (`--arrival`):

- `fixed` (default): an open loop at `--qps` in all, one request every `--users`/`--qps`
  seconds per user, whether or not earlier answers have come back, each in its own greenlet;
  a slow server meets a growing queue instead of slowing the client down.
- `poisson`: the same open loop with exponential gaps (Poisson arrivals at `--qps`).
- `users`: Locust's own closed loop, `constant_throughput(qps / users)` per user: a user waits
  for its answer before its next request, so a slow server is offered less than `--qps`, and
  users held up by the same slow call come back, and fire again, together.

A request's time runs from the moment it was due to leave (open loop) or left (users) to its
last byte, so time spent behind a late client is counted too. `--stream-share` of the requests
ask `stream: true` and report two rows: `completions stream` (due to the end of the stream,
`data: [DONE]`) and `ttft` (due to the first SSE `data:` bytes, the time to first token as a
client sees it). The rest report `completions`. An answer that is not 200 with one choice, or
a stream that does not begin with `data:` and end with `[DONE]`, is a failure. A request that
got no answer because its pooled keep-alive connection had just been closed by the server is
sent once more on a fresh connection (as HTTP clients do) and counted in a `retried connection`
row.

With `--duration` the open loop offers load for that many seconds, waits for the last answers
(at most `--request-timeout`) and stops the test; `--run-time` is then only a cap. At the end
it prints one line `KEEL_LOAD {json}`: sent, answered, the window from the first departure to
the last answer, and how late the client sent (its worst lag behind the schedule, which the
latencies already include).
"""

from __future__ import annotations

import json
import math
import random
import time
import urllib.request
from typing import Any

import gevent
import gevent.pool
import locust.stats
from locust import FastHttpUser, constant_throughput, events, task
from locust.exception import StopUser

ARRIVALS = ("fixed", "poisson", "users")


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("keel serve load")
    group.add_argument(
        "--qps", type=float, default=100.0, help="offered requests per second, all users together"
    )
    group.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default="fixed",
        help="fixed / poisson: open loop; users: constant_throughput per user",
    )
    group.add_argument(
        "--duration",
        type=float,
        default=0.0,
        help="open loop: seconds of offered load, then drain and stop (0: until --run-time)",
    )
    group.add_argument("--max-tokens", type=int, default=8, help="max_tokens of every request")
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument(
        "--stream-share",
        type=float,
        default=0.1,
        help="share of requests sent with stream: true (TTFT measured on them)",
    )
    group.add_argument(
        "--prompt", default="{i}+{i}=", help="prompt; {i} is the request number %% 100"
    )
    group.add_argument(
        "--model-id", default="", help="model in requests (default: the first of /v1/models)"
    )
    group.add_argument("--api-key", default="", help="bearer token, if the server wants one")
    group.add_argument(
        "--request-timeout", type=float, default=30.0, help="seconds before a request fails"
    )
    group.add_argument(
        "--seed", type=int, default=0, help="seed of the arrival gaps and of which requests stream"
    )


class Tally:
    """What Locust's stats do not hold: sent and answered counts, the load window, send lag."""

    def __init__(self) -> None:
        self.sent = 0
        self.answered = 0
        self.first_due: float | None = None
        self.last_done: float | None = None
        self.max_lag_s = 0.0
        self.users_done = 0

    def due(self, t: float, sent_at: float) -> None:
        self.sent += 1
        self.first_due = t if self.first_due is None else min(self.first_due, t)
        self.max_lag_s = max(self.max_lag_s, sent_at - t)

    def done(self, ok: bool) -> None:
        self.answered += ok
        self.last_done = time.perf_counter()

    def summary(self) -> dict[str, Any]:
        window = None
        if self.first_due is not None and self.last_done is not None:
            window = round(self.last_done - self.first_due, 3)
        return {
            "sent": self.sent,
            "answered": self.answered,
            "window_s": window,
            "max_send_lag_s": round(self.max_lag_s, 4),
        }


TALLY = Tally()
_MODEL: dict[str, str] = {}


@events.test_stop.add_listener
def _print_tally(**_: Any) -> None:
    print("KEEL_LOAD " + json.dumps(TALLY.summary()), flush=True)


@events.quitting.add_listener
def _let_the_csv_catch_up(environment: Any, **_: Any) -> None:
    """Locust rewrites its --csv files every CSV_STATS_INTERVAL_SEC and not at exit, so the last
    answers (the tail of the latencies) would be missing from them: wait one interval more."""
    if getattr(environment.parsed_options, "csv_prefix", None):
        gevent.sleep(locust.stats.CSV_STATS_INTERVAL_SEC + 0.5)


def _served_model(host: str, api_key: str) -> str:
    """The first model id of GET /v1/models (fetched once)."""
    if "id" not in _MODEL:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        request = urllib.request.Request(f"{host.rstrip('/')}/v1/models", headers=headers)
        with urllib.request.urlopen(request, timeout=30) as response:
            _MODEL["id"] = json.loads(response.read())["data"][0]["id"]
    return _MODEL["id"]


def refusal(response: Any) -> str:
    """Why a request failed: its HTTP status, or (status 0: no answer) the client's error."""
    if response.status_code:
        return f"HTTP {response.status_code}"
    return f"no answer: {type(getattr(response, 'error', None)).__name__}"


def answered(response: Any) -> bool:
    """A 200 whose body has one choice; else the failure is marked on `response`."""
    if response.status_code != 200:
        response.failure(refusal(response))
        return False
    try:
        choices = json.loads(response.content)["choices"]
    except (ValueError, KeyError, TypeError) as exc:
        response.failure(f"bad body: {type(exc).__name__}")
        return False
    if len(choices) != 1:
        response.failure(f"{len(choices)} choices, wanted 1")
        return False
    return True


STALE_CONNECTION = {"HTTPConnectionClosed", "ConnectionResetError", "BrokenPipeError"}
RETRIED = "retried connection"


class CompletionsUser(FastHttpUser):
    """Sends /v1/completions at the offered rate (see the module docstring)."""

    concurrency = 4096  # the open loop's requests in flight share this user's connection pool

    def __init__(self, environment: Any) -> None:
        timeout = environment.parsed_options.request_timeout
        self.network_timeout = self.connection_timeout = timeout
        super().__init__(environment)

    def on_start(self) -> None:
        o = self.environment.parsed_options
        if o.qps <= 0:
            raise ValueError(f"--qps must be > 0, got {o.qps}")
        if not 0.0 <= o.stream_share <= 1.0:
            raise ValueError(f"--stream-share must be in [0, 1], got {o.stream_share}")
        self.opts = o
        self.rate = o.qps / max(1, o.num_users or 1)
        self.rng = random.Random(o.seed * 7919 + id(self) % 7919)
        self.model = o.model_id or _served_model(self.host, o.api_key)
        self.headers = {"Authorization": f"Bearer {o.api_key}"} if o.api_key else {}
        self.count = 0
        self._pace = constant_throughput(self.rate)

    def wait_time(self) -> float:
        return self._pace(self) if self.opts.arrival == "users" else 0.0

    @task
    def offer(self) -> None:
        if self.opts.arrival == "users":
            now = time.perf_counter()
            self.send(now)
            return
        self.open_loop()

    def open_loop(self) -> None:
        """Requests at their due times, each in its own greenlet, for --duration seconds (or
        until the test stops); then wait for the answers and end the test."""
        o = self.opts
        pool = gevent.pool.Pool()
        start = time.perf_counter()
        end = start + o.duration if o.duration > 0 else math.inf
        due = start + self.rng.random() / self.rate  # users start out of step
        while due < end:
            delay = due - time.perf_counter()
            if delay > 0:
                gevent.sleep(delay)
            pool.spawn(self.send, due)
            due += self.rng.expovariate(self.rate) if o.arrival == "poisson" else 1.0 / self.rate
        pool.join(timeout=o.request_timeout + 5)
        TALLY.users_done += 1
        if TALLY.users_done >= (o.num_users or 1) and self.environment.runner is not None:
            gevent.spawn(self.environment.runner.quit)
        raise StopUser()

    def body(self, stream: bool) -> dict[str, Any]:
        i = self.count
        self.count += 1
        o = self.opts
        return {
            "model": self.model,
            "prompt": o.prompt.format(i=i % 100),
            "max_tokens": o.max_tokens,
            "temperature": o.temperature,
            "stream": stream,
        }

    def send(self, due: float) -> None:
        """One request, timed from `due`."""
        TALLY.due(due, time.perf_counter())
        stream = self.rng.random() < self.opts.stream_share
        ok = self.streamed(due) if stream else self.plain(due)
        TALLY.done(ok)

    def stale(self, response: Any, may_retry: bool) -> bool:
        """A pooled keep-alive connection the server had closed (uvicorn closes one idle for
        5 s; reusing it as it closes gets no answer): report it under `retried connection`
        and send the request once more on a fresh one, as HTTP clients do. Nothing reached
        the server's app, so the retry is not a second completion."""
        error = type(getattr(response, "error", None)).__name__
        if not may_retry or response.status_code or error not in STALE_CONNECTION:
            return False
        response.request_meta["name"] = RETRIED
        response.success()
        return True

    def plain(self, due: float, may_retry: bool = True) -> bool:
        with self.client.post(
            "/v1/completions",
            name="completions",
            json=self.body(False),
            headers=self.headers,
            catch_response=True,
        ) as response:
            response.request_meta["response_time"] = (time.perf_counter() - due) * 1000
            retry = self.stale(response, may_retry)
            if not retry:
                return answered(response)
        return self.plain(due, may_retry=False) if retry else False

    def streamed(self, due: float, may_retry: bool = True) -> bool:
        with self.client.post(
            "/v1/completions",
            name="completions stream",
            json=self.body(True),
            headers=self.headers,
            catch_response=True,
            stream=True,
        ) as response:
            if response.status_code != 200:
                response.request_meta["response_time"] = (time.perf_counter() - due) * 1000
                if self.stale(response, may_retry):
                    return self.streamed(due, may_retry=False)
                response.failure(refusal(response))
                return False
            try:
                head = response.read(6)  # blocks only until the first event's first bytes
                first = time.perf_counter()
                rest = response.read()
            except Exception as exc:  # the connection broke mid-stream
                response.request_meta["response_time"] = (time.perf_counter() - due) * 1000
                response.failure(f"stream broke: {type(exc).__name__}")
                return False
            response.request_meta["response_time"] = (time.perf_counter() - due) * 1000
            response.request_meta["response_length"] = len(head) + len(rest)
            if head != b"data: " or not rest.rstrip().endswith(b"data: [DONE]"):
                response.failure("not an SSE stream ending in data: [DONE]")
                return False
        self.environment.events.request.fire(
            request_type="SSE",
            name="ttft",
            response_time=(first - due) * 1000,
            response_length=0,
            exception=None,
            context={},
        )
        return True
