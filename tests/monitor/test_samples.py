"""The samples log: a few (prompt, response, reward) rows every N steps."""

import torch

from keel.monitor.samples import SamplesLog, read_samples, sample_rows
from keel.types import Batch
from tests.cli.format_reward import digit_fraction


def test_one_row_per_group():
    batch = Batch(
        prompts=["a", "a", "b", "b", "c", "c"], responses=["1", "2", "3", "4", "5", "6"],
        scores=torch.tensor([0.0, 1, 2, 3, 4, 5]), group_ids=torch.tensor([0, 0, 1, 1, 2, 2]),
    )  # fmt: skip
    rows = sample_rows(batch, count=2)
    assert rows == [
        {"prompt": "a", "response": "1", "reward": 0.0},
        {"prompt": "b", "response": "3", "reward": 2.0},
    ]


def test_log_appends_and_skips_a_batch_without_text(tmp_path):
    log = SamplesLog(tmp_path / "samples.jsonl", every=3, count=1, console=None)
    assert [s for s in range(1, 10) if log.due(s)] == [3, 6, 9]
    assert log.log(3, Batch(scores=torch.tensor([1.0]))) == []
    log.log(6, Batch(prompts=["p"], responses=["r"], answers=[7]))
    log.close()
    assert read_samples(tmp_path / "samples.jsonl") == [
        {"step": 6, "prompt": "p", "response": "r", "answer": 7}
    ]


def test_real_run_samples(scraped_run):
    rows = read_samples(scraped_run.run_dir / "samples.jsonl")
    assert [r["step"] for r in rows] == [2, 2, 4, 4, 6, 6]
    for r in rows:
        assert r["prompt"].endswith("=") and r["answer"].lstrip("-").isdigit()
        assert r["reward"] == digit_fraction(r["prompt"], r["response"], r["answer"])
