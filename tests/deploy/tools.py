"""The Prometheus binaries the deploy tests run (Debian's `prometheus` package, see .ci/run)."""

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
