"""The built-in preference task and loading preference files (errors name file:line)."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keel.data import DataError
from keel.data.preference import encode_pairs, load_preference_pairs, preference_splits
from keel.models import build_char_tokenizer
from keel.rewards.verifiers import even_answer


def test_builtin_task_is_deterministic_and_follows_its_property():
    train, held = preference_splits(max_operand=20, eval_size=50, seed=3)
    again = preference_splits(max_operand=20, eval_size=50, seed=3)
    assert (train, held) == again
    assert preference_splits(max_operand=20, eval_size=50, seed=4) != (train, held)
    assert len(train) + len(held) == 21 * 21 and len(held) == 50
    for pair in [*train, *held]:
        assert even_answer(pair.prompt, pair.chosen, None) == 1.0
        assert even_answer(pair.prompt, pair.rejected, None) == 0.0
        assert abs(int(pair.chosen) - int(pair.rejected)) == 1
        assert pair.answer in (pair.chosen, pair.rejected)  # one of the two is correct
    # the correct answer is chosen for even sums and rejected for odd ones: both occur
    assert {p.answer == p.chosen for p in train} == {True, False}


def test_builtin_splits_are_disjoint():
    train, held = preference_splits(max_operand=30, eval_size=100, seed=0)
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert len({p.prompt for p in train}) == len(train)


def test_encode_pairs_interleaves_chosen_and_rejected():
    tok = build_char_tokenizer()
    train, _ = preference_splits(max_operand=20, eval_size=10)
    batch = encode_pairs(tok, train[:3], chat=False, max_prompt_length=16)
    assert len(batch) == 6
    for i, pair in enumerate(train[:3]):
        for row, text in ((2 * i, pair.chosen), (2 * i + 1, pair.rejected)):
            n = int(batch.response_mask[row].sum())
            ids = batch.input_ids[row, batch.prompt_length : batch.prompt_length + n].tolist()
            assert ids == [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_text_and_chat_formats(tmp_path):
    convo = [{"role": "user", "content": "hi"}]
    path = write_jsonl(
        tmp_path / "p.jsonl",
        [
            {"prompt": "2+2=", "chosen": "4", "rejected": "5", "answer": 4},
            {"prompt": convo, "chosen": [{"role": "assistant", "content": "hello"}],
             "rejected": [{"role": "assistant", "content": "go away"}]},
            {"chosen": [*convo, {"role": "assistant", "content": "hey"}],
             "rejected": [*convo, {"role": "assistant", "content": "no"}]},
        ],
    )  # fmt: skip
    pairs = load_preference_pairs(path)
    assert [(p.chosen, p.rejected) for p in pairs] == [("4", "5"), ("hello", "go away"),
                                                       ("hey", "no")]  # fmt: skip
    assert pairs[0].prompt == "2+2=" and pairs[0].answer == "4"
    assert pairs[1].prompt == convo and pairs[2].prompt == convo
    assert pairs[2].source == f"{path}:3"


def test_parquet_and_custom_keys(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"q": ["1+1=", "3+3="], "good": ["2", "6"], "bad": ["3", "7"]}), path)
    pairs = load_preference_pairs(path, prompt_key="q", chosen_key="good", rejected_key="bad")
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [
        ("1+1=", "2", "3"),
        ("3+3=", "6", "7"),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "a", "chosen": "b"}', "missing field 'rejected'"),
        ("{not json", "not valid JSON"),
        ('{"prompt": "a", "chosen": 3, "rejected": "b"}', "field 'chosen' must be text"),
        ('{"chosen": "x", "rejected": "y"}', "missing field 'prompt'"),
        (
            '{"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],'
            ' "rejected": [{"role": "user", "content": "Q"}, {"role": "assistant", '
            '"content": "b"}]}',
            "share every message but the last",
        ),
        (
            '{"chosen": [{"role": "user", "content": "q"}, {"role": "user", "content": "a"}],'
            ' "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", '
            '"content": "b"}]}',
            "last message of chosen must have role 'assistant'",
        ),
    ],
)
def test_errors_name_file_and_line(tmp_path, line, message):
    good = '{"prompt": "a", "chosen": "b", "rejected": "c"}'
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, line])
    with pytest.raises(DataError) as err:
        load_preference_pairs(path)
    assert f"{path}:3" in str(err.value)
    assert message in str(err.value)


def test_missing_and_unsupported_files(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_preference_pairs(tmp_path / "nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported dataset format"):
        load_preference_pairs(tmp_path / "x.csv")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no rows"):
        load_preference_pairs(tmp_path / "empty.jsonl")
