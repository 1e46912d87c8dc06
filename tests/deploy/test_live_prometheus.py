"""A real Prometheus server scrapes a running tiny training run; Keel's metrics come back
through Prometheus' HTTP API, and the checked-in alert rules load in the server."""

import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import time
import urllib.parse
from collections.abc import Iterator

import pytest
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from keel.monitor import read_metrics
from keel.report import load_run, write_report
from tests.cli.conftest import KEEL, REPO
from tests.deploy.tools import METRIC, REPO_DEPLOY, binary, dashboard, queries
from tests.monitor.live import free_port, get, samples, tiny_grpo


def wait_for(what: str, probe, timeout: float = 90.0, every: float = 0.1):
    """Polls `probe()` until it returns something truthy; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if result := probe():
                return result
        except OSError:
            pass
        time.sleep(every)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")


def query(base: str, promql: str) -> list[dict]:
    url = f"{base}/api/v1/query?query={urllib.parse.quote(promql)}"
    body = json.loads(get(url))
    assert body["status"] == "success", body
    return body["data"]["result"]


def prometheus_config(tmp_path, target: str, job: str = "keel") -> str:
    """deploy/prometheus/prometheus.yml, its `job` alone pointed at `target`, scraping every
    200 ms."""
    cfg = yaml.safe_load((REPO_DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg["global"] = {"scrape_interval": "200ms", "evaluation_interval": "200ms"}
    cfg["rule_files"] = [str(REPO_DEPLOY / "prometheus" / r) for r in cfg["rule_files"]]
    cfg["scrape_configs"] = [c for c in cfg["scrape_configs"] if c["job_name"] == job]
    cfg["scrape_configs"][0]["static_configs"] = [{"targets": [target]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.fixture
def training(tiny_dir, tmp_path, _private_keel_cache):
    """`keel train` in a subprocess (long enough to be watched), interrupted at the end."""
    port = free_port()
    raw = tiny_grpo(tiny_dir, tmp_path / "live-run", prometheus={"port": port}, tensorboard=True)
    raw["train"]["steps"], raw["eval"]["every"] = 5000, 0
    raw["checkpoint"] = {"save_steps": 5, "keep": 1}
    config = tmp_path / "live.yaml"
    config.write_text(yaml.safe_dump(raw))
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "KEEL_CACHE": str(_private_keel_cache)}
    proc = subprocess.Popen(
        [str(KEEL), "train", str(config)], cwd=REPO, env={**os.environ, **env},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:  # Prometheus starts while the run loads; it scrapes once the exporter listens
        yield proc, port, tmp_path / "live-run"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def running_prometheus(tmp_path, target: str, job: str = "keel") -> Iterator[str]:
    """A Prometheus server scraping `target` as `job` (prometheus_config); yields its URL."""
    web = free_port()
    config = prometheus_config(tmp_path, target, job)
    proc = subprocess.Popen(
        [
            binary("prometheus"), f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{web}"
    try:
        wait_for("Prometheus to be ready", lambda: proc.poll() is None and get(f"{base}/-/ready"))
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def prometheus(training, tmp_path):
    _, port, _ = training
    with running_prometheus(tmp_path, f"127.0.0.1:{port}") as base:
        yield base


def test_prometheus_scrapes_a_running_training(training, prometheus, tmp_path):
    proc, port, run_dir = training
    health = wait_for("the exporter's /healthz", lambda: get(f"http://127.0.0.1:{port}/healthz"))
    assert json.loads(health)["status"] == "ok"
    run = 'run="live-run", job="keel"'
    step = wait_for(
        "keel_step >= 2 in Prometheus",
        lambda: [r for r in query(prometheus, f"keel_step{{{run}}} >= 2")],
    )
    assert step[0]["metric"]["algorithm"] == "grpo"
    assert query(prometheus, 'up{job="keel"}')[0]["value"][1] == "1"
    reward = query(prometheus, f"keel_reward_mean{{{run}}}")
    logged = {r["reward/mean"] for r in read_metrics(run_dir / "metrics.jsonl") if r["step"]}
    assert float(reward[0]["value"][1]) in logged
    kl = query(prometheus, f'keel_kl{{{run}, role="actor"}}')
    assert float(kl[0]["value"][1]) >= 0
    wait_for("a checkpoint count", lambda: query(prometheus, "keel_checkpoints_saved_total >= 1"))
    age = query(prometheus, "time() - keel_checkpoint_last_saved_timestamp_seconds")
    assert 0 <= float(age[0]["value"][1]) < 120
    groups = json.loads(get(f"{prometheus}/api/v1/rules"))["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    written = yaml.safe_load((REPO_DEPLOY / "prometheus" / "alerts.yml").read_text())["groups"]
    assert len(rules) == sum(len(g["rules"]) for g in written), rules  # every rule loaded
    assert all(r["health"] == "ok" for r in rules), rules
    assert proc.poll() is None, proc.stderr.read()

    check_dashboard_queries(prometheus, get(f"http://127.0.0.1:{port}/metrics"))

    # keel report works on the run while it is still being written
    page = write_report([load_run(run_dir)], tmp_path / "report").read_text()
    assert "reward.png" in page and (tmp_path / "report" / "reward.png").stat().st_size > 1000
    assert proc.poll() is None

    # How long after a step is logged its value is visible through Prometheus: the first query
    # that returns step N or later, minus the wall time TensorBoard recorded for step N.
    reads = []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        reads += [(time.time(), int(float(r["value"][1]))) for r in query(prometheus, "keel_step")]
        time.sleep(0.01)
    lags = visibility_lags(run_dir / "tensorboard", reads)
    assert lags and min(lags) >= 0, lags
    print(
        f"\nstep → visible in Prometheus (scrape every 200 ms): {len(lags)} steps, median "
        f"{statistics.median(lags):.3f} s, max {max(lags):.3f} s"
    )


def check_dashboard_queries(base: str, page: str) -> None:
    """Every dashboard query runs in the real Prometheus; those whose metrics the run exports
    now return data."""
    exported = {name for name, _ in samples(page)}
    for expr in queries(dashboard()):
        promql = dashboard_promql(expr, run="live-run", rate_interval="1m")
        result = query(base, promql)  # a PromQL syntax error fails here
        names = set(METRIC.findall(expr))
        if names <= exported and "[1m]" not in promql:  # rates need two scrapes a minute apart
            assert result, f"no data for {promql}"


def dashboard_promql(expr: str, rate_interval: str, run: str = ".*") -> str:
    """A dashboard expression as Prometheus runs it: Grafana's variables replaced (the serving
    row's `$model` and `$instance` by `.*`), `label_values(SELECTOR, label)` by its selector."""
    promql = expr.replace("$run", run).replace("$__rate_interval", rate_interval)
    promql = promql.replace("$model", ".*").replace("$instance", ".*")
    if label_values := re.fullmatch(r"label_values\((.+), \w+\)", promql):  # Grafana's
        promql = label_values.group(1)
    return promql


def visibility_lags(tensorboard_dir, reads: list[tuple[float, int]]) -> list[float]:
    """For each step logged after the first read: seconds until a read showed it (or later)."""
    events = EventAccumulator(str(tensorboard_dir))
    events.Reload()
    logged = {e.step: e.wall_time for e in events.Scalars("reward/mean")}
    lags = []
    for step, at in logged.items():
        if at < reads[0][0]:
            continue
        first = next((t for t, seen in reads if seen >= step and t >= at), None)
        if first is not None:
            lags.append(first - at)
    return lags
