"""Checkpoint folders: atomic publication, `latest`, validation, retention, full disk, leftovers;
a role's training state (weights, optimizer, LR schedule) saved and restored."""

import json
import resource
import signal
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM

from keel.checkpoint import (
    CheckpointError,
    clean_leftovers,
    list_checkpoints,
    load_checkpoint,
    prune_step_folders,
    resume_candidates,
    save_checkpoint,
    validate_checkpoint,
)
from keel.checkpoint.state import read_latest
from keel.config import validate
from keel.controller import run_training
from keel.controller.resume import RunDirError
from keel.guard import read_events
from keel.plan.inputs import worker_inputs
from keel.recipes import build_spec
from keel.workers.build import build_workers
from keel.workers.group import LocalWorkerGroup
from tests.workers.test_actor import rl_spec, synthetic_batch


@pytest.fixture
def run(tiny_grpo):
    """A 4-step tiny GRPO run with a checkpoint after every step (keep 4)."""
    cfg = tiny_grpo("train.steps=4", "checkpoint.save_steps=1", "checkpoint.keep=4")
    run_training(cfg)
    return cfg


def test_layout_latest_and_hf_actor_folder(run):
    root = Path(run.run_dir) / "checkpoints"
    found = list_checkpoints(root)
    assert [c.step for c in found] == [1, 2, 3, 4]
    assert read_latest(root) == "step_000004"
    ckpt = found[-1].path
    for name in ("controller.pt", "guard.pt", "rng.pt", "config.yaml", "meta.json", "COMPLETE"):
        assert (ckpt / name).is_file(), name
    assert (ckpt / "actor" / "trainer_state.pt").is_file()
    model = AutoModelForCausalLM.from_pretrained(ckpt / "actor")  # servable as it is
    assert model.config.vocab_size > 0
    assert found[-1].healthy and "reward/mean" in found[-1].metrics


def test_incomplete_is_ignored_and_corrupt_falls_back(run, tiny_grpo):
    root = Path(run.run_dir) / "checkpoints"
    (root / "step_000004" / "COMPLETE").unlink()  # a save that never finished
    weights = root / "step_000003" / "actor" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # damaged on disk
    with pytest.warns(UserWarning, match="incomplete checkpoint"):
        assert [c.step for c in resume_candidates(root)] == [3, 2, 1]
    with pytest.raises(CheckpointError, match=r"model\.safetensors is missing or truncated"):
        validate_checkpoint(root / "step_000003")
    cfg = tiny_grpo("train.steps=5", "checkpoint.save_steps=1", "checkpoint.keep=4")
    with pytest.raises(RunDirError, match="step_000003 is damaged"):  # named: no fallback
        run_training(cfg, resume=str(root / "step_000003"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_training(cfg)
    assert result.resumed_from == 2  # step 4 incomplete, step 3 damaged → step 2
    events = read_events(Path(run.run_dir) / "events.jsonl")
    assert any("damaged" in e["message"] for e in events if e["event"] == "restart")


def test_retention_keeps_the_newest_healthy(tmp_path):
    for step in (1, 2, 3, 4):
        (tmp_path / f"step_{step:06d}").mkdir()
    deleted = prune_step_folders(tmp_path, keep=1, protect=[tmp_path / "step_000002"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000004"]
    assert len(deleted) == 2


def test_clean_leftovers_restores_a_replaced_folder(tmp_path):
    (tmp_path / ".tmp-step_000003-99").mkdir()
    (tmp_path / ".old-step_000002-99").mkdir()  # killed between the two renames
    actions = clean_leftovers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002"]
    assert len(actions) == 2


def test_full_disk_keeps_the_previous_checkpoint(run, tiny_grpo):
    """A real write failure (the OS refuses a file past RLIMIT_FSIZE, as on a full disk): the
    saves of steps 5 and 6 fail, the run goes on, `latest` still names the valid step 4."""
    root = Path(run.run_dir) / "checkpoints"
    cfg = tiny_grpo("train.steps=6", "checkpoint.save_steps=1", "checkpoint.keep=4")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, hard))  # model.safetensors is larger
    try:
        with pytest.raises(SafetensorError):  # the final export cannot be written either
            run_training(cfg)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    names = sorted(p.name for p in root.iterdir())
    assert names == ["latest", "step_000001", "step_000002", "step_000003", "step_000004"]
    assert read_latest(root) == "step_000004"
    validate_checkpoint(root / "step_000004")
    failed = [e for e in read_events(Path(run.run_dir) / "events.jsonl") if e.get("ok") is False]
    assert [e["step"] for e in failed] == [5, 6]
    assert run_training(cfg).resumed_from == 4  # with space again, the run resumes and ends


def test_same_size_corruption_fails_its_checksum_and_falls_back(run, tiny_grpo):
    """A bit flip that keeps the file's size is caught by the SHA-256 in meta.json; resume falls
    back to the checkpoint before. A checkpoint written before checksums (sizes only) loads."""
    root = Path(run.run_dir) / "checkpoints"
    weights = root / "step_000004" / "actor" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF  # inside the last tensor: safetensors still loads it
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.safetensors does not match its recorded"):
        validate_checkpoint(root / "step_000004")
    meta_file = root / "step_000003" / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["sha256"]  # as written before checksums existed
    meta_file.write_text(json.dumps(meta))
    assert validate_checkpoint(root / "step_000003").step == 3
    cfg = tiny_grpo("train.steps=5", "checkpoint.save_steps=1", "checkpoint.keep=4")
    with pytest.warns(UserWarning, match="does not match its recorded SHA-256"):
        assert run_training(cfg).resumed_from == 3
    events = read_events(Path(run.run_dir) / "events.jsonl")
    assert any("SHA-256" in e["message"] for e in events if e["event"] == "restart")


def built_actor(tiny_dir):
    cfg = validate({
        "models": {"actor": str(tiny_dir)}, "algorithm": {"name": "grpo", "kl_loss_coef": 0.0},
        "rollout": {"n": 2}, "train": {"batch_size": 4, "lr": 1e-3, "warmup_steps": 2},
    })  # fmt: skip
    return build_workers(worker_inputs(cfg, build_spec(cfg)), ["actor"], None)["actor"]


def test_a_checkpoint_restores_the_optimizer_state(tiny_dir, tmp_path):
    """save_checkpoint after two AdamW updates, load_checkpoint into a freshly built actor: its
    weights, AdamW's moments (exp_avg, exp_avg_sq) and step counts, param groups and LR schedule
    are the saved ones, and the next update continues as the saved actor's does."""
    trained = built_actor(tiny_dir)
    batch = synthetic_batch(trained.model.config.vocab_size)
    spec = rl_spec("token-mean")
    for _ in range(2):
        trained.update(batch, spec)
    group = LocalWorkerGroup("actor", [trained])
    info = save_checkpoint(tmp_path / "checkpoints", 2, roles={"actor": group}, components={},
                           config_text="seed: 0\n", healthy=True)  # fmt: skip
    fresh = built_actor(tiny_dir)
    assert not fresh.step.optimizer.state  # nothing there before the load
    load_checkpoint(info.path, roles={"actor": LocalWorkerGroup("actor", [fresh])}, components={})
    saved = trained.step.optimizer.state_dict()
    restored = fresh.step.optimizer.state_dict()
    assert saved["state"] and restored["state"].keys() == saved["state"].keys()
    for index, state in saved["state"].items():
        assert restored["state"][index].keys() == state.keys() >= {"step", "exp_avg", "exp_avg_sq"}
        for name, value in state.items():
            assert torch.equal(restored["state"][index][name], value), (index, name)
    assert restored["param_groups"] == saved["param_groups"]
    assert fresh.step.scheduler.state_dict() == trained.step.scheduler.state_dict()
    for a, b in zip(fresh.model.parameters(), trained.model.parameters(), strict=True):
        assert torch.equal(a, b)
    after = [trained.update(batch, spec), fresh.update(batch, spec)]
    assert after[1]["actor/lr"] == after[0]["actor/lr"]
    for a, b in zip(fresh.model.parameters(), trained.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
