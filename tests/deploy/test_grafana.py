"""deploy/grafana: the dashboard parses, has its variables, and queries only exported metrics:
a training run's (keel.monitor's names) in the panels above the Serving row, `keel serve`'s
(keel.serve.metrics' registry) in the Serving row."""

import re

import yaml

from keel.monitor import read_metrics
from keel.monitor.prom_names import (
    WELL_KNOWN,
    WORKER_LABELS,
    WORKER_NAMES,
    exported_names,
    prom_metric,
)
from keel.serve.app import GENERATION_PATHS, KNOWN_PATHS
from tests.deploy.tools import GRAFANA, METRIC, dashboard, queries, sections, serving_series

SCRAPE_LABELS = {"instance", "job", "le"}  # added by Prometheus (le: a histogram's buckets)


def test_variables_and_provisioning():
    """Training panels filter on `run` (keel_run_info's label, which every training series
    carries). Serving series carry no `run`: the Serving row filters on `instance` (the scrape
    target: one per replica), chained from a `model` variable over keel_serve_info{model}."""
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["run"]["multi"] and "keel_run_info" in variables["run"]["query"]["query"]
    model, instance = variables["model"]["query"]["query"], variables["instance"]["query"]["query"]
    assert model == "label_values(keel_serve_info, model)"
    assert instance == 'label_values(keel_serve_info{model=~"$model"}, instance)'
    rows = sections(dashboard())
    assert set(rows) == {"training", "serving"} and rows["serving"]
    for section, rule in (("training", 'run=~"$run"'), ("serving", 'instance=~"$instance"')):
        for panel in rows[section]:
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == "${datasource}", panel["title"]
                # every selector of the expression filters (one per metric named)
                names = METRIC.findall(target["expr"])
                assert target["expr"].count(rule) == len(names), (panel["title"], target["expr"])
                serving = {n.startswith("keel_serve_") for n in names}
                assert serving == {section == "serving"}, (panel["title"], names)
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/keel.yml").read_text())
    assert provider["providers"][0]["type"] == "file"
    source = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["type"] == "prometheus"


def test_every_query_names_an_exported_metric(scraped_run):
    """Exported: the mapping of the well-known keys and of every key a real run logged, and
    every series (suffixes included) of keel serve's registry."""
    keys = {k for r in read_metrics(scraped_run.run_dir / "metrics.jsonl") for k in r}
    exported = exported_names() | {prom_metric(k).name for k in keys - {"step"}}
    exported |= set(serving_series())
    for expr in queries(dashboard()):
        names = set(METRIC.findall(expr))
        assert names, expr
        assert names <= exported, (expr, names - exported)


def test_serving_queries_use_the_series_and_labels_keel_serve_exports():
    """Each serving query: its series exist with these suffixes (a histogram is read through
    _bucket/_sum/_count, never by its bare name), `by (…)` groups and label matchers name
    labels the family has, and the generation-endpoint regex matches exactly the app's
    generation routes."""
    series = serving_series()
    for panel in sections(dashboard())["serving"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name in METRIC.findall(expr):
                assert name in series, (panel["title"], name)
                family_labels = series[name][1] | SCRAPE_LABELS
                grouped = {g.strip() for by in re.findall(r"by \(([^)]*)\)", expr)
                           for g in by.split(",")}  # fmt: skip
                matched = set(re.findall(r"(\w+)=~?\"", expr))
                assert grouped | matched <= family_labels, (panel["title"], expr)
            for regex in re.findall(r'endpoint=~"([^"]+)"', expr):
                served = {p for p in KNOWN_PATHS if re.fullmatch(regex, p)}
                assert served == set(GENERATION_PATHS), (regex, served)


def test_every_metric_family_has_a_panel():
    queried = {n for e in queries(dashboard()) for n in METRIC.findall(e)}
    wanted = {m.name for m in WELL_KNOWN.values()} | {
        "keel_step", "keel_last_step_timestamp_seconds", "keel_process_resident_memory_bytes",
        "keel_gpu_memory_allocated_bytes", "keel_gpu_utilization_ratio",
        "keel_timing_rollout_seconds", *WORKER_NAMES,
    }  # fmt: skip
    assert wanted <= queried, wanted - queried
    # every family keel serve registers, through any of its series, in a panel of the row
    in_panels = {
        n for p in sections(dashboard())["serving"] for t in p["targets"]
        for n in METRIC.findall(t["expr"])
    }  # fmt: skip
    series = serving_series()
    families = {family for family, _ in series.values()}
    shown = {series[n][0] for n in in_panels}
    assert families == shown, families - shown


def test_worker_panels_read_the_workers_series_by_their_labels():
    """The Ray workers' device series (keel_worker_*) have panels of their own, whose legends
    name only labels those series carry (role, rank, node beside run and algorithm)."""
    worker_targets = [
        t for p in sections(dashboard())["training"] for t in p["targets"]
        if any(n.startswith("keel_worker_") for n in METRIC.findall(t["expr"]))
    ]  # fmt: skip
    assert {n for t in worker_targets for n in METRIC.findall(t["expr"])} == set(WORKER_NAMES)
    for target in worker_targets:
        legend = set(re.findall(r"{{(\w+)}}", target["legendFormat"]))
        assert {"role", "rank", "node"} <= legend <= set(WORKER_LABELS), target["legendFormat"]
