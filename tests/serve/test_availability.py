"""Two real `keel serve --follow` replicas behind a real HAProxy (bench/availability.py, the
parts bench/serve_availability.py measures with at 50 QPS) under steady load at 15 QPS: a
rolling restart and a checkpoint swap each lose no request. The target is 99.9 % of requests
answered 200; at a few hundred requests that is every one of them."""

from __future__ import annotations

import pytest
from bench.availability import (
    Balancer,
    Outcome,
    Replica,
    SteadyLoad,
    free_ports,
    get_json,
    rolling_restart,
    start_replicas,
    stop_replicas,
    summarize,
    swap_checkpoint,
    wait_for,
    write_checkpoint,
)

QPS = 15.0
MODEL = "policy"


@pytest.fixture(scope="module")
def pair(tiny_dir, tmp_path_factory):
    """(replicas a and b following one run directory, the balancer in front of them)."""
    folder = tmp_path_factory.mktemp("availability")
    run_dir = folder / "run"
    write_checkpoint(run_dir, 1, tiny_dir)
    args = [
        "--follow",
        "--set",
        "serve.follow_interval_s=0.2",
        "--set",
        f"serve.model_name={MODEL}",
    ]
    replicas = [
        Replica(name, run_dir, args, port, folder / f"{name}.log")
        for name, port in zip("ab", free_ports(2), strict=True)
    ]
    balancer = None
    try:
        start_replicas(replicas)  # both load at once
        balancer = Balancer({r.name: r.port for r in replicas}, folder)
        for replica in replicas:
            balancer.wait_up(replica.name)
        yield run_dir, replicas, balancer
    finally:
        if balancer is not None:
            balancer.stop()
        stop_replicas(replicas)


def failed(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if o.error is not None]


def test_a_rolling_restart_under_load_loses_no_request(pair):
    _, replicas, balancer = pair
    down_before = {r.name: int(balancer.stats()[r.name]["chkdown"]) for r in replicas}
    load = SteadyLoad(balancer.port, MODEL, QPS).start()
    try:
        wait_for(lambda: load.answered() >= 5, "the load to be answered")
        rolling_restart(replicas, balancer, load)
        back = {e.name.removeprefix("restart "): e.end_s for e in load.events}
        for replica in replicas:  # each answers again once it is back
            wait_for(lambda r=replica: load.answered(
                lambda o: o.replica == r.name and o.due_s > back[r.name]) >= 3,
                f"{replica.name} to answer after its restart")  # fmt: skip
    finally:
        outcomes = load.stop()
    summary = summarize(outcomes, load.events)
    assert not failed(outcomes), (summary, failed(outcomes)[:10])
    for replica in replicas:
        assert replica.starts == 2
        within = summary[f"restart {replica.name}"]
        assert within["requests"] >= 5 and within["success_pct"] == 100.0, summary
        # the other replica answered while this one was away
        others = {r.name for r in replicas} - {replica.name}
        assert set(within["by_replica"]) & others, summary
        # HAProxy saw it go: its /readyz check failed while it drained and restarted
        assert int(balancer.stats()[replica.name]["chkdown"]) > down_before[replica.name]
    assert set(summary["by_replica"]) == {"a", "b"}, summary
    stats = balancer.stats()  # HAProxy's own count agrees: both replicas answered through it
    assert all(int(stats[r.name]["hrsp_2xx"]) > 0 for r in replicas), stats
    assert int(stats["BACKEND"]["hrsp_2xx"]) >= len(outcomes), stats


def test_a_checkpoint_swap_under_load_loses_no_request(pair, tiny_dir):
    run_dir, replicas, balancer = pair
    old = replicas[0].step()
    assert old is not None and all(r.step() == old for r in replicas)
    load = SteadyLoad(balancer.port, MODEL, QPS).start()
    try:
        wait_for(lambda: load.answered() >= 5, "the load to be answered")
        with load.event("swap"):
            swap_checkpoint(run_dir, old + 1, tiny_dir, replicas)
        for replica in replicas:  # each answers with the new weights through the balancer
            wait_for(lambda r=replica: load.answered(
                lambda o: o.replica == r.name and o.step == old + 1) >= 3,
                f"{replica.name} to answer with step {old + 1}")  # fmt: skip
    finally:
        outcomes = load.stop()
    summary = summarize(outcomes, load.events)
    assert not failed(outcomes), (summary, failed(outcomes)[:10])
    assert {o.step for o in outcomes} == {old, old + 1}, summary
    for replica in replicas:
        assert replica.step() == old + 1
        _, text = get_json(replica.port, "/metrics")
        reloads = [
            line for line in text.splitlines() if line.startswith("keel_serve_reloads_total ")
        ]
        assert reloads and float(reloads[0].split()[-1]) >= 1, reloads
