"""The console: the training sink (a rich progress bar whose description carries the headline
numbers) and a plain progress bar over items (`ItemProgress`, for `keel eval`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

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
    """Progress over `total` steps. On a terminal: a bar whose description is the headline.
    Otherwise (a log file, a pipe, a Job's logs) plain lines: after the first step this process
    runs, then every `every` steps and after the first step that ends `seconds` or more after
    the previous line (0 turns either off), after the last step, and at once for a row with
    evaluation results (`eval/*`). Each line says the pace: seconds per step and the time left
    at that pace. The first line comes with one before it saying when lines will come (not at
    the start: a run that stops on an error before its first line prints only the error).
    clock: seconds (time.monotonic), for tests."""

    def __init__(
        self,
        total: int,
        *,
        title: str = "train",
        every: int = 10,
        seconds: float = 0.0,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total = total
        self.every, self.seconds = max(every, 0), max(seconds, 0.0)
        self.enabled = enabled
        self.clock = clock
        self.console = Console(stderr=True)
        self.last: dict[str, float] = {}
        self.measured_at: dict[str, int] = {}  # the step each key of `last` was logged at
        self.progress = started_bar(self.console, total, title, enabled, headline=True)
        self.started = self.last_line = self.last_log = clock()
        self.first_step: int | None = None  # the first step this process logged (a resume's)
        self.announced = False  # the line saying when lines come, printed with the first one

    def announcement(self) -> str:
        """Without a terminal: the line saying when progress lines will come."""
        when = [f"every {self.every} steps"] if self.every else []
        when += [f"every {self.seconds:g} s"] if self.seconds else []
        how = " or ".join(when) or "after the first and the last step"
        return (
            f"{self.total} steps; a progress line {how} (monitor.progress_every_steps, "
            "monitor.progress_every_seconds)"
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.last.update(metrics)
        self.measured_at.update(dict.fromkeys(metrics, step))
        text = headline(self.last, self.measured_at)
        if self.progress is not None:
            self.progress.update(self.progress.task_ids[0], completed=step, description=text)
            return
        if not self.enabled:
            return
        now, before = self.clock(), self.last_log
        self.last_log = now
        first = False
        if step > 0 and self.first_step is None:  # its time runs from the previous row's log
            self.first_step, self.started, first = step, before, True
        due = (
            first
            or step == self.total
            or any(key.startswith("eval/") for key in metrics)
            or (self.every and step > 0 and step % self.every == 0)
            or (self.seconds and now - self.last_line >= self.seconds)
        )
        if due:
            if not self.announced:
                self.console.print(self.announcement(), highlight=False, soft_wrap=True)
                self.announced = True
            self.console.print(
                f"step {step}/{self.total}  {text}{self._pace(step, now)}",
                highlight=False,
                soft_wrap=True,
            )
            self.last_line = now

    def _pace(self, step: int, now: float) -> str:
        """`  [12.3 s/step, 4m10s left]` from the steps this process ran; '' before any."""
        if self.first_step is None or step < self.first_step:
            return ""
        done = step - self.first_step + 1
        per = (now - self.started) / done
        left = max(self.total - step, 0) * per
        return f"  [{per:.3g} s/step, {duration(left)} left]"

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()


def duration(seconds: float) -> str:
    """1h02m, 4m10s, 12s."""
    s = round(seconds)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


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
