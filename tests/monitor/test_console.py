"""The console sink's headline: evaluation results say the step they were measured at."""

from keel.monitor.console import ConsoleSink, headline


def test_eval_accuracy_between_evaluations_shows_its_step(capsys):
    sink = ConsoleSink(total=30, every=10, enabled=True)  # stderr is not a terminal: plain lines
    sink.log(0, {"eval/accuracy": 0.25})
    for step in range(1, 31):
        metrics = {"reward/mean": step / 100}
        if step == 20:
            metrics["eval/accuracy"] = 0.5
        sink.log(step, metrics)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "step 0/30  eval_acc=0.25 (step 0)",
        "step 10/30  reward=0.1  eval_acc=0.25 (step 0)",
        "step 20/30  reward=0.2  eval_acc=0.5 (step 20)",
        "step 30/30  reward=0.3  eval_acc=0.5 (step 20)",
    ]


def test_training_metrics_carry_no_step():
    assert headline({"reward/mean": 0.5, "actor/kl": 0.01}, {"reward/mean": 3}) == (
        "reward=0.5  kl=0.01"
    )
