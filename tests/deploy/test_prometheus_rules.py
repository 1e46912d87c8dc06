"""deploy/prometheus: the config and rules are valid, and promtool's rule unit tests pass."""

import re
import subprocess

import yaml

from tests.deploy.tools import REPO_DEPLOY, binary

PROM = REPO_DEPLOY / "prometheus"


def promtool(*args, cwd=PROM) -> subprocess.CompletedProcess:
    return subprocess.run(
        [binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_config_and_rules_are_valid():
    proc = promtool("check", "config", "prometheus.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "10 rules found" in proc.stdout


def test_the_kubernetes_config_finds_the_serving_pods():
    """kubernetes.yml discovers deploy/serve's pods through its headless Service, by DNS."""
    proc = promtool("check", "config", "kubernetes.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cfg = yaml.safe_load((PROM / "kubernetes.yml").read_text())
    assert cfg["rule_files"] == ["alerts.yml"]
    (job,) = cfg["scrape_configs"]
    (dns,) = job["dns_sd_configs"]
    services = yaml.safe_load_all((REPO_DEPLOY / "serve/base/service.yaml").read_text())
    headless = next(s for s in services if s["spec"].get("clusterIP") == "None")
    assert dns["names"] == [f"{headless['metadata']['name']}.default.svc.cluster.local"]
    assert headless["spec"]["publishNotReadyAddresses"] is True  # loading pods read as up == 0
    assert dns["port"] == headless["spec"]["ports"][0]["port"]
    assert job["job_name"] == "keel-serve"  # the job KeelServeNotReady watches


def test_alert_rule_unit_tests_pass():
    proc = promtool("test", "rules", "alerts_test.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_has_a_unit_test():
    groups = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    rules = [r for g in groups for r in g["rules"]]
    tests = yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]
    tested = {c["alertname"] for t in tests for c in t["alert_rule_test"] if c["exp_alerts"]}
    assert {r["alert"] for r in rules} == tested


def test_a_wrong_expectation_fails(tmp_path):
    """Breaking one expectation (KL alert expected not to fire at 25m) must make promtool fail."""
    suite = yaml.safe_load((PROM / "alerts_test.yml").read_text())
    kl = next(t for t in suite["tests"] if t["name"].startswith("KL"))
    firing = next(c for c in kl["alert_rule_test"] if c["exp_alerts"])
    firing["exp_alerts"] = []
    suite["rule_files"] = [str(PROM / "alerts.yml")]
    broken = tmp_path / "broken_test.yml"
    broken.write_text(yaml.safe_dump(suite))
    proc = promtool("test", "rules", str(broken), cwd=tmp_path)
    assert proc.returncode != 0
    assert "FAILED" in proc.stdout + proc.stderr
    assert "KeelKLAboveCeiling" in proc.stdout + proc.stderr


def test_serving_alerts_query_what_keel_serve_exports():
    """The keel-serve group reads only series keel.serve.metrics registers (suffixes included),
    and its endpoint regexes match the app's routes they mean."""
    from keel.serve.app import GENERATION_PATHS, KNOWN_PATHS
    from tests.deploy.tools import METRIC, serving_series

    groups = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"]
    rules = next(g for g in groups if g["name"] == "keel-serve")["rules"]
    series = serving_series()
    for rule in rules:
        names = set(METRIC.findall(rule["expr"])) - {"up"}
        assert names <= set(series), (rule["alert"], names - set(series))
        for regex in re.findall(r'endpoint=~"([^"]+)"', rule["expr"]):
            served = {p for p in KNOWN_PATHS if re.fullmatch(regex, p)}
            v1 = {p for p in KNOWN_PATHS if p.startswith("/v1/")}
            assert served in (set(GENERATION_PATHS), v1), (rule["alert"], regex, served)
