"""The checkpoint-writer seam (keel.checkpoint.writer): one conformance test that the full-state
writer and the DCP writer (written at once or in the background) both pass; a failed write;
and a sharded, asynchronous `keel train` run that resumes exactly."""

import json
import resource
import signal
from pathlib import Path

import pytest
import torch

from keel.checkpoint import CheckpointError, validate_checkpoint
from keel.checkpoint.state import CheckpointSaveError, read_latest
from keel.checkpoint.writer import CheckpointStates, FullStateWriter, ShardedWriter
from keel.config import validate
from keel.config.loading import ConfigError
from keel.workers.group import LocalWorkerGroup
from tests.checkpoint.test_state import built_actor
from tests.controller.test_resume import ROOT, check_exact_resume
from tests.workers.test_actor import rl_spec, synthetic_batch

WRITERS = {
    "full": lambda root: FullStateWriter(root),
    "sharded": lambda root: ShardedWriter(root, background=False),
    "sharded-async": lambda root: ShardedWriter(root, background=True),
}


class Counter:
    """A component with a state, as the controller and the guard are."""

    def __init__(self, value: int):
        self.value = value

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def training_state(worker) -> dict:
    """The worker's model and optimizer tensors (copies) and its LR schedule."""
    optim = worker.step.optimizer.state_dict()
    return {
        "model": {k: v.detach().clone() for k, v in worker.model.state_dict().items()},
        "optim": {(i, k): v.clone() for i, s in optim["state"].items() for k, v in s.items()},
        "groups": optim["param_groups"],
        "scheduler": worker.step.scheduler.state_dict(),
    }


@pytest.fixture(scope="module")
def trained(tiny_dir):
    """An actor after two AdamW updates, the batch and spec to train it further."""
    actor = built_actor(tiny_dir)
    batch, spec = synthetic_batch(actor.model.config.vocab_size), rl_spec("token-mean")
    for _ in range(2):
        actor.update(batch, spec)
    return actor, batch, spec


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_every_writer_publishes_a_checkpoint_that_loads_back(kind, trained, tiny_dir, tmp_path):
    """save → (training goes on) → wait: the published checkpoint is complete, checksummed and
    named by `latest`, and holds the state of the moment `save` returned, though the worker
    trained on before the (background) write ended; it loads into a fresh worker exactly."""
    actor, batch, spec = trained
    root = tmp_path / "checkpoints"
    writer = WRITERS[kind](root)
    states = CheckpointStates({"actor": LocalWorkerGroup("actor", [actor])}, {"c": Counter(7)}, "")
    saved = training_state(actor)
    handle = writer.save(2, states, healthy=True, metrics={"reward/mean": 0.5})
    actor.update(batch, spec)  # the training goes on while a background write is in flight
    assert writer.wait() in (None, handle) and writer.wait() is None and writer.done()
    assert handle.info is not None and handle.published
    info = validate_checkpoint(handle.info.path)  # sizes and SHA-256 of every file
    assert (info.step, info.healthy, info.metrics) == (2, True, {"reward/mean": 0.5})
    assert read_latest(root) == "step_000002"
    meta = json.loads((info.path / "meta.json").read_text())
    on_disk = sorted(str(p.relative_to(info.path)) for p in info.path.rglob("*") if p.is_file())
    assert sorted(meta["sha256"]) == sorted(set(on_disk) - {"meta.json", "COMPLETE"})
    assert any(name.startswith("actor/dcp/") for name in on_disk) == kind.startswith("sharded")
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]

    fresh, counter = built_actor(tiny_dir), Counter(0)
    writer.load(info.path, CheckpointStates({"actor": LocalWorkerGroup("actor", [fresh])},
                                            {"c": counter}, ""))  # fmt: skip
    loaded = training_state(fresh)
    assert counter.value == 7
    assert loaded["model"].keys() == saved["model"].keys()
    assert all(torch.equal(loaded["model"][k], v) for k, v in saved["model"].items())
    assert loaded["optim"].keys() == saved["optim"].keys() and saved["optim"]
    assert all(torch.equal(loaded["optim"][k], v) for k, v in saved["optim"].items())
    assert (loaded["groups"], loaded["scheduler"]) == (saved["groups"], saved["scheduler"])
    after = [training_state(actor)["model"], loaded["model"]]
    assert any(not torch.equal(after[0][k], after[1][k]) for k in after[0])  # it trained on


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_a_failed_write_keeps_the_previous_checkpoint(kind, trained, tmp_path):
    """A real write failure (the OS refuses files past RLIMIT_FSIZE, as on a full disk, here in
    the background writer's thread too): CheckpointSaveError from save or wait, no folder of
    the failed step and no temporary folder left, `latest` still names the good one."""
    actor, _, _ = trained
    root = tmp_path / "checkpoints"
    writer = WRITERS[kind](root)
    states = CheckpointStates({"actor": LocalWorkerGroup("actor", [actor])}, {}, "")
    writer.save(1, states, healthy=True, metrics={})
    writer.wait()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))  # the weights are larger
    try:
        with pytest.raises(CheckpointSaveError, match="saving step 2"):
            writer.save(2, states, healthy=True, metrics={})
            writer.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert read_latest(root) == "step_000001"
    validate_checkpoint(root / "step_000001")
    writer.save(3, states, healthy=True, metrics={})  # with space again, saving works
    writer.wait()
    assert read_latest(root) == "step_000003"


def test_a_damaged_shard_is_caught_before_anything_loads(trained, tiny_dir, tmp_path):
    actor, _, _ = trained
    writer = ShardedWriter(tmp_path, background=True)
    states = CheckpointStates({"actor": LocalWorkerGroup("actor", [actor])}, {}, "")
    handle = writer.save(4, states, healthy=True, metrics={})
    writer.wait()
    assert handle.info is not None
    shard = next((handle.info.path / "actor" / "dcp").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    fresh = built_actor(tiny_dir)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    fresh_states = CheckpointStates({"actor": LocalWorkerGroup("actor", [fresh])}, {}, "")
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp does not match its recorded SHA"):
        writer.load(handle.info.path, fresh_states)
    assert all(torch.equal(fresh.model.state_dict()[k], v) for k, v in before.items())


def test_async_save_needs_the_sharded_format():
    base = {"models": {"actor": "x"}, "algorithm": {"name": "grpo"}}
    with pytest.raises(ConfigError, match=r"checkpoint\.async_save needs checkpoint\.format"):
        validate({**base, "checkpoint": {"async_save": True}})
    cfg = validate({**base, "checkpoint": {"format": "sharded"}})
    assert (cfg.checkpoint.format, cfg.checkpoint.async_save) == ("sharded", False)


def test_a_sharded_asynchronous_run_resumes_exactly(tmp_path: Path, tiny_dir: Path):
    """`keel train`'s run_training with checkpoint.format sharded and async_save: 4 steps
    straight ≡ 1 step, a stop (its checkpoint written in the background and published before
    the exit), a resume; the checkpoints hold DCP shards."""
    extra = ["checkpoint.format=sharded", "checkpoint.async_save=true"]
    check_exact_resume(ROOT / "examples" / "grpo_arith_tiny.yaml", tmp_path, tiny_dir, extra)
    for run in ("straight", "split"):
        ckpt = tmp_path / run / "checkpoints" / "step_000004"
        assert (ckpt / "actor" / "dcp" / ".metadata").is_file()
        assert json.loads((ckpt / "meta.json").read_text())["format"] == "sharded"
