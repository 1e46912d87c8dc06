"""`keel report`: PNGs and one self-contained HTML page from real run directories."""

import json
import re
import shutil

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import to_hex
from PIL import Image

from keel.cli.main import main
from keel.report import ReportError, load_run, write_report
from keel.report.plots import PLOTS, draw, figure

GUARD_EVENTS = [  # contract C2, as the guard writes them
    {"time": 1.7e9, "step": 2, "event": "guard_trip", "message": "kl 3.1 > 1.0",
     "rule": "kl_max", "action": "rollback"},
    {"time": 1.7e9 + 1, "step": 2, "event": "rollback", "message": "rolled back to step 1"},
    {"time": 1.7e9 + 2, "step": 4, "event": "checkpoint", "message": "saved step 4"},
]  # fmt: skip


def copy_run(scraped_run, tmp_path, name):
    run_dir = tmp_path / name
    shutil.copytree(scraped_run.run_dir, run_dir, ignore=shutil.ignore_patterns("model", "chec*"))
    return run_dir


def test_report_of_a_real_run_via_the_cli(scraped_run, tmp_path, capsys):
    run_dir = copy_run(scraped_run, tmp_path, "grpo-tiny")
    with (run_dir / "events.jsonl").open("w") as fh:
        fh.writelines(json.dumps(e) + "\n" for e in GUARD_EVENTS)
    assert main(["report", str(run_dir)]) == 0
    assert f"report: {run_dir / 'report' / 'report.html'}" in capsys.readouterr().err
    out = run_dir / "report"
    pngs = sorted(p.name for p in out.glob("*.png"))
    grpo_plots = [p for p in PLOTS if not p.optional]  # a GRPO run has data for all of them
    assert pngs == sorted(f"{p.name}.png" for p in grpo_plots)
    for name in pngs:
        with Image.open(out / name) as img:
            assert img.size[0] > 300 and img.getextrema() != ((255, 255),) * 4
    page = (out / "report.html").read_text()
    for plot in grpo_plots:
        assert f"{plot.name}.png" in page and plot.title in page
    assert len(re.findall(r'src="data:image/png;base64,', page)) == len(grpo_plots)
    assert "No data for" not in page  # the dynamic-sampling plot is optional
    assert "<img" in page and 'src="http' not in page  # self-contained
    assert "kl 3.1 &gt; 1.0" in page and "rolled back to step 1" in page
    assert "sample" in page.lower()


def red_pixels(path):
    with Image.open(path) as img:
        rgb = img.convert("RGB")
        return sum(1 for r, g, b in rgb.get_flattened_data() if r > 180 and g < 150 and b < 150)


def test_guard_events_are_marked_on_the_curves(scraped_run, tmp_path):
    run_dir = copy_run(scraped_run, tmp_path, "grpo-tiny")
    plain = draw(PLOTS[0], [load_run(run_dir)], tmp_path)
    plain_red = red_pixels(plain)
    (run_dir / "events.jsonl").write_text(json.dumps(GUARD_EVENTS[0]) + "\n")
    (tmp_path / "marked").mkdir()
    marked = draw(PLOTS[0], [load_run(run_dir)], tmp_path / "marked")
    assert red_pixels(marked) > plain_red + 50  # the dashed red guard_trip line


def test_several_runs_overlay_and_a_run_still_being_written(scraped_run, tmp_path):
    a = copy_run(scraped_run, tmp_path / "a", "run")
    b = copy_run(scraped_run, tmp_path / "b", "run")
    with (b / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 7, "reward/me')  # the writer is mid-line
    runs = [load_run(a, name="a"), load_run(b, name="b")]
    assert runs[1].metrics[-1]["step"] == 6
    page = write_report(runs, tmp_path / "both").read_text()
    assert "<td>a</td>" in page and "<td>b</td>" in page
    assert (tmp_path / "both" / "reward.png").stat().st_size > 1000


def test_bad_input_names_the_file_and_line(tmp_path):
    with pytest.raises(ReportError, match=r"no metrics\.jsonl"):
        load_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl:2"):
        load_run(tmp_path)


def test_cli_error_for_a_missing_run(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("keel: error:") and "no metrics.jsonl" in err


def write_run(path, rows):
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return load_run(path)


def test_dynamic_sampling_runs_are_compared_on_the_mean_over_every_generated_group(tmp_path):
    """DAPO's reward/mean covers the kept groups only: 0.9 here, while the policy scores 0.2 over
    everything it generated; the GRPO run (0.5 over everything) must not look worse."""
    grpo = write_run(tmp_path / "grpo", [{"step": s, "reward/mean": 0.5} for s in (1, 2)])
    dapo = write_run(tmp_path / "dapo", [
        {"step": s, "reward/mean": 0.9, "sampling/score_mean_all": 0.2,
         "sampling/kept_groups": 2.0} for s in (1, 2)
    ])  # fmt: skip
    reward, sampling = PLOTS[0], next(p for p in PLOTS if p.name == "dynamic_sampling")
    assert reward.run_keys(dapo) == ("sampling/score_mean_all",)
    assert reward.run_keys(grpo) == ("reward/mean",)
    page = write_report([grpo, dapo], tmp_path / "out").read_text()
    assert "<td>0.5</td>" in page and "<td>0.2 (all generated groups)</td>" in page
    assert "0.9" not in page
    assert (tmp_path / "out" / "dynamic_sampling.png").is_file()
    assert draw(sampling, [grpo], tmp_path) is None


def test_a_line_that_is_not_utf8_names_the_file_and_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_bytes(b'{"step": 1}\n{"step": 2, "x": "\xff"}\n')
    with pytest.raises(ReportError, match=r"metrics\.jsonl:2: not valid UTF-8"):
        load_run(tmp_path)


def test_multi_turn_runs_get_turn_and_tool_use_plots(tmp_path):
    rows = [
        {"step": s, "reward/mean": 0.1 * s, "episode/turns_mean": 4.0 - s,
         "episode/tool_use_frac": 0.2 * s, "episode/tool_calls_mean": 0.3 * s,
         "eval/turns_mean": 3.5 - s}
        for s in (1, 2)
    ]  # fmt: skip
    run = write_run(tmp_path / "agent", rows)
    turns, tools = (next(p for p in PLOTS if p.name == n) for n in ("episode_turns", "tool_use"))
    assert turns.run_keys(run) == ("episode/turns_mean", "eval/turns_mean")
    assert tools.run_keys(run) == ("episode/tool_use_frac", "episode/tool_calls_mean")
    write_report([run], tmp_path / "out")
    assert (tmp_path / "out" / "episode_turns.png").is_file()
    assert (tmp_path / "out" / "tool_use.png").is_file()
    single = write_run(tmp_path / "single", [{"step": 1, "reward/mean": 0.5}])
    assert draw(turns, [single], tmp_path) is None  # optional: absent from single-turn runs


def curves_by_panel(fig):
    """[(y label, [(label, colour hex, line style) of each curve])] of each axes of `fig`
    (event markers, vertical lines of two points at one x, left out)."""
    out = []
    for ax in fig.axes:
        lines = [
            (line.get_label(), to_hex(line.get_color()), line.get_linestyle())
            for line in ax.get_lines()
            if len(set(line.get_xdata())) > 1
        ]
        out.append((ax.get_ylabel(), lines))
    return out


def legend_outside(fig, ax):
    """Whether `ax`'s legend lies wholly to the right of its plotting area (display coords)."""
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    return legend.x0 >= ax.get_window_extent().x1


def test_tool_use_plot_has_one_quantity_per_panel_in_distinct_colours(tmp_path):
    rows = [
        {"step": s, "episode/tool_use_frac": 0.1 * s, "eval/tool_use_frac": 0.12 * s,
         "episode/tool_calls_mean": 0.2 * s, "episode/tool_errors_mean": 0.5 - 0.05 * s}
        for s in range(1, 6)
    ]  # fmt: skip
    a = write_run(tmp_path / "a", rows)
    (tmp_path / "a" / "events.jsonl").write_text(json.dumps(GUARD_EVENTS[0]) + "\n")
    a = load_run(tmp_path / "a")
    b = write_run(tmp_path / "b", [{**r, "episode/tool_calls_mean": 0.3} for r in rows])
    tools = next(p for p in PLOTS if p.name == "tool_use")

    fig = figure(tools, [a])
    panels = curves_by_panel(fig)
    assert [label for label, _ in panels] == [
        "episodes with a tool call", "tool calls / episode", "tool errors / episode"
    ]  # fmt: skip
    fraction, calls, errors = (lines for _, lines in panels)
    assert [name for name, _, _ in fraction] == ["a episode/tool_use_frac", "a eval/tool_use_frac"]
    assert len({colour for _, colour, _ in fraction}) == 2  # one run: a colour per key
    assert len(calls) == len(errors) == 1
    assert all(legend_outside(fig, ax) for ax in fig.axes)
    assert any(line.get_label() == "guard_trip" for line in fig.axes[0].get_lines())
    plt.close(fig)

    fig = figure(tools, [a, b])
    for _, lines in curves_by_panel(fig):  # several runs: every curve its own colour or style
        assert len({(colour, style) for _, colour, style in lines}) == len(lines)
        runs_colours = {name.split()[0]: colour for name, colour, _ in lines}
        assert runs_colours["a"] != runs_colours["b"]
    plt.close(fig)
    assert draw(tools, [a, b], tmp_path) == tmp_path / "tool_use.png"
