"""MODEL as a run directory, a checkpoint or an HF folder (keel generate / eval / serve)."""

import shutil
from pathlib import Path
from unittest.mock import ANY

import pytest

from keel.checkpoint.export import export_record, parse_model_id
from keel.checkpoint.policy import PolicyNotFound, newest_healthy_checkpoint, resolve_policy


def test_every_kind_of_model_argument_resolves_to_a_loadable_folder(tiny_grpo, tiny_dir):
    from keel.controller import run_training
    from keel.models import load_causal_lm

    cfg = tiny_grpo("train.steps=2", "checkpoint.save_steps=1", "checkpoint.keep=2")
    run_training(cfg)
    run_dir = Path(cfg.run_dir)
    assert resolve_policy(tiny_dir).folder == tiny_dir
    assert resolve_policy(tiny_dir).run_dir is None

    finished = resolve_policy(run_dir)  # the exported model of a finished run
    assert finished.folder == run_dir / "model" and finished.run_dir == run_dir
    assert resolve_policy(run_dir / "model").run_dir == run_dir
    # its versioned model id (keel serve answers to it): the export's, not a checkpoint's
    assert finished.model_id == export_record(run_dir / "model")["model_id"]
    assert parse_model_id(finished.model_id or "")["step"] == 2
    assert resolve_policy(run_dir / "model").model_id == finished.model_id
    assert resolve_policy(tiny_dir).model_id is None  # a plain HF folder has none

    first = resolve_policy(run_dir / "checkpoints" / "step_000001")
    assert first.folder == run_dir / "checkpoints" / "step_000001" / "actor"
    assert first.step == 1 and first.run_dir == run_dir
    assert parse_model_id(first.model_id or "") == {
        "run": "run", "version": 1, "step": 1, "stamp": ANY,
    }  # fmt: skip
    load_causal_lm(first.folder)  # a real HF folder

    shutil.rmtree(run_dir / "model")  # a run still training: its newest healthy checkpoint
    newest = resolve_policy(run_dir)
    assert newest.step == 2 and newest == newest_healthy_checkpoint(run_dir)


def test_bad_model_arguments_say_what_was_looked_for(tmp_path):
    with pytest.raises(PolicyNotFound, match="no such file"):
        resolve_policy(tmp_path / "missing")
    with pytest.raises(PolicyNotFound, match="not an HF model folder"):
        resolve_policy(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(PolicyNotFound, match="neither an exported model/ nor"):
        resolve_policy(tmp_path)
    assert newest_healthy_checkpoint(tmp_path) is None
