"""bench/startup.py: one `keel train` start-up of a tiny example in a fresh process under
cProfile, its phases read back; then the saved profile read again with --read."""

from tests.bench.smoke import json_lines, positive, run_bench


def test_one_example_reports_its_phases_and_the_profile_reads_back(tmp_path):
    out = run_bench("startup", "--examples", "sft_arith_tiny", "--save", str(tmp_path)).stdout
    (row,) = json_lines(out)
    assert row["example"] == "sft_arith_tiny" and row["rc"] == 0
    for phase in ("wall", "imports", "run_training", "config", "workers", "first_step"):
        assert positive(row[phase]), (phase, row)
    assert row["tokenizer_loads"] >= 1
    (again,) = json_lines(
        run_bench("startup", "--read", str(tmp_path / "sft_arith_tiny.prof")).stdout
    )
    assert again["first_step"] == row["first_step"]
