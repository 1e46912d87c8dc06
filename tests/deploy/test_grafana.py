"""deploy/grafana: the dashboard parses, has its variables, and queries only exported metrics."""

import yaml

from keel.monitor import read_metrics
from keel.monitor.prom_names import WELL_KNOWN, exported_names, prom_metric
from tests.deploy.tools import GRAFANA, METRIC, dashboard, queries


def test_variables_and_provisioning():
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["run"]["multi"] and "keel_run_info" in variables["run"]["query"]["query"]
    for panel in dashboard()["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert all('run=~"$run"' in t["expr"] for t in panel["targets"]), panel["title"]
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/keel.yml").read_text())
    assert provider["providers"][0]["type"] == "file"
    source = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["type"] == "prometheus"


def test_every_query_names_an_exported_metric(scraped_run):
    """Exported: the mapping of the well-known keys and of every key a real run logged."""
    keys = {k for r in read_metrics(scraped_run.run_dir / "metrics.jsonl") for k in r}
    exported = exported_names() | {prom_metric(k).name for k in keys - {"step"}}
    for expr in queries(dashboard()):
        names = set(METRIC.findall(expr))
        assert names, expr
        assert names <= exported, (expr, names - exported)


def test_every_metric_family_has_a_panel():
    queried = {n for e in queries(dashboard()) for n in METRIC.findall(e)}
    wanted = {m.name for m in WELL_KNOWN.values()} | {
        "keel_step", "keel_last_step_timestamp_seconds", "keel_process_resident_memory_bytes",
        "keel_gpu_memory_allocated_bytes", "keel_gpu_utilization_ratio",
        "keel_timing_rollout_seconds",
    }  # fmt: skip
    assert wanted <= queried, wanted - queried
