"""bench/example_figures.py: two examples for one step each from the tiny model (not the
warm start the figures use), their JSON lines read back."""

from bench.example_figures import main

from tests.bench.smoke import json_lines, positive


def test_one_step_of_two_examples_reports_accuracy_and_seconds(capsys, monkeypatch, tiny_dir):
    monkeypatch.setenv("KEEL_CACHE", str(tiny_dir.parent / "unused-cache"))  # main sets its own
    rc = main(["grpo", "sft", "--set", f"models.actor={tiny_dir}", "--set", "train.steps=1"])
    assert rc == 0
    rows = json_lines(capsys.readouterr().out)
    assert [r["example"] for r in rows] == ["grpo", "sft"]
    for row in rows:
        assert 0 <= row["accuracy_start"] <= 1 and 0 <= row["accuracy_end"] <= 1
        assert positive(row["seconds"]) and row["cpu_capability"]
    assert "reward_mean_first10" in rows[0]  # an RL run logs rewards; SFT does not
    assert "reward_mean_first10" not in rows[1]
