"""Optional sinks for W&B and MLflow, used only when their package is importable.

Both stay off the network: W&B runs in offline mode under RUN_DIR/wandb (sync it later with
`wandb sync`), MLflow writes a file store under RUN_DIR/mlruns.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


class MissingPackageError(ValueError):
    """A config asks for a sink whose package is not installed."""


def require(package: str, field: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise MissingPackageError(
            f"{field}: true needs the `{package}` package, which is not installed "
            f"(pip install {package}, or set {field}: false)"
        )


class WandbSink:
    """W&B in offline mode; the run is named after RUN_DIR and carries the resolved config."""

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]):
        require("wandb", "monitor.wandb")
        import wandb

        self.run = wandb.init(
            mode="offline", dir=str(run_dir), name=name, config=config, reinit=True
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    """MLflow with a local file store at RUN_DIR/mlruns; keys keep their `area/name` form."""

    def __init__(self, run_dir: Path, name: str, params: dict[str, Any]):
        require("mlflow", "monitor.mlflow")
        # recent MLflow versions refuse the file store unless asked; it needs no database
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        import mlflow

        self.client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
        experiment = self.client.get_experiment_by_name("keel")
        exp_id = experiment.experiment_id if experiment else self.client.create_experiment("keel")
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        for key, value in params.items():
            self.client.log_param(self.run_id, key, value)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.client.log_metric(self.run_id, key, value, step=step)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
