"""keel.controller.guard_actions: a live rollback and a resume's adopt set a guard decision on the
run through the same `apply` (LR scale on the trainable groups, KL scale, batches skipped,
abandoned checkpoints deleted); on real checkpoints written by keel.controller.keeping."""

import time
from pathlib import Path
from typing import Any

import torch

from keel.checkpoint import CheckpointInfo, list_checkpoints
from keel.checkpoint.export import Lineage
from keel.checkpoint.state import read_latest
from keel.controller.assembly import Roles
from keel.controller.guard_actions import GuardActions, resumed_lineage
from keel.controller.keeping import Keeping
from keel.controller.protocol import Controller
from keel.guard import (
    GUARD_STATE,
    EventLog,
    Guard,
    GuardDecisions,
    Trip,
    Verdict,
    read_decisions,
    read_events,
)
from keel.workers import LocalWorkerGroup


class Weights:
    """A worker with a state and an LR scale, as a trainable role's."""

    def __init__(self):
        self.w = torch.zeros(2)
        self.lr_scale = 1.0

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.w = state["w"].clone()

    def set_lr_scale(self, scale: float) -> None:
        self.lr_scale = scale


class Counting(Controller):
    """A stage whose levers record what the guard set."""

    skips_batches = True

    def __init__(self):
        self.position, self.kl_scale, self.skipped = 0, 1.0, 0

    def step(self, step: int) -> dict[str, float]:
        self.position += 1
        return {}

    def evaluate(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])

    def set_kl_scale(self, scale: float) -> None:
        self.kl_scale = scale

    def skip_batches(self, n: int) -> None:
        self.skipped += n
        self.position += n


class Pairs(Controller):
    """A stage without levers: the Protocol's defaults."""

    def step(self, step: int) -> dict[str, float]:
        return {}

    def evaluate(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def a_run(tmp_path: Path, cfg, controller: Controller, steps: int = 3, unhealthy=()):
    """Keeping and GuardActions over one worker, with checkpoints of steps 1…steps (healthy but
    those in `unhealthy`)."""
    worker = Weights()
    group = LocalWorkerGroup("actor", [worker])
    guard = Guard(cfg.guard)
    events = EventLog(tmp_path / "events.jsonl")
    keeping = Keeping(
        cfg, tmp_path, {"actor": group}, {"controller": controller, "guard": guard}, events
    )
    roles = Roles(group, None, None, None, None, push_weights=lambda: {"weights/pushed": 1.0})
    actions = GuardActions(guard, tmp_path, roles, controller, keeping, events)
    for step in range(1, steps + 1):
        controller.step(step)
        worker.w += 1
        assert keeping.save(step, {}, healthy=step not in unhealthy)
    return worker, keeping, actions, events


def test_a_rollback_restores_the_newest_healthy_and_applies_the_decision(tiny_grpo, tmp_path):
    cfg = tiny_grpo("checkpoint.keep=5")
    ctl = Counting()
    worker, keeping, actions, events = a_run(tmp_path, cfg, ctl, unhealthy=(3,))
    verdict = Verdict("rollback", [Trip("collapse", "rollback", "reward/mean fell")])
    next_step, pushed = actions.rollback(5, verdict)
    events.close()
    assert next_step == 3 and pushed == {"weights/pushed": 1.0}
    assert torch.equal(worker.w, torch.full((2,), 2.0))  # step 2's weights
    assert worker.lr_scale == actions.guard.lr_scale < 1.0
    assert ctl.kl_scale == actions.guard.kl_scale
    assert ctl.skipped == 5 - 2 and ctl.position == 2 + 3  # step 2's position, then the skip
    assert [c.step for c in list_checkpoints(keeping.ckpt_dir)] == [1, 2]
    assert read_latest(keeping.ckpt_dir) == "step_000002"
    recorded = read_decisions(tmp_path / GUARD_STATE)
    assert recorded is not None and recorded.rollback is not None
    assert recorded.rollback["to_step"] == 2 and recorded.rollback["skip_batches"] == 3
    kinds = [e["event"] for e in read_events(tmp_path / "events.jsonl")]
    assert "rollback" in kinds and "restart" not in kinds  # a live rollback deletes silently


def test_a_resume_adopts_recorded_decisions_through_the_same_apply(tiny_grpo, tmp_path):
    cfg = tiny_grpo("checkpoint.keep=5")
    ctl = Counting()
    worker, keeping, actions, events = a_run(tmp_path, cfg, ctl)
    target = next(c for c in list_checkpoints(keeping.ckpt_dir) if c.step == 1)
    rollback = {"to_step": 1, "time": time.time(), "skip_batches": 2}
    decisions = GuardDecisions(1, 0.5, 2.0, rollback=rollback)
    info = keeping.load(target.path)
    message = actions.adopt(decisions, 1, info)
    events.close()
    assert worker.lr_scale == 0.5 and ctl.kl_scale == 2.0 and ctl.skipped == 2
    assert actions.guard.rollbacks == 1 and actions.decisions is decisions
    assert [c.step for c in list_checkpoints(keeping.ckpt_dir)] == [1]  # 2 and 3 abandoned
    deleted = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "restart"]
    assert len(deleted) == 2 and all("abandoned by a rollback" in e["message"] for e in deleted)
    assert "1 rollback(s), LR scale 0.5, KL scale 2, 2 batch(es) skipped" in message


def test_a_stage_without_levers_records_no_skip(tiny_grpo, tmp_path):
    """rm and dpo controllers keep the Protocol's defaults: a rollback with guard.skip_data
    skips nothing and records 0 batches; their KL scale, warnings and last batch are no-ops."""
    cfg = tiny_grpo("checkpoint.keep=5")
    ctl = Pairs()
    assert ctl.pop_warnings() == [] and ctl.last_batch is None and not ctl.skips_batches
    ctl.set_kl_scale(2.0)
    _, _, actions, events = a_run(tmp_path, cfg, ctl, steps=2)
    verdict = Verdict("rollback", [Trip("collapse", "rollback", "reward/mean fell")])
    assert actions.rollback(4, verdict)[0] == 3
    events.close()
    recorded = read_decisions(tmp_path / GUARD_STATE)
    assert recorded is not None and recorded.rollback is not None
    assert recorded.rollback["skip_batches"] == 0


def test_a_resume_goes_on_with_the_run_version_of_its_checkpoint_or_of_the_rollback_to_it():
    """resumed_lineage: the checkpoint's run version; after a rollback to that checkpoint (a
    kill before the next save) the rollback's recorded version, which is above every version
    the run used, even when it went back to an older lineage's checkpoint; a checkpoint and a
    record written before versions existed: version 1, and one more after a rollback to it."""
    run = Lineage("run")
    info = CheckpointInfo(Path("step_000004"), 4, True, 100.0, {}, "run-v2-s4-x", 2)
    assert resumed_lineage(run, info, None) == Lineage("run", 2)
    after = GuardDecisions(
        1, 0.5, 1.0, rollback={"to_step": 4, "time": 150.0, "skip_batches": 2, "run_version": 5}
    )
    assert resumed_lineage(run, info, after) == Lineage("run", 5)
    elsewhere = GuardDecisions(
        1, 0.5, 1.0, rollback={"to_step": 2, "time": 150.0, "skip_batches": 2, "run_version": 5}
    )
    assert resumed_lineage(run, info, elsewhere) == Lineage("run", 2)  # not its target
    older = CheckpointInfo(Path("step_000004"), 4, True, 100.0, {})  # before versions
    assert resumed_lineage(run, older, None) == Lineage("run", 1)
    legacy = GuardDecisions(1, 0.5, 1.0, rollback={"to_step": 4, "time": 150.0, "skip_batches": 2})
    assert resumed_lineage(run, older, legacy) == Lineage("run", 2)
