"""JSON-lines files with a torn last line: readers leave it out, repair_tail cuts it off."""

import pytest

from keel.jsonlines import parse_rows, read_rows, repair_tail, torn_tail


def test_a_torn_last_line_is_left_out_and_a_bad_middle_line_named():
    assert parse_rows('{"step": 1}\n{"step": 2, "a": 0.') == [{"step": 1}]
    assert parse_rows('{"step": 1}\n\x00\x00\x00\n\n') == [{"step": 1}]
    assert parse_rows('{"step": 1}\n{"step": 2}') == [{"step": 1}, {"step": 2}]
    with pytest.raises(ValueError, match=r"m\.jsonl:2: not a JSON object line"):
        parse_rows('{"step": 1}\n{"ste\n{"step": 3}\n', "m.jsonl")


def test_torn_tail_says_what_to_keep():
    assert torn_tail(b'{"a": 1}\n') == (9, b"")
    assert torn_tail(b'{"a": 1}\n{"b": ') == (9, b"")
    assert torn_tail(b'{"a": 1}\n\x00\x00\n') == (9, b"")
    assert torn_tail(b'{"a": 1}\n{"b": 2}') == (17, b"\n")  # whole, only the newline missing
    assert torn_tail(b"") == (0, b"")


def test_repair_tail_cuts_the_torn_line_so_appends_stay_whole(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2, "message": "cut sh')
    assert "dropped a torn last line" in repair_tail(path)
    with path.open("a") as fh:
        fh.write('{"step": 3}\n')
    assert read_rows(path) == [{"step": 1}, {"step": 3}]
    assert repair_tail(path) is None  # already clean
    assert repair_tail(tmp_path / "absent.jsonl") is None
    path.write_bytes(b'{"step": 1}')
    assert repair_tail(path) is None and path.read_bytes() == b'{"step": 1}\n'


def test_bytes_that_are_not_utf8_name_the_line_unless_in_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2, "x": "\xff"}\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not valid utf-8"):
        read_rows(path)
    path.write_bytes('{"step": 1}\n{"step": 2, "x": "é'.encode()[:-1])  # cut inside "é"
    assert read_rows(path) == [{"step": 1}]
