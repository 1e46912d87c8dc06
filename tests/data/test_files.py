"""load_examples: JSONL and Parquet, custom field names, errors that name file and line."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keel.data import DataError, load_examples


def write_jsonl(path, lines):
    """`lines`: dicts are JSON-encoded, strings written as they are."""
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    path.write_text(text)
    return path


def data_error(path, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        load_examples(path, **kwargs)
    return str(info.value)


def test_jsonl_with_custom_field_names(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "1+1=", "a": 2, "r": "2"}, {"q": "2+2="}])
    examples = load_examples(path, prompt_key="q", answer_key="a", response_key="r")
    assert [ex.prompt for ex in examples] == ["1+1=", "2+2="]
    assert examples[0].answer == "2"  # non-text answers become JSON text
    assert examples[0].response == "2"
    assert (examples[1].answer, examples[1].response) == (None, None)
    assert examples[1].source == f"{path}:2"


def test_parquet_with_custom_field_names(tmp_path):
    path = tmp_path / "d.parquet"
    table = pa.table({"question": ["3+4=", "5*6="], "solution": ["7", "30"], "extra": [1, 2]})
    pq.write_table(table, path)
    examples = load_examples(path, prompt_key="question", answer_key="solution")
    assert [(ex.prompt, ex.answer) for ex in examples] == [("3+4=", "7"), ("5*6=", "30")]
    assert str(path) in examples[1].source


def test_malformed_json_names_exact_line_counting_blank_lines(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, "", {"prompt": "b"}, '{"prompt": '])
    assert f"{path}:4:" in data_error(path)


def test_non_object_json_line_is_rejected(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, "[1, 2]"])
    assert f"{path}:2:" in data_error(path)


def test_missing_required_field_names_field_and_line(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "a", "sol": "1"}, {"q": "b"}])
    msg = data_error(path, prompt_key="q", answer_key="sol", require=("prompt", "answer"))
    assert f"{path}:2:" in msg
    assert "'sol'" in msg


def test_chat_prompt_is_accepted(tmp_path):
    chat = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1="}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": chat, "answer": "2"}])
    assert load_examples(path)[0].prompt == chat


@pytest.mark.parametrize("prompt", [5, {"role": "user"}, [{"role": "user"}], ["hi"]])
def test_bad_prompt_type_is_rejected(tmp_path, prompt):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": prompt}])
    msg = data_error(path)
    assert f"{path}:1:" in msg
    assert "'prompt'" in msg


def test_unsupported_suffix_is_rejected(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt\na\n")
    assert "unsupported" in data_error(path)


def test_missing_file_is_rejected(tmp_path):
    assert "not found" in data_error(tmp_path / "nope.jsonl")


def test_empty_dataset_is_rejected(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ["", "  "])
    assert "no rows" in data_error(path)


def test_bad_rows_are_skipped_and_reported_when_asked(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": \n[1]\n{"answer": "x"}\n{"prompt": "b"}\n')
    bad: list[str] = []
    examples = load_examples(path, on_bad_row="skip", bad_rows=bad)
    assert [e.prompt for e in examples] == ["a", "b"]
    assert [line.split(":")[1] for line in bad] == ["2", "3", "4"]
    with pytest.raises(DataError, match=rf"{path}:2"):
        load_examples(path)


# ----------------------------------------------------- a new user's rows (issue 10)
def test_sft_on_prompt_answer_rows_says_which_key_reads_them(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}])
    msg = data_error(path, require=("prompt", "response"))
    assert msg == (
        f"{path}:1: missing field 'response' (fields present: answer, prompt); "
        "set data.response_key: answer to use the 'answer' field"
    )
    examples = load_examples(path, response_key="answer", require=("prompt", "response"))
    assert (examples[0].response, examples[0].answer) == ("2", "2")


def test_missing_field_without_a_likely_field_names_the_setting(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1=", "zz": "2"}])
    msg = data_error(path, require=("prompt", "response"))
    assert "missing field 'prompt' (fields present: question, zz)" in msg
    assert "set data.prompt_key: question" in msg
    path = write_jsonl(tmp_path / "e.jsonl", [{"prompt": "1+1=", "zz": "2"}])
    assert data_error(path, require=("prompt", "response")).endswith(
        "name the field that holds the response with data.response_key"
    )


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4"},
]


def test_messages_rows_split_into_prompt_and_response(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": CHAT}, {"messages": CHAT[:2]}])
    sft_error = data_error(path, require=("prompt", "response"))
    assert f"{path}:2: the last message of 'messages' must have role 'assistant'" in sft_error
    first, second = load_examples(path)  # RL: a conversation without a reply is a prompt
    assert (first.prompt, first.response) == (CHAT[:2], "4")
    assert (second.prompt, second.response) == (CHAT[:2], None)
    path = write_jsonl(tmp_path / "c.jsonl", [{"conv": CHAT, "answer": 4}])
    (ex,) = load_examples(path, messages_key="conv", require=("prompt", "response"))
    assert (ex.prompt, ex.response, ex.answer) == (CHAT[:2], "4", "4")


@pytest.mark.parametrize("bad", [[], "hi", [{"role": "user"}], [CHAT[2]]])
def test_malformed_messages_are_errors_naming_the_line(tmp_path, bad):
    path = write_jsonl(tmp_path / "d.jsonl", [{"messages": bad}])
    assert f"{path}:1: field 'messages'" in data_error(path, require=("prompt", "response"))


def test_missing_relative_dataset_says_where_relative_paths_are_looked_up(tmp_path):
    msg = data_error("nowhere/train.jsonl")
    assert msg == (
        "dataset not found: nowhere/train.jsonl (a relative path is looked up in the config "
        "file's folder, then the working directory)"
    )


def test_bytes_that_are_not_utf8_name_the_file_line_and_column(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n\n{"prompt": "caf\xe9"}\n')  # latin-1, not UTF-8
    msg = data_error(path)
    assert f"{path}:3: not valid UTF-8 (byte 0xe9 at column 16)" in msg


def test_lines_that_are_not_utf8_are_skipped_and_counted_when_asked(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n{"prompt": "b"}\n')
    bad: list[str] = []
    examples = load_examples(path, on_bad_row="skip", bad_rows=bad)
    assert [e.prompt for e in examples] == ["a", "b"]
    assert len(bad) == 1 and f"{path}:2: not valid UTF-8" in bad[0]


def test_a_utf8_byte_order_mark_and_non_ascii_text_are_accepted(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes('\ufeff{"prompt": "café ∑"}\n'.encode())
    assert load_examples(path)[0].prompt == "café ∑"


def test_parquet_text_that_is_not_utf8_names_the_row_and_column(tmp_path):
    offsets = pa.array([0, 2, 4], type=pa.int32()).buffers()[1]
    prompts = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"ok\xff\xfe")])
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": prompts}), path)
    assert f"{path}: row 1: column 'prompt' is not valid UTF-8" in data_error(path)
