"""The TensorBoard sink: event files that TensorBoard itself reads back."""

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from keel.monitor import read_metrics


def test_run_writes_every_metric_as_a_scalar(scraped_run):
    events = EventAccumulator(str(scraped_run.run_dir / "tensorboard"))
    events.Reload()
    rows = read_metrics(scraped_run.run_dir / "metrics.jsonl")
    tags = set(events.Tags()["scalars"])
    assert {k for r in rows for k in r if k != "step"} == tags
    reward = [(e.step, e.value) for e in events.Scalars("reward/mean")]
    assert reward == [(r["step"], pytest.approx(r["reward/mean"])) for r in rows if r["step"]]
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 3, 6]
