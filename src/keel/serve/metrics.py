"""The Prometheus series of `keel serve` (GET /metrics), on the server's own registry.

Names follow the training exporter's rules (keel.monitor.prom_names): `keel_` prefix, seconds in
`_seconds`, counters in `_total`; every serving series starts with `keel_serve_`."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from keel.serve.batching import BatchReport

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
RATE_WINDOW_S = 10.0  # keel_serve_tokens_per_second: generated tokens over the last 10 s

# Every serving series (docs/metrics.md lists them; tests/serve checks /metrics has them).
NAMES = (
    "keel_serve_request_duration_seconds", "keel_serve_requests_total",
    "keel_serve_errors_total", "keel_serve_requests_in_flight", "keel_serve_queue_depth",
    "keel_serve_pending_requests", "keel_serve_prompt_tokens_total",
    "keel_serve_generated_tokens_total", "keel_serve_tokens_per_second",
    "keel_serve_batch_rows", "keel_serve_batch_duration_seconds", "keel_serve_model_step",
    "keel_serve_reloads_total", "keel_serve_info", "keel_serve_scored_items_total",
    "keel_serve_ready", "keel_serve_ttft_seconds", "keel_serve_live_rows",
)  # fmt: skip


class ServeMetrics:
    """The serving series; `observe_batch` is the batching queue's `on_batch` hook."""

    def __init__(self, model: str, folder: str):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.latency = Histogram(
            "keel_serve_request_duration_seconds", "request latency until the last byte",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "keel_serve_requests", "requests answered, by endpoint and status (HTTP status, or "
            "gRPC code name)",
            ["endpoint", "status"], registry=r,
        )  # fmt: skip
        self.errors = Counter(
            "keel_serve_errors", "requests refused or failed, by kind (the error code)",
            ["kind"], registry=r,
        )  # fmt: skip
        self.in_flight = Gauge(
            "keel_serve_requests_in_flight", "generation requests being answered", registry=r
        )
        self.queue_depth = Gauge(
            "keel_serve_queue_depth", "rows waiting for a generate call", registry=r
        )
        self.pending = Gauge(
            "keel_serve_pending_requests", "requests queued or generating", registry=r
        )
        self.prompt_tokens = Counter(
            "keel_serve_prompt_tokens", "prompt tokens of answered requests", registry=r
        )
        self.generated_tokens = Counter(
            "keel_serve_generated_tokens", "tokens the engine generated", registry=r
        )
        self.tokens_per_second = Gauge(
            "keel_serve_tokens_per_second",
            f"generated tokens per second over the last {RATE_WINDOW_S:g} s", registry=r,
        )  # fmt: skip
        self.batch_rows = Histogram(
            "keel_serve_batch_rows", "rows (prompts) per generate call (continuous: rows "
            "joining the decode batch at once)",
            buckets=BATCH_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_duration = Histogram(
            "keel_serve_batch_duration_seconds", "seconds of one generate call (continuous: "
            "of one join, the joining rows' prefill)",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.model_step = Gauge(
            "keel_serve_model_step", "training step of the served weights (-1: not a checkpoint)",
            registry=r,
        )  # fmt: skip
        self.reloads = Counter("keel_serve_reloads", "checkpoints loaded by --follow", registry=r)
        self.scored_items = Counter(
            "keel_serve_scored_items", "items scored (--reward: /v1/score, gRPC Score)", registry=r
        )
        self.ready = Gauge(
            "keel_serve_ready", "1 while /readyz answers 200 (the queue accepts work), 0 while "
            "it answers 503 (loading, draining)", registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "keel_serve_ttft_seconds", "time to first token: from a generation request's arrival "
            "in the queue to its first generated token (serve.batching=batch: to its whole "
            "answer, which is when its first token leaves)",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.live_rows = Gauge(
            "keel_serve_live_rows", "rows decoding now (serve.batching=continuous; 0 in batch)",
            registry=r,
        )  # fmt: skip
        self.info = Gauge("keel_serve_info", "1: the model served", ["model", "folder"], registry=r)
        self.model = model
        self.set_folder(folder)
        self._recent: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self.tokens_per_second.set_function(self._rate)

    def watch_queue(self, depth: Callable[[], int], pending: Callable[[], int]) -> None:
        self.queue_depth.set_function(depth)
        self.pending.set_function(pending)

    def watch_live(self, live: Callable[[], int]) -> None:
        """keel_serve_live_rows reads `live()` at every scrape."""
        self.live_rows.set_function(live)

    def watch_ready(self, ready: Callable[[], bool]) -> None:
        """keel_serve_ready reads `ready()` (the condition of /readyz) at every scrape."""
        self.ready.set_function(lambda: 1.0 if ready() else 0.0)

    def set_folder(self, folder: str) -> None:
        """keel_serve_info names `folder` (a --follow swap replaces the old series)."""
        self.info.clear()
        self.info.labels(model=self.model, folder=folder).set(1)

    def set_step(self, step: int | None) -> None:
        self.model_step.set(-1 if step is None else step)

    def observe_batch(self, report: BatchReport) -> None:
        self.batch_rows.observe(report.rows)
        self.batch_duration.observe(report.seconds)

    def add_tokens(self, prompt: int, generated: int) -> None:
        """Tokens of one answered request."""
        self.prompt_tokens.inc(prompt)
        self.generated_tokens.inc(generated)
        now = time.monotonic()
        with self._lock:
            self._recent.append((now, generated))

    def error(self, kind: str) -> None:
        self.errors.labels(kind=kind).inc()

    def answered(self, endpoint: str, status: str, seconds: float) -> None:
        """One request answered (the HTTP middleware and the gRPC servicer)."""
        self.latency.labels(endpoint=endpoint).observe(seconds)
        self.requests.labels(endpoint=endpoint, status=status).inc()

    def exposition(self) -> tuple[bytes, str]:
        """The text format and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def _rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / RATE_WINDOW_S
