"""Open-loop load against an OpenAI-compatible server: `keel serve`, or any other.

Requests leave at a fixed rate (one every 1/QPS seconds, or Poisson arrivals with --poisson)
whether or not earlier ones have finished, so a slow server meets a growing queue instead of
slowing the client down. A request's latency runs from the moment it was due to leave to its
last byte, so time spent waiting behind the client is counted too. Reports the achieved QPS
(successful answers per second over the window), p50/p95/p99 latency, and errors by kind.

  # against a running server
  python -m bench.serve_load --url http://127.0.0.1:8000/v1 --qps 100 --duration 60
  # start `keel serve MODEL` on a free port first (stopped at the end)
  python -m bench.serve_load --serve builtin:tiny --qps 100 --duration 60 --max-tokens 8
  # step the rate up to find the knee: the highest QPS with p99 < 1 s and no errors
  python -m bench.serve_load --serve builtin:tiny --knee --qps 50 --qps-step 25 --duration 20
  # continuous batching against batch-at-a-time at one load, streamed (TTFT per request)
  python -m bench.serve_load --serve builtin:tiny --batching both --stream --qps 20 \
      --max-tokens 64 --duration 30

--batching (with --serve) sets serve.batching; `both` runs the load once per mode, each on a
fresh server. --stream asks for SSE streams and reports the time to the first chunk (TTFT,
from the moment the request was due) beside the latency to the last byte.

Prints one JSON line per load level (and a summary line with the knee). Needs aiohttp (the
`bench` extra).

The load tool of record is Locust (bench/locustfile.py, run by bench/serve_locust.py and `make
bench-serve`), which offers the same open loop. This script stays for what Locust does not
give: exact percentiles, from every latency by nearest rank (Locust's come from a histogram
that keeps two significant digits, so near the 1 s line a p99 of 0.996 s reads 1.0 s), the
generated tokens per second (from the answers' usage), and both batching modes, each on a fresh
server, in one command (--batching both)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
KNEE_P99_S = 1.0


@dataclass
class LevelResult:
    """One load level: target and achieved QPS, latency percentiles (s), errors by kind."""

    target_qps: float
    duration_s: float
    sent: int
    ok: int
    achieved_qps: float
    p50_s: float | None
    p95_s: float | None
    p99_s: float | None
    max_s: float | None
    errors: dict[str, int] = field(default_factory=dict)
    ttft_p50_s: float | None = None  # --stream: time to the first chunk
    ttft_p99_s: float | None = None
    tokens_per_s: float | None = None  # completion tokens answered per second (non-stream)
    batching: str | None = None  # --serve --batching: the mode it ran

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def holds(self) -> bool:
        """No errors and p99 under a second."""
        return self.error_count == 0 and self.p99_s is not None and self.p99_s < KNEE_P99_S


def percentile(sorted_values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) by the nearest-rank method."""
    if not sorted_values:
        return None
    rank = max(0, min(len(sorted_values) - 1, round(q * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]


def request_body(args: argparse.Namespace, model: str, i: int) -> tuple[str, dict]:
    prompt = args.prompt.format(i=i % 100)
    common = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature}
    if args.stream:
        common["stream"] = True
    if args.endpoint == "chat":
        return "/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}
    return "/completions", {**common, "prompt": prompt}


async def one_request(
    client: aiohttp.ClientSession, url: str, body: dict, due: float
) -> tuple[float, str | None, float | None, int]:
    """(latency from `due`, None or the error's kind, a stream's time from `due` to its first
    chunk, the completion tokens of a JSON answer)."""
    first, tokens = None, 0
    try:
        async with client.post(url, json=body) as response:
            kind = None if response.status == 200 else f"http_{response.status}"
            if body.get("stream") and kind is None:
                async for line in response.content:
                    if first is None and line.startswith(b"data: "):
                        first = time.perf_counter() - due
            else:
                raw = await response.read()
                if kind is None:
                    tokens = json.loads(raw).get("usage", {}).get("completion_tokens", 0)
    except (TimeoutError, aiohttp.ClientError) as exc:
        kind = type(exc).__name__
    return time.perf_counter() - due, kind, first, tokens


async def run_level(
    args: argparse.Namespace, base_url: str, model: str, qps: float, duration: float
) -> LevelResult:
    """Open-loop load at `qps` for `duration` seconds; waits for the last answers."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=args.connections, ssl=False)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    rng = random.Random(0)
    async with aiohttp.ClientSession(
        headers=headers, connector=connector, timeout=timeout
    ) as client:
        tasks = []
        start = time.perf_counter()
        due = start
        i = 0
        while due < start + duration:
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            path, body = request_body(args, model, i)
            url = base_url + path
            tasks.append(asyncio.create_task(one_request(client, url, body, due)))
            i += 1
            due += rng.expovariate(qps) if args.poisson else 1.0 / qps
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
    latencies = sorted(lat for lat, kind, _, _ in results if kind is None)
    errors = Counter(kind for _, kind, _, _ in results if kind is not None)
    firsts = sorted(first for _, kind, first, _ in results if kind is None and first is not None)
    tokens = sum(n for _, kind, _, n in results if kind is None)
    ok = len(latencies)
    return LevelResult(
        target_qps=qps,
        duration_s=round(elapsed, 2),
        sent=len(results),
        ok=ok,
        achieved_qps=round(ok / elapsed, 1),
        p50_s=_round(percentile(latencies, 0.50)),
        p95_s=_round(percentile(latencies, 0.95)),
        p99_s=_round(percentile(latencies, 0.99)),
        max_s=_round(latencies[-1] if latencies else None),
        errors=dict(errors),
        ttft_p50_s=_round(percentile(firsts, 0.50)),
        ttft_p99_s=_round(percentile(firsts, 0.99)),
        tokens_per_s=round(tokens / elapsed, 1) if tokens else None,
        batching=getattr(args, "mode", None),
    )


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


# ------------------------------------------------------------------------- keel serve itself
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`keel serve MODEL` on 127.0.0.1 and a free port (serve.batching=args.mode when set);
    (process, base URL) once /readyz says ready."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "keel.cli.main", "serve", args.serve, "--port", str(port)]
    for item in args.set:
        cmd += ["--set", item]
    if getattr(args, "mode", None):
        cmd += ["--set", f"serve.batching={args.mode}"]
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"keel serve exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=1) as response:
                if response.status == 200:
                    return proc, f"{url}/v1"
        except OSError:  # not listening yet, or 503 while loading
            pass
        time.sleep(0.25)
    proc.terminate()
    raise SystemExit("keel serve did not become ready within 120 s")


def served_model(base_url: str, api_key: str | None) -> str:
    """The first model id of GET /models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{base_url}/models", headers=headers)
    context = ssl._create_unverified_context()  # a self-signed test certificate is fine here
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
        return json.loads(response.read())["data"][0]["id"]


async def warm_up(args: argparse.Namespace, base_url: str, model: str) -> None:
    """A few seconds of load at the lowest level, not reported (first batches are slower)."""
    await run_level(args, base_url, model, min(args.qps, 20.0), args.warmup)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="base URL of the API, e.g. http://127.0.0.1:8000/v1")
    where.add_argument("--serve", metavar="MODEL", help="start `keel serve MODEL` and load it")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="--serve: a serve config override passed to keel serve")  # fmt: skip
    p.add_argument("--batching", choices=("continuous", "batch", "both"),
                   help="--serve: serve.batching (both: one run per mode, each on a fresh "
                   "server; default: the server's)")  # fmt: skip
    p.add_argument("--stream", action="store_true",
                   help="stream (SSE) and report the time to the first chunk")  # fmt: skip
    p.add_argument("--model", help="model id in requests (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--prompt", default="{i}+{i}=", help="prompt; {i} is the request number %% 100")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--qps", type=float, default=100.0, help="target rate (knee: the first one)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per load level")
    p.add_argument("--poisson", action="store_true", help="Poisson arrivals instead of a fixed gap")
    p.add_argument("--knee", action="store_true", help="step the rate up until p99 ≥ 1 s or errors")
    p.add_argument("--qps-step", type=float, default=25.0)
    p.add_argument("--qps-max", type=float, default=2000.0)
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of unreported load first")
    p.add_argument("--connections", type=int, default=512, help="most open connections")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds before a request fails")
    return p.parse_args(argv)


async def run(args: argparse.Namespace, base_url: str) -> list[LevelResult]:
    model = args.model or served_model(base_url, args.api_key)
    if args.warmup > 0:
        await warm_up(args, base_url, model)
    levels = []
    qps = args.qps
    while True:
        result = await run_level(args, base_url, model, qps, args.duration)
        levels.append(result)
        print(json.dumps({"level": asdict(result), "holds": result.holds}), flush=True)
        if not args.knee or not result.holds or qps + args.qps_step > args.qps_max:
            break
        qps += args.qps_step
    return levels


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.batching and not args.serve:
        raise SystemExit("--batching needs --serve (it sets the started server's serve.batching)")
    modes = ["continuous", "batch"] if args.batching == "both" else [args.batching]
    levels = []
    for mode in modes:
        args.mode = mode
        proc = None
        base_url = args.url
        if args.serve:
            proc, base_url = start_server(args)
        try:
            levels += asyncio.run(run(args, base_url))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
    held = [lv.target_qps for lv in levels if lv.holds]
    summary = {"knee_qps": max(held) if held else None} if args.knee else {}
    summary["all_hold"] = all(lv.holds for lv in levels)
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
