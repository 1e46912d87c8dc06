"""The console: the training sink (a rich progress bar whose description carries the headline
numbers) and a plain progress bar over items (`ItemProgress`, for `keel eval`)."""

from __future__ import annotations

from collections.abc import Mapping

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

HEADLINE = (
    ("reward/mean", "reward"),
    ("eval/accuracy", "eval_acc"),
    ("actor/pg_loss", "pg"),
    ("actor/sft_loss", "loss"),
    ("rm/loss", "rm_loss"),
    ("eval/rm/accuracy", "eval_rm_acc"),
    ("dpo/loss", "dpo_loss"),
    ("eval/rewards/accuracies", "eval_pref_acc"),
    ("actor/kl", "kl"),
    ("actor/entropy", "ent"),
    ("perf/tokens_per_second", "tok/s"),
)


def started_bar(
    console: Console, total: int, title: str, enabled: bool, *, headline: bool
) -> Progress | None:
    """A started rich progress bar of one task over `total` on `console` when it is a terminal
    (None otherwise, or when not `enabled`). headline: a text column for the task's description
    (the training headline), kept on screen; without it the bar goes away when done."""
    if not (enabled and console.is_terminal):
        return None
    columns = [
        TextColumn("[bold]{task.fields[title]}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
    ]
    if headline:
        columns.append(TextColumn("{task.description}"))
    progress = Progress(*columns, console=console, transient=not headline)
    progress.add_task("", total=total, title=title)
    progress.start()
    return progress


class ConsoleSink:
    """Progress over `total` steps; without a terminal it prints one line every `every` steps."""

    def __init__(self, total: int, *, title: str = "train", every: int = 10, enabled: bool = True):
        self.total = total
        self.every = max(every, 1)
        self.enabled = enabled
        self.console = Console(stderr=True)
        self.last: dict[str, float] = {}
        self.measured_at: dict[str, int] = {}  # the step each key of `last` was logged at
        self.progress = started_bar(self.console, total, title, enabled, headline=True)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.last.update(metrics)
        self.measured_at.update(dict.fromkeys(metrics, step))
        text = headline(self.last, self.measured_at)
        if self.progress is not None:
            self.progress.update(self.progress.task_ids[0], completed=step, description=text)
        elif self.enabled and (step % self.every == 0 or step == self.total):
            self.console.print(f"step {step}/{self.total}  {text}", highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def headline(metrics: Mapping[str, float], measured_at: Mapping[str, int] | None = None) -> str:
    """`label=value` for each HEADLINE key present. Evaluation results (`eval/*`, logged only on
    evaluation steps) carry the step they were measured at: `eval_acc=0.42 (step 40)`."""
    parts = []
    for key, label in HEADLINE:
        if key in metrics:
            v = metrics[key]
            part = f"{label}={v:.0f}" if abs(v) >= 1000 else f"{label}={v:.3g}"
            if key.startswith("eval/") and measured_at and key in measured_at:
                part += f" (step {measured_at[key]})"
            parts.append(part)
    return "  ".join(parts)


class ItemProgress:
    """A progress bar over `total` items (e.g. the examples `keel eval` answers) on stderr when
    it is a terminal; nothing when it is not, or when `enabled` is False. A context manager."""

    def __init__(self, total: int, *, title: str, enabled: bool = True):
        self.console = Console(stderr=True)
        self.progress = started_bar(self.console, total, title, enabled, headline=False)

    def advance(self, n: int) -> None:
        """`n` more items are done."""
        if self.progress is not None:
            self.progress.update(self.progress.task_ids[0], advance=n)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def __enter__(self) -> ItemProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
