"""meta.json of a checkpoint: what is wrong with one is said as it is, never as "unreadable"."""

import json
import warnings

import pytest

from keel.checkpoint import CheckpointError, list_checkpoints, validate_checkpoint
from keel.checkpoint.state import MARKER, scan_checkpoints

META = {"step": 2, "healthy": True, "time": 100.0, "metrics": {}, "files": {}, "sha256": {}}


def checkpoint(root, name, meta):
    path = root / name
    path.mkdir(parents=True)
    (path / "meta.json").write_text(meta if isinstance(meta, str) else json.dumps(meta))
    (path / MARKER).write_text("")
    return path


@pytest.mark.parametrize(
    ("meta", "said"),
    [
        (
            {"step": 999999},
            "records step 999999 but the folder is step_000002; meta.json "
            "lacks healthy, time, metrics",
        ),
        ({**META, "step": 999999}, "records step 999999 but the folder is step_000002"),
        ('{"step": 2, ', "is not valid JSON"),
        ("[2]", "is not a JSON object"),
        ({**META, "step": "2"}, "step is '2', not an integer"),
        ({**META, "time": None}, "time is None, not a number"),
        ({**META, "healthy": "yes"}, "healthy is 'yes', not true or false"),
        ({**META, "metrics": []}, "metrics is [], not an object"),
    ],
)
def test_what_is_wrong_with_a_meta_json_is_named(tmp_path, meta, said):
    path = checkpoint(tmp_path, "step_000002", meta)
    with pytest.raises(CheckpointError) as caught:
        validate_checkpoint(path)
    message = str(caught.value)
    assert message.startswith(f"checkpoint {path}: meta.json ") and said in message, message
    assert "unreadable" not in message
    found, skipped = scan_checkpoints(tmp_path)
    assert found == [] and len(skipped) == 1 and said in skipped[0]
    with pytest.warns(UserWarning, match="meta.json"):
        assert list_checkpoints(tmp_path) == []


def test_a_good_meta_json_and_a_folder_not_named_by_step(tmp_path):
    good = checkpoint(tmp_path, "step_000002", META)
    assert validate_checkpoint(good).step == 2
    elsewhere = checkpoint(tmp_path / "downloaded", "my-checkpoint", {**META, "step": 7})
    assert validate_checkpoint(elsewhere).step == 7  # only a step_N folder name is compared
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [c.step for c in list_checkpoints(tmp_path)] == [2]
    no_files = checkpoint(tmp_path, "step_000003", {k: v for k, v in META.items() if k != "files"}
                          | {"step": 3})  # fmt: skip
    with pytest.raises(CheckpointError, match=r"meta\.json lacks files"):
        validate_checkpoint(no_files)
