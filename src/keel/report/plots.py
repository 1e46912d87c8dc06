"""The report's plots: one PNG per metric family, every run overlaid, events marked."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from keel.report.runs import RunData


@dataclass(frozen=True)
class Plot:
    """keys: curves drawn for every run that has them; with `alternatives`, each run draws
    only the first of the keys it has. optional: not listed as missing when no run has it."""

    name: str
    title: str
    keys: tuple[str, ...]
    ylabel: str
    alternatives: bool = False
    optional: bool = False

    def run_keys(self, run: RunData) -> tuple[str, ...]:
        """The keys drawn for `run`."""
        present = tuple(key for key in self.keys if run.curve(key)[0])
        return present[:1] if self.alternatives else present


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
    ),
    Plot(
        "dynamic_sampling",
        "Groups kept by dynamic sampling (of train.batch_size)",
        ("sampling/kept_groups",),
        "groups",
        optional=True,
    ),
)
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
    """Writes OUT_DIR/<plot.name>.png; None when no run has any of the plot's keys."""
    curves = [(run, key, *run.curve(key)) for run in runs for key in plot.run_keys(run)]
    if not curves:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    several_keys = len({key for _, key, _, _ in curves}) > 1
    for run, key, steps, values in curves:
        color = colors[runs.index(run) % len(colors)]
        style = "-" if key == plot.keys[0] or plot.alternatives or not several_keys else ":"
        label = run.name + (f" {key}" if several_keys else "")
        ax.plot(
            steps, values, style, color=color, label=label, marker="." if len(steps) < 30 else None
        )
    _mark_events(ax, runs)
    ax.set_title(plot.title)
    ax.set_xlabel("step")
    ax.set_ylabel(plot.ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / f"{plot.name}.png"
    fig.savefig(path)
    plt.close(fig)
    return path


def _mark_events(ax, runs: list[RunData]) -> None:
    labelled: set[str] = set()
    for run in runs:
        for event in run.events:
            kind = event.get("event")
            if kind not in EVENT_STYLE:
                continue
            color, style = EVENT_STYLE[kind]
            name = kind if len(runs) == 1 else f"{run.name}: {kind}"
            label = None if name in labelled else name
            labelled.add(name)
            ax.axvline(int(event["step"]), color=color, linestyle=style, alpha=0.7, label=label)
