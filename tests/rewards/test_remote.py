"""Scoring through an HTTP reward service: a real server on 127.0.0.1 that scores, fails,
stalls and refuses as told, against the retries, time-outs and the error policy."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from keel.rewards import RewardError
from keel.rewards.remote import RemoteRewardScorer


class Service:
    """A reward service: score = len(response) + the answer; `plan` gives, per request, what
    to do instead: an HTTP status to fail with, "stall" (sleep past the client's time-out),
    "short" (one score too few); with `hang` set, every request waits for `release`."""

    def __init__(self):
        self.plan: list = []
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        self.hang = False
        self.release = threading.Event()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with service.lock:
                    service.requests.append(body)
                    service.headers.append(dict(self.headers))
                    action = service.plan.pop(0) if service.plan else None
                    service.in_flight += 1
                    service.max_in_flight = max(service.max_in_flight, service.in_flight)
                try:
                    time.sleep(0.05)  # long enough for concurrent requests to overlap
                    if service.hang:
                        service.release.wait(60)
                    if action == "stall":
                        time.sleep(1.0)
                    if isinstance(action, int):
                        self.reply(action, {"error": {"message": f"told to fail with {action}"}})
                        return
                    items = body["items"]
                    scores = [len(i["response"]) + float(i["answer"] or 0) for i in items]
                    self.reply(200, {"scores": scores[:-1] if action == "short" else scores})
                finally:
                    with service.lock:
                        service.in_flight -= 1

            def reply(self, status, payload):
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def service():
    s = Service()
    yield s
    s.release.set()
    s.server.shutdown()
    s.server.server_close()


ROWS = (
    ["p"] * 7,
    ["a", "bb", "ccc", "dddd", "e", "ff", "ggg"],
    ["1", "0", "1", "0", "1", "0", "1"],
)


def scorer(url, **kw):
    options = {"batch_size": 3, "backoff_s": 0.01, "request_timeout_s": 0.5, "retries": 2}
    return RemoteRewardScorer(url, **{**options, **kw})


def test_rows_are_scored_in_order_in_concurrent_batches_with_the_token(service):
    scores, errors = scorer(service.url, max_concurrency=2, api_key="s3cret").score(*ROWS)
    assert scores == [2.0, 2.0, 4.0, 4.0, 2.0, 2.0, 4.0] and errors == 0
    assert sorted(len(r["items"]) for r in service.requests) == [1, 3, 3]  # sent concurrently
    assert service.max_in_flight == 2  # two requests at once, never more
    assert all(h["Authorization"] == "Bearer s3cret" for h in service.headers)
    items = [i for r in service.requests for i in r["items"]]
    assert {"prompt": "p", "response": "a", "answer": "1"} in items and len(items) == 7


def test_transient_failures_are_retried_with_backoff(service):
    service.plan = [503, 429, "stall"]  # the first request fails three times, then succeeds
    start = time.perf_counter()
    scores, errors = scorer(service.url, retries=3, backoff_s=0.05).score(*ROWS)
    assert errors == 0 and scores[0] == 2.0
    assert len(service.requests) == 3 + 3  # 3 failed attempts, then 3 batches
    assert time.perf_counter() - start >= 0.05 + 0.1 + 0.2  # backoff 0.05 · 2^k


def test_a_request_that_keeps_failing_goes_through_the_error_policy(service):
    service.plan = [500] * 3
    with pytest.raises(RewardError, match=r"3 attempts failed, the last with HTTP 500"):
        scorer(service.url).score(*ROWS)
    service.plan = [500] * 3
    scores, errors = scorer(service.url, on_error="fallback", fallback_score=-1.0).score(*ROWS)
    assert scores[:3] == [-1.0] * 3 and scores[3:] == [4.0, 2.0, 2.0, 4.0] and errors == 3


def test_a_refusal_is_not_retried_and_says_why(service):
    service.plan = [401]
    with pytest.raises(RewardError, match=r"refused the request: HTTP 401: .*told to fail"):
        scorer(service.url).score(*ROWS)
    assert len(service.requests) == 1  # not retried, and under raise the step stopped there
    service.plan = [401]
    scores, errors = scorer(service.url, on_error="fallback", fallback_score=-1.0).score(*ROWS)
    assert errors == 3 and scores[3:] == [4.0, 2.0, 2.0, 4.0]
    assert len(service.requests) == 1 + 3  # one per batch: the refused one was not retried


def test_a_wrong_number_of_scores_and_a_dead_service_are_errors(service):
    service.plan = ["short"]
    with pytest.raises(RewardError, match="answered 2 instead of"):
        scorer(service.url).score(*ROWS)
    url = service.url
    service.server.shutdown()
    service.server.server_close()
    with pytest.raises(RewardError, match="3 attempts failed"):
        scorer(url).score(*ROWS)


def test_a_stalled_service_fails_the_step_after_about_one_timeout(service):
    """A service that accepts requests and never answers: 40 requests of one row, 0.25 s each
    (reward.timeout_s); the first time-out fails the step, naming reward.url and the limit
    (before: each request waited out its own, 40 × 0.25 s)."""
    service.hang = True
    rows = (["p"] * 40, ["r"] * 40, [None] * 40)
    slow = scorer(service.url, batch_size=1, timeout_s=0.25, request_timeout_s=0.1, retries=3)
    start = time.monotonic()
    with pytest.raises(RewardError) as info:
        slow.score(*rows)
    assert time.monotonic() - start < 40 * 0.25 / 2.5  # ≈ 0.25 s; serial would be 10 s
    message = str(info.value)  # the caller's deadline, or the request's own check of it first
    assert f"reward.url={service.url}" in message
    assert "0.25s (reward.timeout_s)" in message or "reward.timeout_s=0.25s" in message


def test_an_attempt_that_times_out_is_warned_about_and_retried(service, caplog):
    """Each attempt past reward.http.timeout_s is logged as it fails, naming reward.url and
    the limit; the retry that succeeds scores the rows."""
    import logging

    service.plan = ["stall"]
    with caplog.at_level(logging.WARNING, logger="keel.rewards"):
        out = scorer(service.url, batch_size=7, request_timeout_s=0.6).score(*ROWS)
    assert out[1] == 0 and len(service.requests) == 2  # the stall (1 s), then the retry
    (warning,) = [r.getMessage() for r in caplog.records]
    assert f"reward.url={service.url}" in warning and "reward.http.timeout_s=0.6s" in warning


def test_retries_stop_at_the_deadline_of_the_call(service):
    """A request whose retries cannot finish within reward.timeout_s fails when the next wait
    would pass it, and the thread it ran on does not go on retrying (no hung call)."""
    service.plan = [503] * 10
    slow = scorer(service.url, batch_size=7, timeout_s=1.0, retries=8, backoff_s=0.2,
                  on_error="fallback")  # fmt: skip
    start = time.monotonic()
    assert slow.score(*ROWS)[1] == 7
    assert time.monotonic() - start < 5  # 8 retries with these waits would take 51 s
    for _ in range(1000):  # its thread stops (at once, or soon after the caller's deadline)
        if slow.hung_calls() == 0:
            break
        time.sleep(0.01)
    assert slow.hung_calls() == 0
    assert len(service.requests) <= 4  # 0.2 + 0.4 fit in 1 s, 0.8 more does not


def test_grpo_trains_with_rewards_from_the_service(service, tiny_grpo):
    from keel.controller import run_training
    from keel.monitor import read_metrics

    cfg = tiny_grpo("train.steps=1", f"reward.url={service.url}", "reward.http.batch_size=5")
    run_training(cfg)
    rows = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    step = next(r for r in rows if r["step"] == 1)
    assert step["reward/mean"] > 0 and step["reward/errors"] == 0
    assert sum(len(r["items"]) for r in service.requests) >= 16  # the step's 16 rows
