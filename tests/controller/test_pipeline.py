"""The asynchronous rollout pipeline: generation ahead of training, bounded weight lag, pushes
only between generations, and the batches ahead as checkpointable state."""

import threading

import pytest
import torch

from keel.controller.pipeline import RolloutPipeline
from keel.types import Batch


class Engine:
    """Generates batches stamped with the version of the weights it holds; records overlaps."""

    def __init__(self, wait: float = 1.0):
        self.wait = wait  # how long a generation waits to see an update running
        self.version = 0
        self.produced = 0
        self.busy = False
        self.training = threading.Event()  # set by the "trainer" while it updates
        self.seen = threading.Event()  # a generation saw the update running
        self.overlapped = 0

    def produce(self):
        self.busy = True
        if self.training.wait(timeout=self.wait):
            self.overlapped += 1
            self.seen.set()
        self.produced += 1
        batch = Batch(scores=torch.tensor([float(self.produced)]), meta={"v": self.version})
        self.busy = False
        return batch, {"timing/rollout_s": 0.0}

    def push(self, version):
        assert not self.busy, "weights were pushed while the engine was generating"
        self.version = version
        return {"rollout/weight_version": float(version)}


def run(pipeline, engine, steps):
    """(index of the batch, weight version it was generated with) per step."""
    seen = []
    for step in range(1, steps + 1):
        batch, metrics = pipeline.next(remaining=steps - step)
        assert ("timing/rollout_wait_s" in metrics) == bool(pipeline.max_staleness)
        seen.append((int(batch.scores[0]), batch.meta["v"]))
        engine.training.set()  # the update runs while the next batch is generated
        if not all(job.done() for job in pipeline.queue):
            assert engine.seen.wait(timeout=5.0), "no generation ran during the update"
        engine.seen.clear()
        engine.training.clear()
        pipeline.push(lambda step=step: engine.push(step))
    return seen


def test_synchronous_pipeline_generates_each_batch_with_the_latest_weights():
    engine = Engine(wait=0.0)
    pipeline = RolloutPipeline(engine.produce, max_staleness=0)
    assert run(pipeline, engine, 4) == [(1, 0), (2, 1), (3, 2), (4, 3)]
    assert pipeline.executor is None and engine.produced == 4


@pytest.mark.parametrize("k", [1, 2, 3])
def test_batches_are_generated_k_updates_behind_and_never_beyond_the_last_step(k):
    engine = Engine()
    pipeline = RolloutPipeline(engine.produce, max_staleness=k)
    seen = run(pipeline, engine, 6)
    assert [index for index, _ in seen] == [1, 2, 3, 4, 5, 6]  # data order unchanged
    lags = [step - version for step, (_, version) in enumerate(seen)]
    assert lags == [min(step, k) for step in range(6)]
    assert engine.produced == 6  # nothing generated for steps the run does not have
    # every step with a generation in flight saw one run during its update (run() checks);
    # with k = 1 that is every batch but the first (with k ≥ 2 a queued generation may start
    # only after the update, so fewer are counted)
    assert engine.overlapped == 5 if k == 1 else engine.overlapped >= 1
    pipeline.close()


def test_the_batches_ahead_survive_a_checkpoint_and_can_be_skipped():
    engine = Engine(wait=0.0)
    pipeline = RolloutPipeline(engine.produce, max_staleness=2)
    pipeline.next(remaining=10)
    state = pipeline.state_dict()
    assert [int(item["batch"]["scores"][0]) for item in state] == [2, 3]
    restored = RolloutPipeline(Engine(wait=0.0).produce, max_staleness=2)
    restored.load_state_dict(state)
    batch, _ = restored.next(remaining=0)
    assert int(batch.scores[0]) == 2 and batch.meta == {"v": 0}
    assert restored.drop(5) == 1  # one batch was left ahead
    assert restored.state_dict() == []
    pipeline.close()
    restored.close()


def test_a_failed_generation_is_raised_in_the_step():
    def produce():
        raise ValueError("reward server down")

    pipeline = RolloutPipeline(produce, max_staleness=1)
    with pytest.raises(ValueError, match="reward server down"):
        pipeline.next(remaining=3)
    pipeline.close()


def test_an_async_run_with_its_own_rollout_weights_rolls_back_and_resumes(tiny_grpo, tmp_path):
    """rollout.max_staleness 1: the rollout holds its own weights, pushed after each update.
    A guard rollback loads an older checkpoint into the actor (a new lineage, a lower
    version): the next push must be taken as newer; then a resume in fresh roles pushes again
    (issue 37: a version-only order check passed every test, and such a run died with
    StaleWeightsError after its first rollback). The reward turns adversarial by its call
    count: 16 calls of the step-0 evaluation on the 16 rows, then 16 a step; step 3's are
    calls 48-63."""
    import json

    from keel.controller import run_training
    from keel.guard import read_events
    from keel.monitor import read_metrics
    from tests.controller.test_runner_guard import FAULTS

    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n"
                            for i in range(16)))  # fmt: skip
    sets = [
        f"data.train={data}", f"data.eval={data}", "eval.every=100", "rollout.max_staleness=1",
        "checkpoint.save_steps=2", f"reward.fn={FAULTS}:turns_bad",
        "reward.kwargs={bad_from: 48, bad_until: 64}",
        "guard.rules=[{metric: reward/mean, min: 0.3, action: rollback}]",
    ]  # fmt: skip
    result = run_training(tiny_grpo(*sets, "train.steps=3"))
    run_dir = result.run_dir
    guard = [(e["event"], e["step"], e.get("to_step")) for e in read_events(
        run_dir / "events.jsonl") if e["event"] in ("guard_trip", "rollback", "stop")]  # fmt: skip
    assert guard == [("guard_trip", 3, None), ("rollback", 3, 2)]
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3, 3]  # step 3 again, after the rollback
    assert rows[2]["reward/mean"] == 0.0 and rows[3]["reward/mean"] >= 0.5
    assert result.model_dir.is_dir()
    resumed = run_training(tiny_grpo(*sets, "train.steps=4"))  # continued: fresh roles
    assert resumed.resumed_from == 3
    last = read_metrics(run_dir / "metrics.jsonl")[-1]
    assert last["step"] == 4 and last["guard/trips"] == 1.0


def test_an_interruptible_ppo_run_with_critic_warmup_steps_runs_to_its_end(tmp_path, tiny_dir):
    """PPO's critic warm-up step updates no actor and pushes nothing: the batch addressed by
    that step waits at its swap step for a push that is not coming until the next step
    addresses another batch (no deadlock). From the first push on, the batch generating
    ahead takes it at its second token."""
    from pathlib import Path

    from keel.config.loading import load_config
    from keel.controller import run_training
    from keel.monitor import read_metrics
    from tests.conftest import TINY_GRPO

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "examples/ppo_arith_tiny.yaml", [
        *TINY_GRPO, f"models.actor={tiny_dir}", f"run_dir={tmp_path / 'run'}", "train.steps=4",
        "algorithm.critic_warmup_steps=1", "rollout.max_staleness=1",
        "rollout.interruptible=true", "rollout.interrupt_at=1", "checkpoint.save_steps=0",
        f"reward.fn={root / 'tests/cli/format_reward.py'}:digit_fraction",
    ])  # fmt: skip
    run_training(cfg)
    rows = {r["step"]: r for r in read_metrics(tmp_path / "run" / "metrics.jsonl")}
    lags = [rows[s]["rollout/weight_version_lag"] for s in (1, 2, 3, 4)]
    assert lags == [0, 0, 1, 1]  # step 1 updated no actor: version 0 until step 2's push
    mixed = [rows[s]["rollout/version_mixed_rows_frac"] for s in (1, 2, 3, 4)]
    # batch 2, addressed by step 1, got no push; batches 3 and 4 took steps 2's and 3's
    assert mixed[:2] == [0.0, 0.0] and mixed[2] > 0 and mixed[3] > 0
