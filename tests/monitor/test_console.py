"""The console sink: its plain lines without a terminal (when they come, the pace they carry)
and the headline (evaluation results say the step they were measured at)."""

from keel.monitor.console import ConsoleSink, duration, headline


def test_eval_accuracy_between_evaluations_shows_its_step(capsys):
    sink = ConsoleSink(total=30, every=10, enabled=True)  # stderr is not a terminal: plain lines
    sink.log(0, {"eval/accuracy": 0.25})
    for step in range(1, 31):
        metrics = {"reward/mean": step / 100}
        if step == 20:
            metrics["eval/accuracy"] = 0.5
        sink.log(step, metrics)
    lines = [line.split("  [")[0] for line in capsys.readouterr().err.splitlines()]
    assert lines == [
        "30 steps; a progress line every 10 steps (monitor.progress_every_steps, "
        "monitor.progress_every_seconds)",  # with the first line, here step 0's evaluation
        "step 0/30  eval_acc=0.25 (step 0)",
        "step 1/30  reward=0.01  eval_acc=0.25 (step 0)",
        "step 10/30  reward=0.1  eval_acc=0.25 (step 0)",
        "step 20/30  reward=0.2  eval_acc=0.5 (step 20)",
        "step 30/30  reward=0.3  eval_acc=0.5 (step 20)",
    ]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_lines_by_seconds_carry_the_pace(capsys):
    """every 0 steps, 60 s: a line after the first step (the line saying when lines come just
    before it, not at the start), then after the first step ending 60 s or more after the
    previous line, and after the last; each with s/step and the time left."""
    clock = Clock()
    sink = ConsoleSink(total=10, every=0, seconds=60, enabled=True, clock=clock)
    assert capsys.readouterr().err == ""  # an error before the first step stays the only line
    for step in range(1, 11):
        clock.now += 25.0  # 25 s per step
        sink.log(step, {"reward/mean": 0.5})
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "10 steps; a progress line every 60 s (monitor.progress_every_steps, "
        "monitor.progress_every_seconds)",
        "step 1/10  reward=0.5  [25 s/step, 3m45s left]",
        "step 4/10  reward=0.5  [25 s/step, 2m30s left]",
        "step 7/10  reward=0.5  [25 s/step, 1m15s left]",
        "step 10/10  reward=0.5  [25 s/step, 0s left]",
    ]


def test_disabled_prints_nothing(capsys):
    sink = ConsoleSink(total=3, every=1, seconds=1, enabled=False)
    for step in range(4):
        sink.log(step, {"eval/accuracy": 0.1, "reward/mean": 0.2})
    assert capsys.readouterr().err == ""


def test_duration():
    assert [duration(s) for s in (0.4, 59, 61, 3599, 3725)] == ["0s", "59s", "1m01s", "59m59s",
                                                                "1h02m"]  # fmt: skip


def test_training_metrics_carry_no_step():
    assert headline({"reward/mean": 0.5, "actor/kl": 0.01}, {"reward/mean": 3}) == (
        "reward=0.5  kl=0.01"
    )
