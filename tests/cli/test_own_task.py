"""A new user's own task from YAML alone (issue 10): relative paths next to the config, chat
`messages` rows for SFT, and the errors such a user meets first."""

import json

import pytest
import yaml

from keel.config import validate
from keel.monitor import read_metrics

CHAT = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]


def own_task(tmp_path, tiny_dir, rows, **data):
    """conf/ with the config, a link to the tiny model and the data, all named relatively."""
    conf = tmp_path / "conf"
    (conf / "data").mkdir(parents=True)
    (conf / "model").symlink_to(tiny_dir)
    text = "".join(json.dumps(r) + "\n" for r in rows)
    for name in ("train", "eval"):
        (conf / "data" / f"{name}.jsonl").write_text(text)
    raw = {
        "run_dir": str(tmp_path / "run"),
        "models": {"actor": "model"},
        "algorithm": {"name": "sft"},
        "data": {"train": "data/train.jsonl", "eval": "data/eval.jsonl", **data},
        "reward": {"fn": "builtin:exact_match"},
        "train": {"steps": 2, "batch_size": 2, "lr": 1e-3},
        "eval": {"every": 2},  # before the first step and after the last
        "monitor": {"progress": False},
    }
    path = conf / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.e2e
def test_sft_on_messages_with_paths_relative_to_the_config(keel, tiny_dir, tmp_path):
    path = own_task(tmp_path, tiny_dir, [{"messages": CHAT, "answer": "2"}] * 4)
    proc = keel("train", str(path))  # the working directory is the repository, not conf/
    assert proc.returncode == 0, proc.stderr
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "eval/accuracy" in rows[0] and "actor/sft_loss" in rows[1]
    saved = validate(yaml.safe_load((tmp_path / "run" / "config.yaml").read_text()))
    conf = path.parent
    assert saved.models.actor == str(conf / "model")
    assert saved.data.train == str(conf / "data/train.jsonl")


@pytest.mark.e2e
def test_sft_on_prompt_answer_rows_names_the_key_that_fixes_it(keel, tiny_dir, tmp_path):
    path = own_task(tmp_path, tiny_dir, [{"prompt": "1+1=", "answer": "2"}])
    proc = keel("train", str(path))
    assert proc.returncode == 2
    train = path.parent / "data/train.jsonl"
    assert proc.stderr.strip() == (
        f"keel: error: {train}:1: missing field 'response' (fields present: answer, prompt); "
        "set data.response_key: answer to use the 'answer' field"
    )
    assert not (tmp_path / "run").exists()
