"""Metric sinks: one `Monitor.log(step, metrics)` fanned out to the console and metrics.jsonl."""

from keel.monitor.console import ConsoleSink
from keel.monitor.jsonl import JsonlSink, read_metrics
from keel.monitor.monitor import Monitor, StageTimer

__all__ = ["ConsoleSink", "JsonlSink", "Monitor", "StageTimer", "read_metrics"]
