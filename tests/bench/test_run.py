"""bench/run.py (`make bench`): one timed step of one case, its JSON line read back."""

from bench.run import CASES, main

from tests.bench.smoke import json_lines, positive


def test_one_step_of_a_case_prints_its_median_step_time(capsys):
    main(["--steps", "1", "--warmup", "0", "--cases", "grpo_8x8_ref"])
    (row,) = json_lines(capsys.readouterr().out)
    assert row["case"] == "grpo_8x8_ref" and "grpo_8x8_ref" in CASES
    assert positive(row["median_step_s"])
    assert row["threads"] == 1
