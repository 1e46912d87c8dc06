"""The exporter during a real tiny GRPO run: scraped over HTTP while the run trained."""

import pytest

from keel.monitor import read_metrics
from keel.monitor.prom_names import prom_metric
from tests.monitor.live import samples


def by_step(scraped_run):
    """{step: parsed page} of the scrapes taken during the run, one per step seen."""
    out = {}
    for text in scraped_run.scrapes:
        page = samples(text)
        steps = [v for (name, _), v in page.items() if name == "keel_step"]
        if steps:
            out[int(steps[0])] = page
    return out


def test_scraped_values_are_the_logged_ones(scraped_run):
    pages = by_step(scraped_run)
    rows = {r["step"]: r for r in read_metrics(scraped_run.run_dir / "metrics.jsonl")}
    seen = sorted(s for s in pages if s >= 1)
    assert len(seen) >= 2, f"scrapes saw steps {sorted(pages)}"
    run = {("run", "grpo-tiny"), ("algorithm", "grpo")}
    for step in seen:
        page, row = pages[step], rows[step]
        names = {name for name, _ in page}
        for key, value in row.items():
            if key == "step":
                continue
            m = prom_metric(key)
            assert m.name in names, (key, m.name)
            if m.kind == "gauge":
                lab = frozenset(run | ({("role", m.role)} if m.role else set()))
                assert page[(m.name, lab)] == pytest.approx(value * m.scale), key
    last = pages[seen[-1]]
    assert any(n == "keel_process_resident_memory_bytes" for n, _ in last)


def test_checkpoint_metrics_and_healthz(scraped_run):
    rows = read_metrics(scraped_run.run_dir / "metrics.jsonl")
    saves = [r for r in rows if "checkpoint/count" in r]
    assert [r["step"] for r in saves] == [2, 4, 6]
    assert [r["checkpoint/count"] for r in saves] == [1, 2, 3]
    assert all(r["checkpoint/save_s"] > 0 for r in saves)
    assert saves[0]["checkpoint/saved_at"] < saves[-1]["checkpoint/saved_at"]
    assert scraped_run.health and all(h["status"] == "ok" for h in scraped_run.health)
    assert max(h.get("step", 0) for h in scraped_run.health) >= 2
