"""`make bench`: the Prometheus exporter's cost per step and how soon Prometheus sees a step.

1. overhead: seconds per `PrometheusSink.log` call on a GRPO step's metrics (~35 keys), next
   to the JSONL sink, and seconds per /metrics scrape (served from a thread of the trainer).
2. visibility: a real Prometheus (Debian's `prometheus`) scrapes an exporter that logs a step
   every 0.25 s; the lag is the time from logging a step to reading it back through
   /api/v1/query (or a later step), for scrape intervals of 1 s and 5 s (expected: spread
   between 0 and the interval).
Prints one JSON line per measurement.

    python -m bench.exporter [--calls 2000] [--visibility 1:15,5:40]   # interval:duration, s
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

from keel.monitor import JsonlSink
from keel.monitor.prometheus import PrometheusSink

GRPO_KEYS = [
    "reward/mean", "reward/std", "reward/max", "reward/min", "reward/errors",
    "reward/all_equal_frac", "response/length_mean", "response/length_max",
    "response/clip_ratio", "advantage/mean", "advantage/abs_mean", "actor/pg_loss",
    "actor/entropy", "actor/kl", "actor/loss", "actor/clipfrac", "actor/clipfrac_lower",
    "actor/ppo_kl", "actor/grad_norm", "actor/lr", "actor/skipped", "timing/rollout_s",
    "timing/reward_s", "timing/old_logprobs_s", "timing/ref_logprobs_s", "timing/advantage_s",
    "timing/update_s", "timing/step_s", "perf/tokens_per_second", "guard/state", "guard/trips",
    "checkpoint/saved_at", "checkpoint/count", "checkpoint/save_s", "eval/accuracy",
]  # fmt: skip


def per_call(fn, n: int) -> float:
    times = []
    for i in range(n):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def overhead(n: int = 2000) -> None:
    metrics = {k: 0.1 * i for i, k in enumerate(GRPO_KEYS)}
    sink = PrometheusSink(run="bench", algorithm="grpo", port=0)
    with tempfile.TemporaryDirectory() as tmp:
        jsonl = JsonlSink(Path(tmp) / "metrics.jsonl")
        rows = {
            "prometheus_log_s": per_call(lambda i: sink.log(i, metrics), n),
            "jsonl_log_s": per_call(lambda i: jsonl.log(i, metrics), n // 4),
            "scrape_s": per_call(lambda i: sink.scrape(), n // 4),
        }
        jsonl.close()
    sink.close()
    for name, seconds in rows.items():
        print(json.dumps({"case": name, "median_s": round(seconds, 7), "keys": len(metrics)}))


def query(base: str, promql: str) -> list:
    url = f"{base}/api/v1/query?query={urllib.parse.quote(promql)}"
    with urllib.request.urlopen(url, timeout=2) as resp:
        return json.loads(resp.read())["data"]["result"]


def visibility(interval_s: float, duration_s: float, every: float = 0.25) -> None:
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        print(json.dumps({"case": "visibility", "error": "prometheus is not installed"}))
        return
    sink = PrometheusSink(run="bench", algorithm="grpo", port=0)
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(json.dumps({
            "global": {"scrape_interval": f"{interval_s:g}s"},
            "scrape_configs": [{"job_name": "keel", "static_configs": [
                {"targets": [f"127.0.0.1:{sink.port}"]}]}],
        }))  # fmt: skip
        web = f"127.0.0.1:{free_port()}"
        proc = subprocess.Popen(
            [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp}/tsdb",
             f"--web.listen-address={web}", "--log.level=error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            wait_ready(f"http://{web}", proc)
            lags = measure(sink, f"http://{web}", duration_s, every, interval_s)
        finally:
            proc.terminate()
            proc.wait()
            sink.close()
    print(json.dumps({
        "case": "visibility", "scrape_interval_s": interval_s, "step_every_s": every,
        "steps": len(lags),
        # None: no step logged after Prometheus' first scrape (a run shorter than its start)
        "median_s": round(statistics.median(lags), 3) if lags else None,
        "p90_s": round(statistics.quantiles(lags, n=10)[-1], 3) if len(lags) > 1 else None,
        "max_s": round(max(lags), 3) if lags else None,
    }))  # fmt: skip


def measure(sink: PrometheusSink, base: str, duration: float, every: float, interval: float):
    """Logs a step every `every` s for `duration` s; for each step N, the seconds from logging
    it to the first query that returns step N or a later one (from Prometheus' first scrape
    on; the first scrape comes up to a few seconds after the server is ready)."""
    logged: dict[int, float] = {}
    reads: list[tuple[float, int]] = []

    def trainer() -> None:
        step, end = 0, time.time() + duration
        while time.time() < end:
            step += 1
            sink.log(step, {"reward/mean": float(step)})
            logged[step] = time.time()
            time.sleep(every)

    thread = threading.Thread(target=trainer)
    thread.start()
    deadline = time.time() + duration + interval + 1
    while time.time() < deadline:
        for r in query(base, 'keel_step{run="bench"}'):
            reads.append((time.time(), int(float(r["value"][1]))))
        time.sleep(0.005)
    thread.join()
    lags: list[float] = []
    started = reads[0][0] if reads else math.inf  # steps before the first scrape don't count
    for step, at in logged.items():
        if at < started:
            continue
        first = next((t for t, seen in reads if seen >= step and t >= at), None)
        if first is not None:
            lags.append(first - at)
    return lags


def wait_ready(base: str, proc: subprocess.Popen) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with status {proc.returncode}")
        try:
            urllib.request.urlopen(f"{base}/-/ready", timeout=1)
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("prometheus did not become ready")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="log calls timed (overhead)")
    parser.add_argument(
        "--visibility", default="1:15,5:40",
        help="scrape interval:seconds of logging, comma-separated; '' for none",
    )  # fmt: skip
    args = parser.parse_args(argv)
    overhead(args.calls)
    for pair in filter(None, args.visibility.split(",")):
        interval, duration = (float(x) for x in pair.split(":"))
        visibility(interval, duration_s=duration)


if __name__ == "__main__":
    main()
