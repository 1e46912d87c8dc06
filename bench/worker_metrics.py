"""`make bench`: what gathering the Ray workers' device metrics costs the driver per step.

`keel.workers.ray_group.device_readings` asks every RoleHost for its reading (one Ray call per
worker, between steps); this times that call on a local Ray (2 CPUs) for 2 and 4 idle hosts,
200 times each after one warm-up call. Prints one JSON line per host count: median and p90 in
milliseconds.

    python -m bench.worker_metrics [--repeats 200] [--hosts 2,4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import ray

from keel.workers.ray_group import RoleHost, device_readings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--hosts", default="2,4", help="host counts, comma-separated")
    args = parser.parse_args(argv)
    # address="local": a Ray of its own, even when another test has a cluster up (ray start)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        host_cls = ray.remote(RoleHost)
        for count in (int(c) for c in args.hosts.split(",")):
            hosts = [host_cls.options(num_cpus=0.25).remote(i, count, 0) for i in range(count)]
            ray.get([h.pid.remote() for h in hosts])
            assert len(device_readings(hosts)) == count
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                device_readings(hosts)
                times.append(time.perf_counter() - start)
            times.sort()
            row = {
                "bench": "worker_metrics",
                "hosts": count,
                "median_ms": round(statistics.median(times) * 1e3, 2),
                "p90_ms": round(times[int(0.9 * args.repeats)] * 1e3, 2),
            }
            print(json.dumps(row), flush=True)
            for h in hosts:
                ray.kill(h)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
