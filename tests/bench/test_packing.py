"""bench/packing.py: padded against packed passes on 4 rows of the tiny model, one repetition,
run as it is run by hand; its JSON lines read back (no time is compared)."""

from tests.bench.smoke import json_lines, positive, run_bench


def test_padded_and_packed_paths_report_their_tokens_and_seconds():
    args = ("--models", "tiny", "--rows", "4", "--prompt", "8", "--response", "16", "--reps", "1")
    rows = {r["path"]: r for r in json_lines(run_bench("packing", *args).stdout)}
    assert set(rows) == {"padded", "packed"}
    padded, packed = rows["padded"], rows["packed"]
    for row in rows.values():
        assert (row["model"], row["rows"]) == ("tiny", 4) and positive(row["cap"])
        assert positive(row["train_pass_s"]) and positive(row["logprob_pass_s"])
        assert row["padding_fraction"] == padded["padding_fraction"]
    assert 0 < packed["tokens"] <= padded["tokens"]  # packed: the real tokens only
    real = (1 - padded["padding_fraction"]) * padded["tokens"]  # the fraction has 3 decimals
    assert abs(packed["tokens"] - real) <= 0.001 * padded["tokens"] + 1
