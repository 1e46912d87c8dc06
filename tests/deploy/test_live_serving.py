"""A real `keel serve` (the tiny model) scraped by a real Prometheus as deploy/prometheus's
`keel-serve` job: the Deployment's probe paths answer, and every query of the dashboard's Serving
row and every serving alert expression runs in Prometheus and returns data."""

import re

import pytest
import yaml

from tests.deploy.test_live_prometheus import dashboard_promql, query, running_prometheus, wait_for
from tests.deploy.tools import REPO_DEPLOY, dashboard, sections
from tests.serve.live_server import LiveServer

KEY = "test-key"


@pytest.fixture
def server(tiny_dir, tmp_path):
    live = LiveServer(
        tiny_dir, "--set", "serve.model_name=policy", log=tmp_path / "serve.log",
        env={"KEEL_API_KEY": KEY},
    )  # fmt: skip
    try:
        yield live
    finally:
        live.stop()


def test_prometheus_reads_every_serving_panel_from_a_live_server(server, tmp_path):
    deployment = yaml.safe_load((REPO_DEPLOY / "serve/base/deployment.yaml").read_text())
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        status, _ = server.request("GET", c[probe]["httpGet"]["path"])
        assert status == 200, probe

    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "policy", "prompt": "1+1=", "max_tokens": 4}
    with running_prometheus(tmp_path, f"127.0.0.1:{server.port}", job="keel-serve") as prom:
        wait_for("up == 1", lambda: query(prom, 'up{job="keel-serve"} == 1'))
        # Requests spread over several scrapes: a labelled series appears in the scrape after its
        # first request, already counting it, so a rate needs later scrapes that count more. Each
        # round waits for the scrape that counts its requests (a round done between two scrapes
        # would leave the latency histogram's rate at 0 and its quantile NaN).
        chat = {"model": "policy", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
        for round_ in range(1, 7):
            assert server.request("POST", "/v1/completions", body, auth)[0] == 200
            assert server.request("POST", "/v1/chat/completions", chat, auth)[0] == 200
            assert server.request("POST", "/v1/completions", body)[0] == 401  # an error kind
            counted = f'sum(keel_serve_requests_total{{status="200"}}) >= {2 * round_}'
            wait_for(f"round {round_} in Prometheus", lambda q=counted: query(prom, q))
        panels = sections(dashboard())["serving"]
        for panel in panels:
            for target in panel["targets"]:
                promql = dashboard_promql(target["expr"], rate_interval="5m")
                result = wait_for(
                    f"data for {panel['title']!r}: {promql}", lambda q=promql: query(prom, q),
                    timeout=15,
                )  # fmt: skip
                if "histogram_quantile" in promql:
                    assert all(r["value"][1] != "NaN" for r in result), promql
        variables = {v["name"]: v["query"]["query"] for v in dashboard()["templating"]["list"]
                     if v["type"] == "query"}  # fmt: skip
        (served,) = query(prom, dashboard_promql(variables["model"], "5m"))
        assert served["metric"]["model"] == "policy"
        (instance,) = query(prom, dashboard_promql(variables["instance"], "5m"))
        assert instance["metric"]["instance"] == f"127.0.0.1:{server.port}"

        groups = yaml.safe_load((REPO_DEPLOY / "prometheus/alerts.yml").read_text())["groups"]
        rules = {r["alert"]: r for g in groups if g["name"] == "keel-serve" for r in g["rules"]}
        for rule in rules.values():
            query(prom, rule["expr"])  # runs (none fires)
            # without its threshold: the series it compares exist (no 5xx or 429 was answered,
            # so the error ratio has no numerator yet)
            value = re.sub(r"\s*(>|==)\s*[\d.]+\s*$", "", rule["expr"].strip())
            assert query(prom, value) or rule["alert"] == "KeelServeErrors", rule["alert"]
        total = 'sum by (job) (rate(keel_serve_requests_total{endpoint=~"/v1/.*"}[5m]))'
        assert total in " ".join(rules["KeelServeErrors"]["expr"].split())
        assert query(prom, total)
