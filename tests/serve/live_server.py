"""A real `keel serve` process on 127.0.0.1 (port 0: the port it prints), for the tests."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"keel serve: .* on (https?)://127\.0\.0\.1:(\d+)")


class LiveServer:
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
        self.scheme, self.port = self._wait_listening(timeout=90)

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

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/v1"

    def text(self) -> str:
        return self.log.read_text()

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
