"""bench/micro_batching.py (`make bench`): both paths on a few skewed rows, one repetition."""

from bench.micro_batching import main

from tests.bench.smoke import json_lines, positive


def test_padded_and_token_budget_paths_report_their_tokens_and_seconds(capsys):
    main(["--rows", "4", "--micro", "2", "--reps", "1", "--models", "tiny"])
    rows = {r["path"]: r for r in json_lines(capsys.readouterr().out)}
    assert set(rows) == {"padded", "token_budget"}
    padded, budget = rows["padded"], rows["token_budget"]
    assert padded["micro_batches"] == 2 and padded["max_tokens_per_micro_batch"] is None
    assert budget["max_tokens_per_micro_batch"] > 0
    for row in rows.values():
        assert row["model"] == "tiny" and row["rows"] == 4
        assert row["real_tokens"] == padded["real_tokens"] <= row["padded_tokens"]
        assert positive(row["update_s"]) and positive(row["logprobs_s"])
    assert budget["padded_tokens"] <= padded["padded_tokens"]  # trimmed padding
