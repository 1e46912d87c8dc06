"""`keel serve` under Locust (bench/locustfile.py), headless, at a fixed offered rate.

Starts `keel serve MODEL` on a free port (or loads a running server with --url), warms it up,
runs `locust --headless` as a subprocess at --qps for --duration seconds (an open loop by
default: requests leave on schedule whether or not earlier answers are back), and reads
Locust's CSV stats into one JSON line: achieved QPS, p50/p95/p99 latency, TTFT p50/p99 (the
streamed share of the requests: time to the first SSE data bytes), errors by kind, and whether
the level holds (p99 < 1 s, no errors). --find-max steps the rate up from --qps until a level
misses, then halves the gap between the last level that held and the first that missed
--refine times, and reports the highest rate that held.

  # one level (what `make bench-serve` runs)
  python -m bench.serve_locust --qps 100 --max-tokens 8 --duration 60
  # the batching mode of keel serve (serve.batching), and the highest rate with p99 < 1 s
  python -m bench.serve_locust --batching batch --max-tokens 64 --find-max --qps 5 --qps-factor 2
  # any OpenAI-compatible server already running
  python -m bench.serve_locust --url http://127.0.0.1:8000 --qps 50

Latencies are Locust's (its percentiles keep two significant digits above 100 ms: 0.99 s is
990 ms). Needs locust (the bench extra: `pip install -e '.[bench]'`)."""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LOCUSTFILE = REPO / "bench" / "locustfile.py"
HOLD_P99_S = 1.0
PLAIN, STREAM, TTFT = "completions", "completions stream", "ttft"
RETRIED = "retried connection"  # the locustfile's row of requests resent on a fresh connection
CAUGHT = re.compile(r"CatchResponseError\(['\"](.*)['\"]\)")


@dataclass
class Level:
    """One offered rate: what came back (latencies in seconds; TTFT over the streamed share)."""

    offered_qps: float
    arrival: str
    max_tokens: int
    duration_s: float
    sent: int
    ok: int
    achieved_qps: float
    p50_s: float | None
    p95_s: float | None
    p99_s: float | None
    max_s: float | None
    stream_p99_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    max_send_lag_s: float | None
    retried: int = 0
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def holds(self) -> bool:
        """No errors, everything sent was answered, p99 (plain and streamed) under a second."""
        p99s = [p for p in (self.p99_s, self.stream_p99_s) if p is not None]
        return (
            self.error_count == 0
            and self.ok == self.sent > 0
            and bool(p99s)
            and max(p99s) < HOLD_P99_S
        )


def read_stats(csv_prefix: Path) -> dict[str, dict[str, str]]:
    """Locust's `<prefix>_stats.csv`: one row per request name (the Aggregated row left out)."""
    with open(f"{csv_prefix}_stats.csv", newline="") as f:
        return {row["Name"]: row for row in csv.DictReader(f) if row["Name"] != "Aggregated"}


def read_failures(csv_prefix: Path) -> dict[str, int]:
    """Locust's `<prefix>_failures.csv` as {"name: error": occurrences}."""
    path = Path(f"{csv_prefix}_failures.csv")
    if not path.exists():
        return {}
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    errors: dict[str, int] = {}
    for r in rows:
        # a failure the locustfile marked reads CatchResponseError('HTTP 400') in the CSV
        caught = CAUGHT.fullmatch(r["Error"])
        key = f"{r['Name']}: {caught.group(1) if caught else r['Error']}"
        errors[key] = errors.get(key, 0) + int(r["Occurrences"])
    return errors


def _seconds(row: dict[str, str] | None, column: str) -> float | None:
    """A latency column (ms in the CSV, "N/A" when empty) in seconds."""
    if row is None or int(row["Request Count"]) == 0:
        return None
    value = row[column]
    return None if value in ("", "N/A") else round(float(value) / 1000, 4)


def parse_tally(stdout: str) -> dict[str, Any]:
    """The locustfile's `KEEL_LOAD {json}` line."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("KEEL_LOAD "):
            return json.loads(line.removeprefix("KEEL_LOAD "))
    raise RuntimeError("locust printed no KEEL_LOAD line: did bench/locustfile.py run?")


def level_from(
    csv_prefix: Path, tally: dict[str, Any], args: argparse.Namespace, qps: float
) -> Level:
    """Locust's CSV files and the locustfile's tally as one Level."""
    stats = read_stats(csv_prefix)
    plain, stream, ttft = stats.get(PLAIN), stats.get(STREAM), stats.get(TTFT)
    window = tally.get("window_s") or args.duration
    # Plain and streamed requests together, where both ran: Locust keeps one histogram per name,
    # so the overall p99 is the worse of the two (a bound; they share the server's queue).
    main = plain if plain is not None else stream
    return Level(
        offered_qps=qps,
        arrival=args.arrival,
        max_tokens=args.max_tokens,
        duration_s=args.duration,
        sent=int(tally["sent"]),
        ok=int(tally["answered"]),
        achieved_qps=round(int(tally["answered"]) / window, 1) if window else 0.0,
        p50_s=_seconds(main, "50%"),
        p95_s=_seconds(main, "95%"),
        p99_s=_seconds(main, "99%"),
        max_s=_seconds(main, "100%"),
        stream_p99_s=_seconds(stream, "99%"),
        ttft_p50_s=_seconds(ttft, "50%"),
        ttft_p99_s=_seconds(ttft, "99%"),
        max_send_lag_s=tally.get("max_send_lag_s"),
        retried=int(stats[RETRIED]["Request Count"]) if RETRIED in stats else 0,
        errors=read_failures(csv_prefix),
    )


def locust_command(
    args: argparse.Namespace, host: str, qps: float, duration: float, csv_prefix: Path
) -> list[str]:
    """`python -m locust --headless …` for one level."""
    users = args.users or (1 if args.arrival != "users" else max(1, round(qps)))
    # users: Locust stops at --run-time (in-flight requests get --stop-timeout); the open loop
    # stops itself after its last answer, and --run-time is only a cap
    closed = args.arrival == "users"
    run_time = duration if closed else duration + args.request_timeout + 30
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--headless",
        "--users",
        str(users),
        "--spawn-rate",
        str(users),
        "--run-time",
        f"{run_time:.0f}s",
        "--host",
        host,
        "--csv",
        str(csv_prefix),
        "--only-summary",
        "--loglevel",
        "WARNING",
        "--stop-timeout",
        f"{args.request_timeout:.0f}",
        "--exit-code-on-error",
        "0",
        "--qps",
        str(qps),
        "--arrival",
        args.arrival,
        "--max-tokens",
        str(args.max_tokens),
        "--stream-share",
        str(args.stream_share),
        "--temperature",
        str(args.temperature),
        "--request-timeout",
        str(args.request_timeout),
    ]
    if not closed:
        cmd += ["--duration", str(duration)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    return cmd


def run_level(
    args: argparse.Namespace, host: str, qps: float, duration: float, workdir: Path
) -> Level:
    """One Locust run at `qps` for `duration` s, parsed."""
    csv_prefix = workdir / f"level_{qps:g}_{time.monotonic_ns()}"
    cmd = locust_command(args, host, qps, duration, csv_prefix)
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=duration + 2 * args.request_timeout + 120
    )
    if done.returncode != 0 or not Path(f"{csv_prefix}_stats.csv").exists():
        sys.stderr.write(done.stdout + done.stderr)
        raise RuntimeError(f"locust exited with {done.returncode}: {' '.join(cmd)}")
    return level_from(csv_prefix, parse_tally(done.stdout), args, qps)


# ------------------------------------------------------------------------- keel serve itself
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`keel serve MODEL` on 127.0.0.1 and a free port; (process, host URL) once /readyz says
    ready."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(args.src), os.environ.get("PYTHONPATH", "")]),
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    cmd = [sys.executable, "-m", "keel.cli.main", "serve", args.serve, "--port", str(port)]
    if args.batching:
        cmd += ["--set", f"serve.batching={args.batching}"]
    for item in args.set:
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, env=env)
    host = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"keel serve exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            with urllib.request.urlopen(f"{host}/readyz", timeout=1) as response:
                if response.status == 200:
                    return proc, host
        except OSError:  # not listening yet, or 503 while loading
            pass
        time.sleep(0.25)
    proc.terminate()
    raise SystemExit("keel serve did not become ready within 120 s")


def find_max(
    args: argparse.Namespace, host: str, workdir: Path
) -> tuple[list[Level], float | None]:
    """Step the rate up from --qps (by --qps-step, or times --qps-factor) until a level misses
    (or the next rate passes --qps-max), then bisect the gap --refine times. (levels, the
    highest rate that held or None)."""
    levels: list[Level] = []
    held: list[float] = []
    qps = args.qps
    missed_at: float | None = None
    while True:
        level = report(run_level(args, host, qps, args.duration, workdir))
        levels.append(level)
        if not level.holds:
            missed_at = qps
            break
        held.append(qps)
        following = qps * args.qps_factor if args.qps_factor else qps + args.qps_step
        if following > args.qps_max:
            break
        qps = round(following, 1)
    if missed_at is not None:
        low = max(held) if held else 0.0
        high = missed_at
        for _ in range(args.refine):
            mid = round((low + high) / 2, 1)
            if mid <= low or mid >= high:
                break
            level = report(run_level(args, host, mid, args.duration, workdir))
            levels.append(level)
            if level.holds:
                low = mid
                held.append(mid)
            else:
                high = mid
    return levels, (max(held) if held else None)


def report(level: Level) -> Level:
    print(json.dumps({"level": asdict(level), "holds": level.holds}), flush=True)
    return level


def warm_up(args: argparse.Namespace, host: str, workdir: Path) -> None:
    """A few seconds of load at a low rate, not reported (the first generate calls are slow)."""
    if args.warmup > 0:
        run_level(args, host, min(args.qps, 10.0), args.warmup, workdir)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", help="host of a running server, e.g. http://127.0.0.1:8000")
    where.add_argument(
        "--serve",
        metavar="MODEL",
        default="builtin:tiny",
        help="start `keel serve MODEL` and load it (default builtin:tiny)",
    )
    p.add_argument(
        "--batching",
        choices=("continuous", "batch"),
        help="--serve: serve.batching (default: the server's)",
    )
    p.add_argument(
        "--src",
        type=Path,
        default=REPO / "src",
        help="--serve: the keel sources it runs (default: this checkout's src)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--serve: a serve config override passed to keel serve",
    )
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--qps", type=float, default=100.0, help="offered rate (find-max: the first)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per level")
    p.add_argument(
        "--arrival",
        choices=("fixed", "poisson", "users"),
        default="fixed",
        help="fixed/poisson: open loop; users: Locust's constant_throughput users",
    )
    p.add_argument(
        "--users",
        type=int,
        default=0,
        help="Locust users (default: 1 for an open loop, one per QPS for users)",
    )
    p.add_argument(
        "--stream-share",
        type=float,
        default=0.1,
        help="share of requests streamed (TTFT is measured on them)",
    )
    p.add_argument(
        "--find-max",
        action="store_true",
        help="step the rate up, then bisect: the highest with p99 < 1 s and no errors",
    )
    p.add_argument("--qps-step", type=float, default=25.0, help="find-max: the rate's step up")
    p.add_argument(
        "--qps-factor", type=float, help="find-max: step up times this (over --qps-step)"
    )
    p.add_argument("--qps-max", type=float, default=2000.0)
    p.add_argument("--refine", type=int, default=2, help="find-max: bisections after the miss")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of unreported load first")
    p.add_argument("--request-timeout", type=float, default=30.0)
    p.add_argument(
        "--csv-dir", type=Path, help="keep Locust's CSV files here (default: a temp dir)"
    )
    args = p.parse_args(argv)
    if args.qps <= 0 or args.qps_step <= 0:
        p.error("--qps and --qps-step must be > 0")
    if args.qps_factor is not None and args.qps_factor <= 1:
        p.error(f"--qps-factor must be > 1, got {args.qps_factor}")
    if not 0.0 <= args.stream_share <= 1.0:
        p.error(f"--stream-share must be in [0, 1], got {args.stream_share}")
    if args.url and args.batching:
        p.error("--batching applies to --serve (a server this script starts)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    proc = None
    host = args.url
    with tempfile.TemporaryDirectory(prefix="keel-locust-") as tmp:
        workdir = args.csv_dir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if not args.url:
            proc, host = start_server(args)
        try:
            warm_up(args, host, workdir)
            if args.find_max:
                levels, best = find_max(args, host, workdir)
                summary: dict[str, Any] = {"max_qps_holding": best}
            else:
                levels = [report(run_level(args, host, args.qps, args.duration, workdir))]
                summary = {}
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)
    summary.update(
        batching=args.batching or "server default",
        max_tokens=args.max_tokens,
        arrival=args.arrival,
        all_hold=all(lv.holds for lv in levels),
    )
    print(json.dumps({"summary": summary}), flush=True)


if __name__ == "__main__":
    main()
