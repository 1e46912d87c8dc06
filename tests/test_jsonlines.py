"""JSON-lines files with a torn last line: readers leave it out; before appending, it and any
other bad line are set aside."""

import pytest

from keel.jsonlines import parse_rows, read_rows, set_aside_bad_lines


def test_a_torn_last_line_is_left_out_and_a_bad_middle_line_named():
    assert parse_rows('{"step": 1}\n{"step": 2, "a": 0.') == [{"step": 1}]
    assert parse_rows('{"step": 1}\n\x00\x00\x00\n\n') == [{"step": 1}]
    assert parse_rows('{"step": 1}\n{"step": 2}') == [{"step": 1}, {"step": 2}]
    with pytest.raises(ValueError, match=r"m\.jsonl:2: not a JSON object line"):
        parse_rows('{"step": 1}\n{"ste\n{"step": 3}\n', "m.jsonl")


@pytest.mark.parametrize(
    ("content", "kept", "aside", "said"),
    [
        (b'{"step": 1}\n', b'{"step": 1}\n', None, []),
        (b'{"step": 1}', b'{"step": 1}\n', None, []),  # whole: only the newline was missing
        (b'{"step": 1}\n{"step": 2, "message": "cut sh', b'{"step": 1}\n',
         b'{"step": 2, "message": "cut sh\n', ["a torn last line"]),
        (b'{"step": 1}\nxx\n{"step": 2}\n', b'{"step": 1}\n{"step": 2}\n', b"xx\n",
         ["line 2 (not a JSON object with a step)"]),
        (b'\xff\n{"step": 1}\n{"a": 1}\n', b'{"step": 1}\n', b'\xff\n{"a": 1}\n',
         ["line 1 (not", "line 3 (not"]),
    ],
)  # fmt: skip
def test_bad_lines_are_set_aside_byte_for_byte_so_appends_stay_whole(
    tmp_path, content, kept, aside, said
):
    path, beside = tmp_path / "events.jsonl", tmp_path / "events.jsonl.bad"
    path.write_bytes(content)
    moved = set_aside_bad_lines(path, beside)
    assert path.read_bytes() == kept
    assert (beside.read_bytes() if beside.exists() else None) == aside
    assert len(moved) == len(said) and all(s in m for s, m in zip(said, moved, strict=True))
    assert all(f"to {beside}" in m for m in moved)
    assert set_aside_bad_lines(path, beside) == []  # clean now
    with path.open("a") as fh:
        fh.write('{"step": 3}\n')
    assert read_rows(path)[-1] == {"step": 3}
    assert set_aside_bad_lines(tmp_path / "absent.jsonl", beside) == []


def test_bytes_that_are_not_utf8_name_the_line_unless_in_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2, "x": "\xff"}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not valid utf-8"):
        read_rows(path)
    path.write_bytes('{"step": 1}\n{"step": 2, "x": "é'.encode()[:-1])  # cut inside "é"
    assert read_rows(path) == [{"step": 1}]
