"""Which sinks a run gets, from the `monitor:` config section."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from keel.config.schema import KeelConfig
from keel.monitor.console import ConsoleSink
from keel.monitor.jsonl import JsonlSink
from keel.monitor.monitor import Monitor
from keel.monitor.optional import MlflowSink, WandbSink, check_wandb, require
from keel.monitor.samples import SamplesLog


def check_monitor_config(cfg: KeelConfig) -> None:
    """Fails before the run starts when an optional sink's package is missing, W&B is asked to
    run online without credentials, or the exporter's port is taken."""
    if cfg.monitor.prometheus is not None:
        from keel.monitor.prometheus import check_listen

        check_listen(cfg.monitor.prometheus.host, cfg.monitor.prometheus.port)
    if cfg.monitor.wandb is not None:
        check_wandb(cfg.monitor.wandb, os.environ)
    if cfg.monitor.mlflow is not None:
        require("mlflow", "monitor.mlflow", install="mlflow-skinny")


def build_monitor(cfg: KeelConfig, run_dir: Path, title: str) -> tuple[Monitor, SamplesLog]:
    """The run's Monitor and samples log, as `cfg.monitor` asks."""
    m = cfg.monitor
    console = ConsoleSink(
        cfg.train.steps, title=title, every=m.progress_every_steps,
        seconds=m.progress_every_seconds, enabled=m.progress,
    )  # fmt: skip
    sinks: list = [console]
    if m.jsonl:
        sinks.append(JsonlSink(run_dir / "metrics.jsonl"))
    if m.prometheus is not None:
        from keel.monitor.prometheus import PrometheusSink

        exporter = PrometheusSink(
            run=run_dir.name, algorithm=cfg.algorithm.name, host=m.prometheus.host,
            port=m.prometheus.port,
        )  # fmt: skip
        print(f"keel: metrics at {exporter.url}/metrics", file=sys.stderr, flush=True)
        sinks.append(exporter)
    if m.tensorboard:
        from keel.monitor.tensorboard import TensorBoardSink

        sinks.append(TensorBoardSink(run_dir / "tensorboard"))
    flat, steps = _flat_config(cfg), cfg.train.steps
    try:
        if m.wandb is not None:
            sinks.append(WandbSink(run_dir, run_dir.name, flat, m.wandb, steps))
        if m.mlflow is not None:
            sinks.append(MlflowSink(run_dir, run_dir.name, flat, m.mlflow, steps))
    except BaseException:
        Monitor(sinks).close()  # the tracker that did start, the exporter's port
        raise
    s = m.samples
    samples = SamplesLog(
        run_dir / "samples.jsonl", every=s.every, count=s.count,
        console=console.console if s.console else None,
    )  # fmt: skip
    return Monitor(sinks), samples


def _flat_config(cfg: KeelConfig) -> dict[str, object]:
    out: dict[str, object] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = value

    walk("", cfg.model_dump(mode="json"))
    return out
