"""Folders saved by Hugging Face `datasets` (save_to_disk), read with pyarrow alone. The
fixtures in saved_datasets/ were written by datasets 5.2.0 (saved_datasets/make_fixtures.py)."""

import json
import re
import shutil
from pathlib import Path

import pytest

from keel.config import validate
from keel.controller.assembly import load_datasets
from keel.data import DataError, load_examples
from keel.data.saved import choose_split
from keel.recipes import build_spec

SAVED = Path(__file__).parent / "saved_datasets"
CHAT = [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]


def test_a_saved_dataset_dict_gives_train_and_held_out_splits():
    saved = str(SAVED / "dict")
    cfg = validate({"models": {"actor": "x"}, "algorithm": {"name": "grpo"},
                    "data": {"train": saved, "eval": saved}})  # fmt: skip
    data = load_datasets(cfg, build_spec(cfg))
    assert [(e.prompt, e.answer) for e in data.train] == [("1+1=", "2"), ("2+3=", "5"),
                                                          ("4+4=", "8")]  # fmt: skip
    assert [(e.prompt, e.answer) for e in data.eval] == [("9+0=", "9")]
    assert data.train[1].source == f"{SAVED / 'dict' / 'train'}: row 1"


def test_a_split_is_named_by_its_folder_and_shards_are_read_in_order():
    assert [e.prompt for e in load_examples(SAVED / "dict" / "test")] == ["9+0="]
    assert choose_split(SAVED / "dict" / "test", "train") == SAVED / "dict" / "test"
    examples = load_examples(SAVED / "sharded")
    assert [e.prompt for e in examples] == [str(i) for i in range(10)]
    assert examples[9].source.endswith("sharded: row 9")


def test_chat_messages_rows_train_sft():
    examples = load_examples(SAVED / "chat", require=("prompt", "response"))
    assert [(e.prompt, e.response) for e in examples] == [(CHAT[:1], "2")] * 2


def test_missing_split_and_a_dict_folder_as_a_split_are_errors(tmp_path):
    only_train = shutil.copytree(SAVED / "dict", tmp_path / "dd")
    (only_train / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "other"]}))
    with pytest.raises(DataError, match=r"no 'validation' or 'test' or 'eval' split \(splits: "
                       r"train, other\); name a split's folder"):  # fmt: skip
        choose_split(only_train, "eval")
    with pytest.raises(DataError, match="a saved DatasetDict; name one of its splits' folders"):
        load_examples(only_train)


def test_other_folders_and_damaged_shards_are_errors_naming_the_file(tmp_path):
    with pytest.raises(DataError, match="not a dataset saved by Hugging Face datasets"):
        load_examples(tmp_path)
    broken = shutil.copytree(SAVED / "sharded", tmp_path / "broken")
    shard = broken / "data-00001-of-00003.arrow"
    shard.write_bytes(shard.read_bytes()[:40])
    with pytest.raises(DataError, match=re.escape(f"{shard}: not a readable Arrow stream file")):
        load_examples(broken)
    (broken / "state.json").write_text("{}")
    with pytest.raises(DataError, match=r"state\.json: not a saved Dataset's state"):
        load_examples(broken)
