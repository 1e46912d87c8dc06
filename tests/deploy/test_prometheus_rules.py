"""deploy/prometheus: the config and rules are valid, and promtool's rule unit tests pass."""

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
    assert "6 rules found" in proc.stdout


def test_alert_rule_unit_tests_pass():
    proc = promtool("test", "rules", "alerts_test.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_alert_has_a_unit_test():
    rules = yaml.safe_load((PROM / "alerts.yml").read_text())["groups"][0]["rules"]
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
