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
from keel.checkpoint.policy import PolicyNotFound, resolve_policy
from keel.checkpoint.state import CheckpointSaveError, read_latest
from keel.checkpoint.writer import CheckpointStates, FullStateWriter, ShardedWriter
from keel.config import validate
from keel.config.loading import ConfigError, dump_config
from keel.controller.assembly import Roles
from keel.controller.guard_actions import GuardActions
from keel.controller.keeping import Keeping
from keel.controller.resume import config_changes
from keel.controller.runner import run_training
from keel.guard import EventLog, Guard, Trip, Verdict, read_events
from keel.workers.group import LocalWorkerGroup
from tests.checkpoint.test_state import built_actor
from tests.controller.test_guard_actions import Counting
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
    run_dir = tmp_path / "split"
    assert resolve_policy(run_dir).folder == run_dir / "model"  # the export: gathered at the end
    with pytest.raises(PolicyNotFound, match="DCP shards"):  # `keel eval` of a checkpoint
        resolve_policy(run_dir / "checkpoints" / "step_000004")


def keeping_over(actor, cfg, run_dir: Path):
    """The run loop's Keeping and GuardActions over a real actor (keel.controller)."""
    group = LocalWorkerGroup("actor", [actor])
    guard, controller = Guard(cfg.guard), Counting()
    events = EventLog(run_dir / "events.jsonl")
    components = {"controller": controller, "guard": guard}
    keeping = Keeping(cfg, run_dir, {"actor": group}, components, events)
    roles = Roles(group, None, None, None, None, push_weights=dict)
    return keeping, GuardActions(guard, run_dir, roles, controller, keeping, events), events


def test_a_rollback_waits_for_the_checkpoint_in_flight(trained, tiny_grpo, tmp_path):
    """checkpoint.async_save: the step-2 checkpoint is still in flight when the guard rolls
    back; the rollback publishes it first and restores it (the newest healthy one)."""
    actor, batch, spec = trained
    cfg = tiny_grpo("checkpoint.format=sharded", "checkpoint.async_save=true", "checkpoint.keep=4")
    keeping, actions, _ = keeping_over(actor, cfg, tmp_path)
    assert keeping.save(1, {}, healthy=True)
    actor.update(batch, spec)
    at_step_2 = training_state(actor)
    assert keeping.save(2, {}, healthy=True) and keeping.in_flight is not None
    actor.update(batch, spec)  # step 3 trains on, then the guard trips
    verdict = Verdict("rollback", [Trip("collapse", "rollback", "reward/mean fell")])
    assert actions.rollback(3, verdict)[0] == 3  # back to step 2: step 3 runs again
    assert keeping.in_flight is None and keeping.saved == 2
    restored = training_state(actor)
    assert all(torch.equal(restored["model"][k], v) for k, v in at_step_2["model"].items())
    kinds = [(e["event"], e["step"]) for e in read_events(tmp_path / "events.jsonl")]
    assert ("checkpoint", 2) in kinds and ("rollback", 3) in kinds


def test_a_failed_background_write_is_an_event_and_the_run_goes_on(trained, tiny_grpo, tmp_path):
    actor, _, _ = trained
    cfg = tiny_grpo("checkpoint.format=sharded", "checkpoint.async_save=true")
    keeping, _, _ = keeping_over(actor, cfg, tmp_path)
    assert keeping.save(1, {}, healthy=True) and keeping.wait()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, hard))
    try:
        assert keeping.save(2, {}, healthy=True)  # started: the copy fits in memory
        assert not keeping.wait()  # the background write did not
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    failed = [e for e in read_events(tmp_path / "events.jsonl") if e.get("ok") is False]
    assert [e["step"] for e in failed] == [2] and "saving step 2" in failed[0]["message"]
    assert keeping.saved == 1 and read_latest(keeping.ckpt_dir) == "step_000001"
    metrics: dict[str, float] = {}
    assert keeping.save(3, metrics, healthy=True) and keeping.wait()
    assert metrics["checkpoint/count"] == 2.0  # the failed save is not counted


def test_a_resume_may_change_the_number_of_workers_and_nothing_else_of_a_group():
    """Checkpoints load into any world size, so `keel train` resumes a run whose groups have
    other `workers` counts; any other change of a group is still refused."""

    def dumped(workers: int, fsdp: bool = True) -> str:
        group = {"roles": ["actor", "rollout", "reference"], "workers": workers, "fsdp": fsdp}
        return dump_config(validate({
            "models": {"actor": "x"}, "algorithm": {"name": "grpo"},
            "train": {"batch_size": 6, "mini_batch_size": 6}, "rollout": {"n": 2},
            "resources": {"backend": "ray", "groups": [group]},
        }))  # fmt: skip

    assert config_changes(dumped(2), dumped(1)) == []
    assert config_changes(dumped(2), dumped(3)) == []
    assert config_changes(dumped(2), dumped(2, fsdp=False)) == ["resources.groups"]


def test_a_sharded_checkpoint_uploads_and_resumes_from_its_url(tiny_grpo, tmp_path):
    """checkpoint.upload_to with the sharded format: the upload starts once the background
    write is published and copies every shard (DCP's hidden .metadata too); a run elsewhere
    resumes from the URL."""
    remote = tmp_path / "remote"
    cfg = tiny_grpo(
        "train.steps=2", "checkpoint.save_steps=2", f"checkpoint.upload_to=file://{remote}",
        "checkpoint.format=sharded", "checkpoint.async_save=true",
    )  # fmt: skip
    run_training(cfg)
    local = Path(cfg.run_dir) / "checkpoints" / "step_000002"
    model_id = json.loads((local / "meta.json").read_text())["model_id"]  # its remote folder
    assert (remote / "latest").read_text().strip() == model_id
    for rel in ("actor/dcp/.metadata", "actor/dcp/__0_0.distcp", "actor/trainer_state.pt"):
        assert (remote / model_id / rel).read_bytes() == (local / rel).read_bytes(), rel
    other = cfg.model_copy(deep=True)
    other.run_dir, other.train.steps = str(tmp_path / "elsewhere"), 3
    assert run_training(other, resume=f"file://{remote}").resumed_from == 2
