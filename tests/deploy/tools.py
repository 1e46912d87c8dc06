"""What the deploy tests share: the Prometheus binaries (Debian's `prometheus` package, see
.ci/run) and the Grafana dashboard's queries."""

import json
import re
import shutil
from pathlib import Path

import pytest

REPO_DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


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


GRAFANA = REPO_DEPLOY / "grafana"
METRIC = re.compile(r"\b(keel_[a-zA-Z0-9_]+|up)\b")


def dashboard() -> dict:
    return json.loads((GRAFANA / "dashboards" / "keel.json").read_text())


def queries(dash: dict) -> list[str]:
    """Every PromQL expression of the dashboard: panel targets and query variables."""
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    return exprs
