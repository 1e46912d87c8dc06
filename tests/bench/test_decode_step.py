"""bench/decode_step.py: every decode loop at two short lengths on a few rows; the Markdown
table's rows read back (the benchmark prints no JSON)."""

from bench.decode_step import main


def test_every_loop_reports_its_step_time_and_floor_multiple(capsys):
    main(["--rows", "4", "--prompts", "2", "--prompt-length", "4", "--lengths", "3,5",
          "--repeats", "1"])  # fmt: skip
    out = capsys.readouterr().out
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| ")]
    table = [[c.strip() for c in r] for r in rows if r[0].strip() != "loop"]
    assert [(r[0], r[1]) for r in table] == [
        (loop, r) for loop in ("keel", "static", "generate") for r in ("3", "5")
    ]
    for _, _, call_s, _, floor_s, times in table:
        # (the floor of a few tiny rows prints as 0.000 s; the multiple is of the unrounded one)
        assert float(call_s) > 0 and float(floor_s) >= 0 and float(times.rstrip("×")) > 0
    for loop in ("keel", "static", "generate"):
        assert f"{loop}: a 4-row step ≈" in out  # the fit of a step's fixed and per-position cost
