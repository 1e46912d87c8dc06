"""bench/serve_locust.py and bench/locustfile.py against a real `keel serve builtin:tiny`: Locust
runs headless as a subprocess for a few seconds, and its CSV stats come back as a Level (counts,
ordered percentiles, TTFT of the streamed share, errors by kind). No timing is asserted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from bench.serve_locust import (
    PLAIN,
    RETRIED,
    STREAM,
    TTFT,
    main,
    parse_args,
    read_stats,
    run_level,
    start_server,
)

SERVER_MAX_NEW_TOKENS = 16


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """`keel serve builtin:tiny` answering max_tokens up to SERVER_MAX_NEW_TOKENS; its host URL."""
    args = parse_args(["--set", f"serve.max_new_tokens={SERVER_MAX_NEW_TOKENS}"])
    proc, host = start_server(args)
    yield host
    proc.terminate()
    proc.wait(timeout=60)


def load_args(*extra: str):
    return parse_args(["--duration", "2", "--stream-share", "0.5", *extra])


def test_open_loop_level_counts_every_request_and_times_the_first_token(
    server: str, tmp_path: Path
) -> None:
    args = load_args("--max-tokens", "8")
    level = run_level(args, server, qps=20.0, duration=2.0, workdir=tmp_path)
    # 20 QPS for 2 s, one due time every 50 ms from a phase within the first gap
    assert 39 <= level.sent <= 41
    assert level.ok == level.sent and level.errors == {}
    assert level.achieved_qps > 0
    assert level.p50_s is not None and level.p95_s is not None and level.p99_s is not None
    assert level.max_s is not None
    assert 0 < level.p50_s <= level.p95_s <= level.p99_s <= level.max_s
    # about half the requests streamed: each has a TTFT, which comes before its stream's end
    (csv_prefix,) = {p.name.removesuffix("_stats.csv") for p in tmp_path.glob("*_stats.csv")}
    stats = read_stats(tmp_path / csv_prefix)
    # (a `retried connection` row only if a keep-alive connection closed under a request)
    assert {PLAIN, STREAM, TTFT} <= set(stats) <= {PLAIN, STREAM, TTFT, RETRIED}
    streamed = int(stats[STREAM]["Request Count"])
    assert 0 < streamed < level.sent
    assert int(stats[TTFT]["Request Count"]) == streamed
    assert level.ttft_p50_s is not None and level.ttft_p99_s is not None
    assert float(stats[TTFT]["Min Response Time"]) <= float(stats[STREAM]["Max Response Time"])
    assert level.holds == (max(level.p99_s, level.stream_p99_s or 0) < 1.0)


def test_refused_requests_are_errors_by_kind_and_the_level_does_not_hold(
    server: str, tmp_path: Path
) -> None:
    args = load_args("--max-tokens", str(SERVER_MAX_NEW_TOKENS + 1))  # past the server's limit
    level = run_level(args, server, qps=20.0, duration=2.0, workdir=tmp_path)
    assert level.sent > 0 and level.ok == 0
    assert sum(level.errors.values()) == level.sent
    assert set(level.errors) <= {f"{PLAIN}: HTTP 400", f"{STREAM}: HTTP 400"}
    assert not level.holds


def test_users_arrival_runs_locusts_constant_throughput_users(server: str, tmp_path: Path) -> None:
    args = load_args("--max-tokens", "8", "--arrival", "users")
    level = run_level(args, server, qps=10.0, duration=2.0, workdir=tmp_path)
    assert level.arrival == "users"
    assert level.sent > 0 and level.ok == level.sent and level.errors == {}
    assert level.p99_s is not None


def test_main_reports_a_level_and_its_summary(server: str, capsys) -> None:
    """`make bench-serve`'s entry point against the running server, one second of load."""
    main(["--url", server, "--qps", "5", "--duration", "1", "--warmup", "0", "--max-tokens", "4"])
    lines = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")
    ]
    level, summary = lines[-2], lines[-1]["summary"]
    assert level["level"]["offered_qps"] == 5.0 and level["level"]["sent"] >= 1
    assert summary["max_tokens"] == 4 and summary["all_hold"] == level["holds"]
