"""The report's plots: one PNG per metric family, every run overlaid, events marked."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from keel.report.runs import RunData


@dataclass(frozen=True)
class Plot:
    """keys: curves drawn for every run that has them; with `alternatives`, each run draws
    only the first of the keys it has. optional: not listed as missing when no run has it.
    panels: (y label, keys) of each panel, stacked on one step axis, for a plot of several
    quantities (one quantity per panel); empty: one panel of every key, labelled `ylabel`."""

    name: str
    title: str
    keys: tuple[str, ...]
    ylabel: str
    alternatives: bool = False
    optional: bool = False
    panels: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def run_keys(self, run: RunData) -> tuple[str, ...]:
        """The keys drawn for `run`."""
        present = tuple(key for key in self.keys if run.curve(key)[0])
        return present[:1] if self.alternatives else present

    def panel_keys(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(y label, keys) of each panel."""
        return self.panels or ((self.ylabel, self.keys),)


# A dynamic-sampling run's reward/mean covers the kept groups only (biased upwards):
# sampling/score_mean_all, the mean over every generated response, is what compares with others.
REWARD_KEYS = ("sampling/score_mean_all", "reward/mean")

PLOTS = (
    Plot(
        "reward",
        "Reward (mean over every generated response)",
        REWARD_KEYS,
        "reward",
        alternatives=True,
    ),
    Plot("eval_accuracy", "Held-out accuracy", ("eval/accuracy",), "accuracy"),
    Plot("kl", "KL to the reference", ("actor/kl",), "nats"),
    Plot("entropy", "Policy entropy", ("actor/entropy",), "nats"),
    Plot(
        "losses",
        "Losses",
        ("actor/pg_loss", "actor/sft_loss", "critic/value_loss", "actor/loss"),
        "loss",
    ),
    Plot("response_length", "Response length (mean)", ("response/length_mean",), "tokens"),
    Plot("throughput", "Throughput", ("perf/tokens_per_second",), "tokens / s"),
    Plot(
        "episode_turns",
        "Turns per episode (multi-turn rollouts)",
        ("episode/turns_mean", "eval/turns_mean"),
        "turns",
        optional=True,
    ),
    Plot(
        "tool_use",
        "Tool use (episodes with a tool call; tool calls and errors per episode)",
        (
            "episode/tool_use_frac",
            "eval/tool_use_frac",
            "episode/tool_calls_mean",
            "episode/tool_errors_mean",
        ),
        "fraction / count",
        optional=True,
        panels=(
            ("episodes with a tool call", ("episode/tool_use_frac", "eval/tool_use_frac")),
            ("tool calls / episode", ("episode/tool_calls_mean",)),
            ("tool errors / episode", ("episode/tool_errors_mean",)),
        ),
    ),
    Plot(
        "dynamic_sampling",
        "Groups kept by dynamic sampling (of train.batch_size)",
        ("sampling/kept_groups",),
        "groups",
        optional=True,
    ),
)
LINE_STYLES = ("-", "--", ":", "-.")
# events.jsonl entries drawn as vertical lines (contract C2); checkpoints are not marked.
EVENT_STYLE = {
    "guard_trip": ("tab:red", "--"),
    "rollback": ("tab:purple", "-"),
    "stop": ("black", "-"),
    "resume": ("tab:green", ":"),
    "restart": ("tab:green", "-."),
    "signal": ("tab:orange", ":"),
    "warning": ("tab:olive", ":"),
}


def draw(plot: Plot, runs: list[RunData], out_dir: Path) -> Path | None:
    """Writes OUT_DIR/<plot.name>.png (figure()); None when no run has any of the plot's keys."""
    fig = figure(plot, runs)
    if fig is None:
        return None
    path = out_dir / f"{plot.name}.png"
    fig.savefig(path, bbox_inches="tight")  # the legends outside the axes included
    plt.close(fig)
    return path


def figure(plot: Plot, runs: list[RunData]) -> Figure | None:
    """The plot's figure (the caller closes it); None when no run has any of its keys.

    One panel per entry of plot.panel_keys() that has data, stacked on a shared step axis. In a
    panel of several keys, one run's curves each have their own colour; several runs have a
    colour each and a line style per key. Each panel's legend stands to the right of its
    curves; events are marked on every panel (named in the first one's legend)."""
    curves = [(run, key, *run.curve(key)) for run in runs for key in plot.run_keys(run)]
    if not curves:
        return None
    panels = [
        (label, [c for c in curves if c[1] in keys])
        for label, keys in plot.panel_keys()
        if any(c[1] in keys for c in curves)
    ]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(8.5, 1.2 + 2.6 * len(panels)), dpi=100, sharex=True,
        squeeze=False,
    )  # fmt: skip
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (ax, (label, drawn)) in enumerate(zip(axes[:, 0], panels, strict=True)):
        keys = list(dict.fromkeys(key for _, key, _, _ in drawn))
        several_keys = len(keys) > 1 and not plot.alternatives
        for run, key, steps, values in drawn:
            # several runs: a colour per run, a line style per key; one run: a colour per key
            index = keys.index(key) if several_keys and len(runs) == 1 else runs.index(run)
            color = colors[index % len(colors)]
            style = LINE_STYLES[keys.index(key) % len(LINE_STYLES)] if several_keys else "-"
            name = run.name + (f" {key}" if several_keys or len(panels) > 1 else "")
            marker = "." if len(steps) < 30 else None
            ax.plot(steps, values, style, color=color, label=name, marker=marker)
        _mark_events(ax, runs, named=i == 0)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    axes[0, 0].set_title(plot.title)
    axes[-1, 0].set_xlabel("step")
    return fig


def _mark_events(ax, runs: list[RunData], named: bool = True) -> None:
    """A vertical line at each event of EVENT_STYLE; `named`: each kind in the legend once."""
    labelled: set[str] = set()
    for run in runs:
        for event in run.events:
            kind = event.get("event")
            if kind not in EVENT_STYLE:
                continue
            color, style = EVENT_STYLE[kind]
            name = kind if len(runs) == 1 else f"{run.name}: {kind}"
            label = None if name in labelled or not named else name
            labelled.add(name)
            ax.axvline(int(event["step"]), color=color, linestyle=style, alpha=0.7, label=label)
