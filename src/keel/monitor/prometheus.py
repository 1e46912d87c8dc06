"""The Prometheus exporter: a Monitor sink that serves each step's metrics on /metrics.

Names and labels follow `keel.monitor.prom_names`. Process memory and CPU (and GPU memory and
utilisation when torch sees a GPU) are read at scrape time. `/healthz` answers 200 while the
process lives, with the step and the seconds since it was logged. On the Ray backend the
workers' own device readings (keel.monitor.devices) come in once per step through
`log_devices` and are served as the `keel_worker_*` series, labelled by role, rank and node.
"""

from __future__ import annotations

import json
import logging
import math
import resource
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from keel.monitor.devices import DeviceReading, max_rss_bytes, rss_bytes
from keel.monitor.prom_names import (
    BASE_LABELS,
    LAST_STEP_TIME,
    RUN_INFO,
    STEP,
    WORKER_LABELS,
    WORKER_SERIES,
    PromMetric,
    prom_metric,
)

log = logging.getLogger(__name__)


class ExporterError(ValueError):
    """The exporter cannot listen where monitor.prometheus says."""


class PrometheusSink:
    """Exports metrics under labels run=`run`, algorithm=`algorithm` (and role per metric)."""

    def __init__(self, *, run: str, algorithm: str, host: str = "127.0.0.1", port: int = 0):
        self.base = {"run": run, "algorithm": algorithm}
        self.registry = CollectorRegistry(auto_describe=False)
        self.families: dict[str, Gauge | Counter] = {}
        self.specs: dict[str, PromMetric] = {}
        self.totals: dict[str, float] = {}
        self.skipped: set[str] = set()
        self.step = Gauge(STEP, "last logged training step", BASE_LABELS, registry=self.registry)
        self.last_time = Gauge(
            LAST_STEP_TIME, "unix time the last step was logged", BASE_LABELS,
            registry=self.registry,
        )  # fmt: skip
        info = Gauge(RUN_INFO, "1 for the run being exported", BASE_LABELS, registry=self.registry)
        info.labels(**self.base).set(1)
        self.registry.register(ProcessCollector(self.base))
        self.workers = {
            field: Gauge(name, help, WORKER_LABELS, registry=self.registry)
            for field, (name, help) in WORKER_SERIES.items()
        }
        self.last_step: tuple[int, float] | None = None
        self._lock = threading.Lock()  # a scrape sees one logged step whole, never half of one
        self.server = _serve(self, host, port)
        self.host, self.port = self.server.server_address[:2]
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        with self._lock:
            for key, value in metrics.items():
                self._export(key, value)
            now = time.time()
            self.step.labels(**self.base).set(step)
            self.last_time.labels(**self.base).set(now)
            self.last_step = (step, now)

    def log_devices(self, step: int, readings: Sequence[DeviceReading]) -> None:
        """The workers' device readings of `step`: the keel_worker_* series hold exactly these
        (a worker gone since, e.g. before a restart, leaves no stale series behind)."""
        with self._lock:
            for gauge in self.workers.values():
                gauge.clear()
            for reading in readings:
                labels = {**self.base, **reading.labels()}
                for field, gauge in self.workers.items():
                    value = getattr(reading, field)
                    if value is not None:
                        gauge.labels(**labels).set(value)

    def _export(self, key: str, value: float) -> None:
        spec = prom_metric(key)
        family = self._family(key, spec)
        if family is None:
            return
        labels = {**self.base, "role": spec.role} if spec.role else self.base
        value *= spec.scale
        child = family.labels(**labels)
        if isinstance(child, Gauge):  # spec.kind == "gauge" (see _family)
            child.set(value)
        elif math.isfinite(value):
            delta = value if spec.kind == "increment" else value - self.totals.get(key, 0.0)
            self.totals[key] = value
            if delta > 0:
                child.inc(delta)

    def _family(self, key: str, spec: PromMetric) -> Gauge | Counter | None:
        family = self.families.get(spec.name)
        if family is not None:
            known = self.specs[spec.name]
            if (known.labels, known.kind) == (spec.labels, spec.kind):
                return family
            if key not in self.skipped:
                self.skipped.add(key)
                log.warning("metric %s clashes with %s and is not exported", key, spec.name)
            return None
        cls = Gauge if spec.kind == "gauge" else Counter
        name = spec.name.removesuffix("_total") if cls is Counter else spec.name
        family = cls(name, spec.help, spec.labels, registry=self.registry)
        self.families[spec.name], self.specs[spec.name] = family, spec
        return family

    def scrape(self) -> bytes:
        """The /metrics page, as Prometheus receives it: the values of one logged step (a scrape
        waits while a step is being logged, so keel_step always matches the values beside it)."""
        with self._lock:
            return generate_latest(self.registry)

    def health(self) -> dict:
        out: dict = {"status": "ok", "run": self.base["run"]}
        if self.last_step is not None:
            out["step"] = self.last_step[0]
            out["seconds_since_step"] = round(time.time() - self.last_step[1], 3)
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def check_listen(host: str, port: int) -> None:
    """Raises ExporterError now if the exporter could not listen on host:port."""
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as exc:
        raise _listen_error(host, port, exc) from exc


def _listen_error(host: str, port: int, exc: OSError) -> ExporterError:
    return ExporterError(
        f"monitor.prometheus: cannot listen on {host}:{port} ({exc.strerror or exc}); "
        "choose another monitor.prometheus.port (0 picks a free one)"
    )


def _serve(sink: PrometheusSink, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, sink.scrape(), CONTENT_TYPE_LATEST)
            elif path == "/healthz":
                self._reply(200, json.dumps(sink.health()).encode(), "application/json")
            else:
                self._reply(404, b"keel exporter: try /metrics or /healthz\n", "text/plain")

        def _reply(self, code: int, body: bytes, ctype: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # no access log on stderr
            pass

    try:
        server = ThreadingHTTPServer((host, port), Handler)
    except OSError as exc:
        raise _listen_error(host, port, exc) from exc
    server.daemon_threads = True
    return server


class ProcessCollector:
    """Process memory and CPU, and GPU memory/utilisation when torch sees a GPU, at scrape time."""

    def __init__(self, labels: Mapping[str, str]):
        self.names, self.values = list(labels), list(labels.values())

    def collect(self) -> Iterator[Metric]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        yield self._gauge("keel_process_resident_memory_bytes", "resident memory", rss_bytes())
        yield self._gauge(
            "keel_process_max_resident_memory_bytes", "peak resident memory", max_rss_bytes()
        )
        cpu = CounterMetricFamily("keel_process_cpu_seconds", "CPU time", labels=self.names)
        cpu.add_metric(self.values, usage.ru_utime + usage.ru_stime)
        yield cpu
        yield from self._gpu()

    def _gpu(self) -> Iterator[Metric]:
        import torch

        if not torch.cuda.is_available():
            return
        device = torch.cuda.current_device()
        yield self._gauge(
            "keel_gpu_memory_allocated_bytes", "GPU memory held by tensors",
            torch.cuda.memory_allocated(device),
        )  # fmt: skip
        yield self._gauge(
            "keel_gpu_memory_reserved_bytes", "GPU memory reserved by the caching allocator",
            torch.cuda.memory_reserved(device),
        )  # fmt: skip
        try:
            util = torch.cuda.utilization(device) / 100.0
        except Exception:  # needs NVML (pynvml); without it there is no utilisation reading
            return
        yield self._gauge("keel_gpu_utilization_ratio", "GPU busy fraction, 0..1", util)

    def _gauge(self, name: str, help: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, help, labels=self.names)
        g.add_metric(self.values, float(value))
        return g
