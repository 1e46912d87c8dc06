"""`keel serve` for the tests, on 127.0.0.1: a real process (`LiveServer`, port 0: the port it
prints), or the same app and gRPC server in the test's process (`InProcessServer`), whose
batching queue a test can pause to gather requests deterministically. Both are spoken to over
real sockets (`ServerClient`)."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"keel serve: .* on (https?)://127\.0\.0\.1:(\d+)")


class ServerClient:
    """HTTP(S) requests to a server on 127.0.0.1:`port`, and its /metrics."""

    scheme: str = "http"
    port: int
    cafile: Path | None = None

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/v1"

    def connection(self, timeout: float = 60) -> http.client.HTTPConnection:
        if self.scheme == "https":
            context = ssl.create_default_context(cafile=str(self.cafile))
            return http.client.HTTPSConnection("127.0.0.1", self.port, timeout=timeout,
                                               context=context)  # fmt: skip
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(
        self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        """(status, parsed JSON or text); `body` a dict (sent as JSON) or raw bytes."""
        conn = self.connection()
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        sent = {"Content-Type": "application/json", **(headers or {})}
        try:
            conn.request(method, path, body=data, headers=sent)
            response = conn.getresponse()
            raw = response.read().decode()
        finally:
            conn.close()
        try:
            return response.status, json.loads(raw)
        except json.JSONDecodeError:
            return response.status, raw

    def metric(self, name: str) -> float:
        """The sum of every sample of the series `name` on /metrics."""
        _, text = self.request("GET", "/metrics")
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total


class LiveServer(ServerClient):
    """`python -m keel.cli.main serve MODEL --port 0 ARGS…`; its stderr goes to a log file."""

    def __init__(self, model: str | Path, *args: str, log: Path, env: dict[str, str] | None = None,
                 cafile: Path | None = None):  # fmt: skip
        self.log = log
        self.cafile = cafile
        environ = {**os.environ, "PYTHONPATH": str(REPO / "src"), "OMP_NUM_THREADS": "1"}
        environ.update(env or {})
        cmd = [sys.executable, "-m", "keel.cli.main", "serve", str(model), "--port", "0", *args]
        self.out = log.open("w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=environ, stdout=self.out, stderr=self.out)
        self.scheme, self.port = self._wait_listening(timeout=240)

    def _wait_listening(self, timeout: float) -> tuple[str, int]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = LISTENING.search(self.log.read_text())
            if found:
                return found.group(1), int(found.group(2))
            if self.proc.poll() is not None:
                raise RuntimeError(f"keel serve exited {self.proc.returncode}:\n{self.text()}")
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"keel serve did not start in {timeout} s:\n{self.text()}")

    def text(self) -> str:
        return self.log.read_text()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()
        return self.proc.returncode


class InProcessServer(ServerClient):
    """`keel serve MODEL --set KEY=VALUE…` (args: the "--set", "KEY=VALUE" pairs of the CLI) in
    this process: the app on uvicorn in a thread and, with `grpc_port`, the gRPC server, both
    on the one `served` policy, so a test can hold its batching queue (`held`)."""

    def __init__(self, model: str | Path, *args: str, grpc_port: int = 0):
        import uvicorn

        from keel.checkpoint.policy import PolicySource
        from keel.serve.app import build_app
        from keel.serve.config import load_serve_config
        from keel.serve.policy import ServedPolicy

        overrides = [a for a in args if a != "--set"]
        cfg = load_serve_config(None, overrides)
        name = cfg.serve.model_name or Path(model).name
        self.served = ServedPolicy(PolicySource(Path(model)), cfg, name)
        self.grpc, self.grpc_port = None, grpc_port
        if grpc_port:
            from keel.serve.grpc_server import start_grpc

            self.grpc = start_grpc(self.served, cfg.serve, "127.0.0.1", grpc_port)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(build_app(self.served, cfg.serve), log_level="warning",
                                access_log=False, lifespan="on")  # fmt: skip
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)  # fmt: skip
        self.thread.start()
        wait_until(lambda: self.server.started, "the in-process server to start")

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The batching queue paused inside the block: requests sent meanwhile queue up, and
        go together (as batching allows) when it ends."""
        self.served.queue.pause()
        try:
            yield
        finally:
            self.served.queue.resume()

    def wait_pending(self, count: int) -> None:
        """Wait until `count` requests are queued (or generating)."""
        queue = self.served.queue
        wait_until(lambda: queue.pending >= count, f"{count} requests to be queued")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)
        if self.grpc is not None:
            self.grpc.stop(0)
        self.served.close(timeout=30)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
    """Poll `condition` (a state, never a duration) until it holds; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
