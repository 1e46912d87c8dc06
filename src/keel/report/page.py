"""The report's HTML page: a summary of each run, every plot inline, events and samples."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from keel.report.plots import PLOTS, REWARD_KEYS, draw
from keel.report.runs import RunData

# (column, the keys it shows: the first one a run has)
SUMMARY = (
    ("reward", REWARD_KEYS),
    ("eval/accuracy", ("eval/accuracy",)),
    ("actor/kl", ("actor/kl",)),
    ("perf/tokens_per_second", ("perf/tokens_per_second",)),
)
NOTES = {"sampling/score_mean_all": " (all generated groups)"}
STYLE = (
    "body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
    "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px}"
    "img{max-width:100%}"
)


def write_report(runs: list[RunData], out_dir: str | Path) -> Path:
    """Writes OUT_DIR/<plot>.png for each plot with data and OUT_DIR/report.html; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    drawn = [(plot, path) for plot in PLOTS if (path := draw(plot, runs, out)) is not None]
    body = [f"<h1>Keel report: {html.escape(', '.join(r.name for r in runs))}</h1>"]
    body += _summary(runs)
    for plot, path in drawn:
        data = base64.b64encode(path.read_bytes()).decode()
        body.append(f'<h2 id="{plot.name}">{html.escape(plot.title)} ({path.name})</h2>')
        body.append(f'<img alt="{plot.name}" src="data:image/png;base64,{data}">')
    missing = [p.title for p in PLOTS if p not in [d[0] for d in drawn] and not p.optional]
    if missing:
        body.append(f"<p>No data for: {html.escape(', '.join(missing))}.</p>")
    body += _events(runs) + _samples(runs)
    page = out / "report.html"
    page.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>Keel report</title>"
        f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>\n",
        encoding="utf-8",
    )
    return page


def _summary(runs: list[RunData]) -> list[str]:
    columns = ("run", "path", "last step", *(column for column, _ in SUMMARY))
    head = "".join(f"<th>{k}</th>" for k in columns)
    rows = []
    for run in runs:
        last = run.metrics[-1]["step"] if run.metrics else "-"
        cells = [run.name, str(run.path), str(last)]
        for _, keys in SUMMARY:
            key = next((k for k in keys if run.curve(k)[0]), keys[0])
            values = run.curve(key)[1]
            cells.append(f"{values[-1]:.4g}{NOTES.get(key, '')}" if values else "-")
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return [f"<table><tr>{head}</tr>{''.join(rows)}</table>"]


def _events(runs: list[RunData]) -> list[str]:
    rows = [
        f"<tr><td>{html.escape(r.name)}</td><td>{e.get('step')}</td>"
        f"<td>{html.escape(str(e.get('event')))}</td><td>{html.escape(str(e.get('message', '')))}"
        "</td></tr>"
        for r in runs
        for e in r.events
    ]
    if not rows:
        return ["<h2>Events</h2><p>No events.jsonl entries.</p>"]
    head = "<tr><th>run</th><th>step</th><th>event</th><th>message</th></tr>"
    return ["<h2>Events</h2><table>", head, *rows, "</table>"]


def _samples(runs: list[RunData], last: int = 8) -> list[str]:
    out = ["<h2>Samples</h2>"]
    for run in runs:
        if not run.samples:
            continue
        out.append(f"<h3>{html.escape(run.name)}</h3><table>")
        out.append("<tr><th>step</th><th>reward</th><th>prompt</th><th>response</th></tr>")
        for s in run.samples[-last:]:
            cells = (s.get("step"), s.get("reward", "-"), s.get("prompt"), s.get("response"))
            out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
        out.append("</table>")
    return out
