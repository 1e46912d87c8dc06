"""Availability of `keel serve` behind a load balancer: two replicas behind HAProxy
(bench/availability.py), steady load at 50 QPS for 2 minutes, and during it a rolling restart
(SIGTERM one replica, start it again, then the other) and a `--follow` checkpoint swap. The
target is 99.9 % of requests answered 200.

  python -m bench.serve_availability                    # 50 QPS, 120 s (about 2.5 minutes)
  python -m bench.serve_availability --no-retry         # the same with HAProxy's retries off
  python -m bench.serve_availability --replicas 1       # one replica: its restart refuses requests
  python -m bench.serve_availability --qps 100 --duration 60 --max-tokens 8

Prints one JSON line: success %, failures by kind, p50/p99/max latency over the whole run and
within each event (`restart a`, `restart b`, `swap`: the requests due while it ran), answers by
replica, and HAProxy's retries and redispatches. Needs haproxy (scripts/install-test-tools)."""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from bench.availability import (
    Balancer,
    Replica,
    SteadyLoad,
    free_ports,
    rolling_restart,
    start_replicas,
    stop_replicas,
    summarize,
    swap_checkpoint,
    write_checkpoint,
)

MODEL = "policy"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:tiny", help="HF folder or builtin:NAME served")
    p.add_argument("--qps", type=float, default=50.0)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--restart-at", type=float, default=10.0, help="s into the load")
    p.add_argument("--swap-at", type=float, default=70.0, help="s into the load")
    p.add_argument("--no-retry", action="store_true", help="HAProxy retries nothing (retries 0)")
    p.add_argument("--replicas", type=int, default=2, choices=range(1, 9), metavar="1..8",
                   help="replicas behind HAProxy (1: a lone process restarts)")  # fmt: skip
    p.add_argument("--keep", action="store_true", help="keep the folder with the logs")
    return p.parse_args(argv)


def wait_until(load: SteadyLoad, at_s: float) -> None:
    """Sleep until `at_s` seconds into the load (the bench's schedule, not a test's wait)."""
    time.sleep(max(0.0, at_s - load.now()))


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    from keel.models import resolve_model_path

    builtin = args.model.startswith("builtin:")
    model = Path(resolve_model_path(args.model)) if builtin else Path(args.model)
    folder = Path(tempfile.mkdtemp(prefix="keel-availability-"))
    run_dir = folder / "run"
    write_checkpoint(run_dir, 1, model)
    serve_args = ["--follow", "--set", "serve.follow_interval_s=0.5"]
    serve_args += ["--set", f"serve.model_name={MODEL}"]
    replicas = [
        Replica(name, run_dir, serve_args, port, folder / f"{name}.log")
        for name, port in zip("abcdefgh", free_ports(args.replicas), strict=False)
    ]
    balancer = None
    try:
        start_replicas(replicas)
        balancer = Balancer({r.name: r.port for r in replicas}, folder,
                            retries=0 if args.no_retry else 3)  # fmt: skip
        for replica in replicas:
            balancer.wait_up(replica.name)
        load = SteadyLoad(balancer.port, MODEL, args.qps, max_tokens=args.max_tokens).start()
        try:
            wait_until(load, args.restart_at)
            rolling_restart(replicas, balancer, load)
            wait_until(load, args.swap_at)
            with load.event("swap"):
                swap_checkpoint(run_dir, 2, model, replicas)
            wait_until(load, args.duration)
        finally:
            outcomes = load.stop()
        summary = summarize(outcomes, load.events)
        backend = balancer.stats()
        summary["haproxy"] = {
            name: {k: int(row[k] or 0) for k in ("stot", "hrsp_2xx", "wretr", "wredis", "chkdown")}
            for name, row in backend.items()
        }
    finally:
        if balancer is not None:
            balancer.stop()
        stop_replicas(replicas)
    result = {
        "qps": args.qps, "duration_s": args.duration, "max_tokens": args.max_tokens,
        "replicas": args.replicas, "retries": not args.no_retry, "target_pct": 99.9,
        "holds": summary["success_pct"] is not None and summary["success_pct"] >= 99.9,
        **summary,
    }  # fmt: skip
    print(json.dumps(result), flush=True)
    if args.keep:
        print(f"logs: {folder}", flush=True)
    else:
        shutil.rmtree(folder, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
