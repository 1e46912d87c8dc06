"""Two `keel serve` replicas behind HAProxy, and steady load through it: the parts of the
availability bench (bench/serve_availability.py) and of its test (tests/serve/test_availability.py),
which runs the same scenarios at a smaller load.

- `Replica`: one `keel serve` process on a fixed port, so that a restart comes back at the
  address the balancer knows; started without waiting, so that two load in parallel.
- `haproxy_config` / `Balancer`: HAProxy (Debian's package, scripts/install-test-tools) in front
  of the replicas, started as a child process (`haproxy -f CFG -db`) on free ports. It checks
  `GET /readyz` of each replica every few hundred milliseconds, so a draining replica (503) or
  a stopped one (connection refused) leaves the rotation within a second, and retries a request
  that a replica refused (connection refused, closed without an answer, or 503 while draining)
  on the other replica. Every answer carries the replica that gave it (`X-Served-By`).
- `SteadyLoad`: open-loop completions at a fixed rate (one every 1/QPS s, whether or not earlier
  ones have finished), each outcome recorded with when it was due, its latency, status, the
  replica and the checkpoint step (`system_fingerprint`) that answered; `event` marks the span
  of a rolling restart or a swap on the same clock.
- `rolling_restart` (SIGTERM one replica, start it again, wait until the balancer has it back,
  then the next) and `swap_checkpoint` (write a newer checkpoint into the run directory the
  replicas `--follow`, wait until each serves it): the two events measured.

Retrying a POST /v1/completions is safe here because generation has no side effect: a request a
replica refused or dropped before answering changed nothing but that replica's counters, and the
client only ever sees the one answer that reached it (HAProxy retries only before any byte of the
answer has been forwarded). HAProxy does not retry a request whose answer was merely slow
(`response-timeout` is left out), which would double the work under load."""

from __future__ import annotations

import contextlib
import csv
import http.client
import io
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SERVED_BY = "X-Served-By"  # the response header naming the replica that answered
STOPPED = b"keel serve: stopped"  # what keel serve prints once its drain is over


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on 127.0.0.1 now, below the kernel's ephemeral range
    (ip_local_port_range), so that while a replica restarts no outgoing connection is given its
    port as a local one."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    ports: list[int] = []
    for _ in range(1000):
        port = rng.randrange(10000, max(low, 10001))
        if port in ports:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == count:
            return ports
    raise RuntimeError(f"no {count} free ports between 10000 and {low} on 127.0.0.1")


def get_json(port: int, path: str, timeout: float = 10) -> tuple[int, Any]:
    """GET http://127.0.0.1:`port``path` → (status, parsed JSON body or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        raw = response.read().decode()
    finally:
        conn.close()
    try:
        return response.status, json.loads(raw)
    except json.JSONDecodeError:
        return response.status, raw


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 240) -> None:
    """Poll `condition` (a state, never a duration) until it holds; RuntimeError after
    `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


# ------------------------------------------------------------------------------- replicas
class Replica:
    """`keel serve MODEL ARGS… --host 127.0.0.1 --port PORT` (stdout and stderr appended to
    `log`); `start` returns at once, `wait_ready` waits for /readyz 200."""

    def __init__(self, name: str, model: str | Path, args: list[str], port: int, log: Path,
                 env: dict[str, str] | None = None):  # fmt: skip
        self.name, self.model, self.args, self.port, self.log = name, model, args, port, log
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            **(env or {}),
        }
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._log_from = 0

    def start(self) -> None:
        cmd = [sys.executable, "-m", "keel.cli.main", "serve", str(self.model), *self.args,
               "--host", "127.0.0.1", "--port", str(self.port)]  # fmt: skip
        self._log_from = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=out, stderr=out)
        self.starts += 1

    def drained(self) -> bool:
        """Whether the process last started has said `keel serve: stopped` (its drain is over
        and its port free; the interpreter may still be exiting) or has exited."""
        assert self.proc is not None, "start() first"
        if self.proc.poll() is not None:
            return True
        with self.log.open("rb") as log:
            log.seek(self._log_from)
            return STOPPED in log.read()

    def ready(self) -> bool:
        """Whether /readyz answers 200 (RuntimeError when the process has exited)."""
        assert self.proc is not None, "start() first"
        if self.proc.poll() is not None:
            raise RuntimeError(
                f"replica {self.name}: keel serve exited {self.proc.returncode}:\n{self.text()}"
            )
        try:
            return get_json(self.port, "/readyz", timeout=5)[0] == 200
        except OSError:  # not listening yet (the model loads before the server listens)
            return False

    def wait_ready(self, timeout: float = 240) -> None:
        wait_for(self.ready, f"replica {self.name} to be ready", timeout)

    def step(self) -> int | None:
        """The training step of the weights it serves (/readyz), None when it does not answer."""
        try:
            status, body = get_json(self.port, "/readyz", timeout=5)
        except OSError:
            return None
        return body.get("step") if status == 200 and isinstance(body, dict) else None

    def terminate(self) -> None:
        """SIGTERM (the graceful drain), without waiting."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 90) -> int:
        """SIGTERM and wait; the exit status (killed after `timeout` s)."""
        assert self.proc is not None, "start() first"
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


def start_replicas(replicas: list[Replica], timeout: float = 240) -> None:
    """Start every replica at once (they load in parallel) and wait until each is ready."""
    for replica in replicas:
        replica.start()
    for replica in replicas:
        replica.wait_ready(timeout)


def stop_replicas(replicas: list[Replica]) -> None:
    """SIGTERM every started replica at once, then wait for each."""
    started = [r for r in replicas if r.proc is not None]
    for replica in started:
        replica.terminate()
    for replica in started:
        replica.stop()


# ------------------------------------------------------------------------------- HAProxy
def haproxy_binary() -> str:
    """The haproxy program: on PATH, else Debian's /usr/sbin/haproxy."""
    found = shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)), None
    )
    if found is None:
        raise RuntimeError("haproxy not found: run scripts/install-test-tools (Debian's haproxy)")
    return found


def haproxy_config(
    servers: dict[str, int],
    port: int,
    stats_port: int,
    *,
    check_interval_ms: int = 250,
    fall: int = 2,
    rise: int = 2,
    retries: int = 3,
) -> str:
    """haproxy.cfg: the frontend on 127.0.0.1:`port`, round robin over `servers` (name →
    port on 127.0.0.1) with a /readyz check every `check_interval_ms` (out after `fall` misses
    in a row, back after `rise` answers of 200), a request refused by one replica retried up to
    `retries` times, each on another replica (0: never retried, the balancer's health checks
    alone); the CSV stats on `stats_port` (/stats;csv)."""
    retrying = [
        # the whole body is read before a server is picked, so the request can be sent again
        "    option http-buffer-request",
        f"    retries {retries}",
        "    retry-on conn-failure empty-response 503",
        "    option redispatch 1",  # every retry goes to another server
    ]
    lines = [
        "global",
        "    maxconn 2048",
        "defaults",
        "    mode http",
        "    timeout connect 1s",
        "    timeout client 60s",
        "    timeout server 60s",
        "    timeout http-request 10s",
        "    timeout check 2s",
        *(retrying if retries > 0 else ["    retries 0", "    retry-on none"]),
        "frontend api",
        f"    bind 127.0.0.1:{port}",
        "    default_backend keel",
        "backend keel",
        "    balance roundrobin",
        "    option httpchk GET /readyz",
        "    http-check expect status 200",
        f"    http-response set-header {SERVED_BY} %s",
        f"    default-server check inter {check_interval_ms} fastinter {check_interval_ms} "
        f"downinter {check_interval_ms} fall {fall} rise {rise}",
        *(f"    server {name} 127.0.0.1:{p}" for name, p in servers.items()),
        "frontend stats",
        f"    bind 127.0.0.1:{stats_port}",
        "    stats enable",
        "    stats uri /stats",
    ]
    return "\n".join(lines) + "\n"


class Balancer:
    """HAProxy in front of `servers` (name → port), run in the foreground as a child process
    from a config written into `folder`; its log goes to `folder`/haproxy.log."""

    def __init__(self, servers: dict[str, int], folder: Path, **options: int):
        self.port, self.stats_port = free_ports(2)
        self.config = folder / "haproxy.cfg"
        self.config.write_text(haproxy_config(servers, self.port, self.stats_port, **options))
        self.log = folder / "haproxy.log"
        binary = haproxy_binary()
        check = subprocess.run([binary, "-c", "-q", "-f", str(self.config)],
                               capture_output=True, text=True)  # fmt: skip
        if check.returncode != 0:
            raise RuntimeError(f"{self.config}: haproxy rejects it:\n{check.stderr}")
        with self.log.open("w") as out:
            self.proc = subprocess.Popen([binary, "-f", str(self.config), "-db"],
                                         stdout=out, stderr=out)  # fmt: skip
        try:
            wait_for(self._listening, "haproxy to listen", timeout=30)
        except BaseException:
            self.stop()
            raise

    def _listening(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"haproxy exited {self.proc.returncode}:\n{self.log.read_text()}")
        try:
            return get_json(self.stats_port, "/stats;csv")[0] == 200
        except OSError:
            return False

    def stats(self) -> dict[str, dict[str, str]]:
        """The backend's rows of HAProxy's CSV stats, by server name (and BACKEND): status
        (UP, DOWN, …), stot (requests sent), hrsp_2xx, wretr (retries), wredis
        (redispatches), chkdown (times it went down), …"""
        status, text = get_json(self.stats_port, "/stats;csv")
        if status != 200:
            raise RuntimeError(f"haproxy stats: HTTP {status}")
        rows = csv.DictReader(io.StringIO(text.removeprefix("# ")))
        return {row["svname"]: row for row in rows if row["pxname"] == "keel"}

    def status(self, server: str) -> str:
        return self.stats()[server]["status"]

    def wait_up(self, server: str, timeout: float = 60) -> None:
        wait_for(lambda: self.status(server) == "UP", f"haproxy to put {server} back", timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ------------------------------------------------------------------------------- load
@dataclass(frozen=True)
class Outcome:
    """One request: due_s (when it was due to leave, s since the load began), latency_s (due →
    last byte), status (None: no HTTP answer), error (None: a 200; else `http_STATUS` or the
    exception's name), replica (X-Served-By), step (from system_fingerprint keel-step-N)."""

    due_s: float
    latency_s: float
    status: int | None
    error: str | None
    replica: str | None = None
    step: int | None = None


@dataclass(frozen=True)
class Event:
    """A span on the load's clock (s since it began): a rolling restart, a swap."""

    name: str
    start_s: float
    end_s: float


@dataclass
class SteadyLoad:
    """POST /v1/completions to 127.0.0.1:`port` at `qps`, open loop, from a pool of threads
    (one connection per request), from `start` until `stop`, which returns every outcome."""

    port: int
    model: str
    qps: float
    max_tokens: int = 4
    timeout_s: float = 60.0
    workers: int = 64
    outcomes: list[Outcome] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="load")
        self._thread = threading.Thread(target=self._schedule, name="load-clock", daemon=True)
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def start(self) -> SteadyLoad:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def stop(self) -> list[Outcome]:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=True)
        return sorted(self.outcomes, key=lambda o: o.due_s)

    def answered(self, condition: Callable[[Outcome], bool] = lambda o: True) -> int:
        """How many outcomes so far meet `condition`."""
        with self._lock:
            return sum(1 for o in self.outcomes if condition(o))

    @contextlib.contextmanager
    def event(self, name: str) -> Iterator[None]:
        """Mark the block's span as the event `name`."""
        start = self.now()
        try:
            yield
        finally:
            self.events.append(Event(name, start, self.now()))

    def _schedule(self) -> None:
        i = 0
        while not self._stop.is_set():
            due = i / self.qps
            delay = due - self.now()
            if delay > 0 and self._stop.wait(delay):
                break
            self._pool.submit(self._one, due, i)
            i += 1

    def _one(self, due: float, i: int) -> None:
        body = {"model": self.model, "prompt": f"{i % 100}+{i % 7}=", "max_tokens": self.max_tokens}
        status = replica = step = None
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout_s)
            try:
                conn.request("POST", "/v1/completions", body=json.dumps(body),
                             headers={"Content-Type": "application/json"})  # fmt: skip
                response = conn.getresponse()
                raw = response.read()
            finally:
                conn.close()
            status, replica = response.status, response.getheader(SERVED_BY)
            error = None if status == 200 else f"http_{status}"
            if status == 200:
                fingerprint = json.loads(raw).get("system_fingerprint") or ""
                step = int(fingerprint.rsplit("-", 1)[1]) if "step" in fingerprint else None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            error = type(exc).__name__
        outcome = Outcome(due, self.now() - due, status, error, replica, step)
        with self._lock:
            self.outcomes.append(outcome)


# ------------------------------------------------------------------------------- events
def rolling_restart(replicas: list[Replica], balancer: Balancer, load: SteadyLoad | None = None,
                    timeout: float = 240) -> None:  # fmt: skip
    """One replica at a time: SIGTERM (it drains and exits 0), start it again once its drain is
    over (while the old interpreter finishes exiting), wait until it is ready and HAProxy has it
    back in rotation; then the next. With `load`, each replica's turn is marked as the event
    `restart NAME`."""
    for replica in replicas:
        with load.event(f"restart {replica.name}") if load else contextlib.nullcontext():
            old = replica.proc
            assert old is not None, "start the replicas first"
            replica.terminate()
            wait_for(replica.drained, f"replica {replica.name} to drain", timeout)
            replica.start()
            try:
                code = old.wait(timeout)
            except subprocess.TimeoutExpired:
                old.kill()
                code = old.wait()
            if code != 0:
                raise RuntimeError(
                    f"replica {replica.name} exited {code} on SIGTERM:\n{replica.text()}"
                )
            replica.wait_ready(timeout)
            balancer.wait_up(replica.name)


def write_checkpoint(run_dir: Path, step: int, model: Path, scale: float = 1.0) -> Path:
    """A complete healthy checkpoint `run_dir`/checkpoints/step_N whose actor/ is the HF folder
    `model` with every floating weight multiplied by `scale` (written as a training run writes
    one: into a temporary folder, sealed, renamed into place, then `latest`)."""
    from safetensors.torch import load_file, save_file

    from keel.checkpoint.export import publish_folder, step_folder_name
    from keel.checkpoint.state import seal_folder, write_latest

    root = run_dir / "checkpoints"

    def write(tmp: Path) -> None:
        shutil.copytree(model, tmp / "actor")
        weights = tmp / "actor" / "model.safetensors"
        state = load_file(weights)
        save_file({k: v * scale if v.is_floating_point() else v for k, v in state.items()},
                  weights, metadata={"format": "pt"})  # fmt: skip
        (tmp / "config.yaml").write_text("{}\n")
        seal_folder(tmp, {"step": step, "healthy": True, "time": time.time(), "metrics": {}})

    path = publish_folder(root / step_folder_name(step), write)
    write_latest(root, path.name)
    return path


def swap_checkpoint(run_dir: Path, step: int, model: Path, replicas: list[Replica],
                    timeout: float = 120) -> None:  # fmt: skip
    """Write checkpoint `step` into the run the replicas follow; wait until each serves it."""
    write_checkpoint(run_dir, step, model, scale=1.0 + 0.01 * step)
    for replica in replicas:
        what = f"{replica.name} to serve step {step}"
        wait_for(lambda r=replica: r.step() == step, what, timeout)


# ------------------------------------------------------------------------------- figures
def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of `values` by the nearest-rank method; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q * len(ordered) + 0.5) - 1))
    return ordered[rank]


def summarize(outcomes: list[Outcome], events: list[Event] | None = None) -> dict[str, Any]:
    """Requests, successes, success %, failures by kind, p50/p99 latency of the successes, and
    answers by replica; with `events`, the same for the requests due within each."""
    ok = [o.latency_s for o in outcomes if o.error is None]
    summary: dict[str, Any] = {
        "requests": len(outcomes),
        "ok": len(ok),
        "success_pct": round(100 * len(ok) / len(outcomes), 3) if outcomes else None,
        "failures": dict(Counter(o.error for o in outcomes if o.error is not None)),
        "p50_s": _round(percentile(ok, 0.50)),
        "p99_s": _round(percentile(ok, 0.99)),
        "max_s": _round(max(ok) if ok else None),
        "by_replica": dict(Counter(o.replica for o in outcomes if o.error is None)),
    }
    for event in events or []:
        within = [o for o in outcomes if event.start_s <= o.due_s <= event.end_s]
        summary[event.name] = {"span_s": round(event.end_s - event.start_s, 2),
                               **summarize(within)}  # fmt: skip
    return summary


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
