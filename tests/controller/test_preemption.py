"""Real processes, real signals: SIGTERM checkpoints and exits 75; a second signal exits at once;
kill -9 at random moments (half of them inside a checkpoint write) never leaves a checkpoint that
resume would use half-written, and the run still ends bitwise-identical to a straight run."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from keel.checkpoint import list_checkpoints, validate_checkpoint
from keel.checkpoint.state import PAUSE_ENV, read_latest
from keel.controller import run_training
from keel.guard import read_events
from keel.monitor import read_metrics

ROOT = Path(__file__).resolve().parents[2]
KEEL = Path(sys.executable).parent / "keel"
KILLS = 4  # kill -9 repetitions (2 inside a checkpoint write, 2 at random moments)
STEPS = 6
KILL_STEPS = 10  # enough that no process of the kill test can finish the run before its kill
KILLED = [f"train.steps={KILL_STEPS}", "checkpoint.save_steps=1"]


def start(run_dir: Path, tiny_dir: Path, *extra: str, pause: float = 0.0) -> subprocess.Popen:
    from tests.conftest import TINY_GRPO

    reward = f"reward.fn={ROOT / 'tests/cli/format_reward.py'}:digit_fraction"
    sets = [*TINY_GRPO, f"models.actor={tiny_dir}", reward, f"train.steps={STEPS}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", PAUSE_ENV: str(pause)}
    args = [str(KEEL), "train", "examples/grpo_arith_tiny.yaml", "--run-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    return subprocess.Popen(args, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)


def wait_for(condition, proc: subprocess.Popen, timeout: float = 120) -> bool:
    """Poll until condition() or the process ends; True if the condition held."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    raise TimeoutError


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    try:
        return max((r["step"] for r in read_metrics(path)), default=0)
    except (OSError, ValueError):
        return 0


def saving(ckpt_dir: Path) -> bool:
    return ckpt_dir.is_dir() and any(p.name.startswith(".tmp-step_") for p in ckpt_dir.iterdir())


def events_of(run_dir: Path, kind: str) -> list[dict]:
    try:
        return [e for e in read_events(run_dir / "events.jsonl") if e["event"] == kind]
    except (OSError, ValueError):
        return []


def resume_events(run_dir: Path) -> list[dict]:
    return events_of(run_dir, "resume")


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def test_sigterm_checkpoints_exits_75_and_resumes(tmp_path, tiny_dir):
    run_dir = tmp_path / "run"
    proc = start(run_dir, tiny_dir)  # checkpoint.save_steps=0: only the signal saves
    assert wait_for(lambda: steps_logged(run_dir) >= 1, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    assert "preempted by SIGTERM" in err
    [ckpt] = list_checkpoints(run_dir / "checkpoints")
    events = read_events(run_dir / "events.jsonl")
    assert [e["event"] for e in events][-3:] == ["signal", "checkpoint", "stop"]
    assert events[-1]["step"] == ckpt.step
    proc = start(run_dir, tiny_dir)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    resumed = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "resume"]
    assert resumed[-1]["step"] == ckpt.step
    assert steps_logged(run_dir) == STEPS


def test_second_signal_exits_at_once_and_spares_the_latest(tmp_path, tiny_dir):
    run_dir, ckpt_dir = tmp_path / "run", tmp_path / "run" / "checkpoints"
    proc = start(run_dir, tiny_dir, "checkpoint.save_steps=1", pause=1.5)
    assert wait_for(lambda: read_latest(ckpt_dir) is not None and saving(ckpt_dir), proc)
    proc.send_signal(signal.SIGTERM)  # during the second save: it goes on …
    time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # … until the second signal
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert read_latest(ckpt_dir) == "step_000001"
    validate_checkpoint(ckpt_dir / "step_000001")


@pytest.mark.parametrize("seed", [0])
def test_kill_9_at_random_moments(tmp_path, tiny_dir, tiny_grpo, seed):
    rng = random.Random(seed)
    run_dir, ckpt_dir = tmp_path / "killed", tmp_path / "killed" / "checkpoints"
    for i in range(KILLS):
        proc = start(run_dir, tiny_dir, *KILLED, pause=0.4)
        # Wait until this process trains: after its resume, or (the first one, since a run killed
        # before its first checkpoint has nothing to resume) after its first checkpoint.
        known = len(resume_events(run_dir))
        if i == 0:
            landed = wait_for(lambda: read_latest(ckpt_dir) is not None, proc)
        else:
            landed = wait_for(lambda k=known: len(resume_events(run_dir)) > k, proc)
        if i % 2 == 0:  # inside a checkpoint write (the test hook holds it open for 0.4 s)
            landed = landed and wait_for(lambda: saving(ckpt_dir), proc)
        else:  # at a random moment
            time.sleep(rng.uniform(0, 1.0))
        before = [c.step for c in list_checkpoints(ckpt_dir, warn=False)]
        proc.kill()
        proc.wait()
        assert landed, proc.stderr.read()
        published = list_checkpoints(ckpt_dir, warn=False)
        for c in published:
            validate_checkpoint(c.path)  # nothing half-written was ever published
        newest = published[-1].path.name if published else None
        assert read_latest(ckpt_dir) == newest
        assert max((c.step for c in published), default=0) >= max(before, default=0)
    proc = start(run_dir, tiny_dir, *KILLED)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert len(resume_events(run_dir)) == KILLS
    straight = run_training(tiny_grpo(*KILLED))
    a, b = weights(straight.model_dir), weights(run_dir / "model")
    assert all(torch.equal(a[k], b[k]) for k in a), "kill -9 and resume changed the result"
    last = {
        r["step"]: r["reward/mean"] for r in read_metrics(run_dir / "metrics.jsonl") if r["step"]
    }
    ref = {
        r["step"]: r["reward/mean"]
        for r in read_metrics(straight.run_dir / "metrics.jsonl")
        if r["step"]
    }
    assert last == ref


def test_sigint_mid_step_finishes_the_step_then_checkpoints(tiny_grpo, monkeypatch):
    """A real SIGINT to this process in the middle of step 2 (Ctrl-C): the step completes, a
    checkpoint of step 2 is written, RunPreempted names the signal."""
    from keel.controller.outcome import RunPreempted
    from keel.controller.rl import RLController

    original = RLController.step

    def step_with_ctrl_c(self, step):
        if step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, step)

    monkeypatch.setattr(RLController, "step", step_with_ctrl_c)
    cfg = tiny_grpo("train.steps=4")
    # what the run must restore: Python's default_int_handler, or SIG_IGN in a process started
    # in the background by a shell without job control (which ignores SIGINT for it)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(RunPreempted, match="preempted by SIGINT after step 2"):
        run_training(cfg)
    assert [c.step for c in list_checkpoints(Path(cfg.run_dir) / "checkpoints")] == [2]
    assert steps_logged(Path(cfg.run_dir)) == 2
    assert signal.getsignal(signal.SIGINT) is before  # handlers restored


def test_a_real_ctrl_c_while_the_reward_runs_still_preempts(tiny_grpo):
    """Reward calls run on worker threads; a real SIGINT that arrives during one (here sent by
    the reward itself, on the first call of step 2) still reaches the main thread's handler:
    the step finishes and the run is preempted, not failed as a reward error."""
    from keel.controller.outcome import RunPreempted

    faults = ROOT / "tests" / "guard" / "fault_rewards.py"
    first_call_of_step_2 = 8 + 16  # eval_size 8 at step 0, then 4 prompts x 4 samples a step
    cfg = tiny_grpo("train.steps=4", f"reward.fn={faults}:ctrl_c_at",
                    f"reward.kwargs={{at: {first_call_of_step_2}}}")  # fmt: skip
    with pytest.raises(RunPreempted, match="preempted by SIGINT after step 2"):
        run_training(cfg)
    assert [c.step for c in list_checkpoints(Path(cfg.run_dir) / "checkpoints")] == [2]


def test_signal_in_the_step_0_evaluation_exits_75_and_reruns_restart(tmp_path, tiny_dir):
    """SIGTERM while the step-0 evaluation runs: exit 75 without a checkpoint. Rerunning the
    same command restarts the run; so does rerunning after a kill -9 before any checkpoint."""
    run_dir, started = tmp_path / "run", tmp_path / "started"
    slow = [
        f"reward.fn={ROOT / 'tests/cli/format_reward.py'}:slow_at_first",
        f"reward.kwargs={{slow_calls: 8, seconds: 0.1, started: {started}}}",
        "train.steps=3",
    ]
    proc = start(run_dir, tiny_dir, *slow)  # checkpoint.save_steps=0: only a signal saves
    assert wait_for(started.exists, proc)  # the first reward call of the step-0 evaluation
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    assert "preempted by SIGTERM before step 1" in err
    assert [(e["event"], e["step"]) for e in read_events(run_dir / "events.jsonl")] == [
        ("signal", 0), ("stop", 0),
    ]  # fmt: skip
    assert steps_logged(run_dir) == 0 and not list_checkpoints(run_dir / "checkpoints")

    started.unlink()
    proc = start(run_dir, tiny_dir, *slow)
    assert wait_for(lambda: steps_logged(run_dir) >= 1, proc)
    proc.kill()  # kill -9 before any checkpoint
    proc.wait()
    assert not list_checkpoints(run_dir / "checkpoints")

    proc = start(run_dir, tiny_dir, *slow)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    restarts = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "restart"]
    assert [e["reason"] for e in restarts] == ["no_checkpoint", "no_checkpoint"]
    assert steps_logged(run_dir) == 3 and (run_dir / "model").is_dir()


def test_kill_9_after_a_rollback_resumes_with_the_guards_decisions(tmp_path, tiny_dir, tiny_grpo):
    """kill -9 after a rollback, before the next checkpoint: the rerun resumes from the rollback's
    checkpoint with the rollback's lower LR, higher KL scale, data skip and count (from
    guard_state.json), and ends bitwise-identical to a run that was never killed."""
    from tests.controller.test_runner_guard import GUARDED, adversarial

    guarded = [
        *GUARDED, "checkpoint.save_steps=4", "guard.kl_factor=2",
        *adversarial(bad_from_step=5, bad_steps=1),
    ]  # fmt: skip
    run_dir, ckpt_dir = tmp_path / "killed", tmp_path / "killed" / "checkpoints"
    proc = start(run_dir, tiny_dir, *guarded)
    landed = wait_for(lambda: bool(events_of(run_dir, "rollback")), proc)
    proc.kill()
    proc.wait()
    assert landed, proc.stderr.read()
    assert [c.step for c in list_checkpoints(ckpt_dir)] == [4]  # before the next checkpoint
    state = json.loads((run_dir / "guard_state.json").read_text())
    assert (state["rollbacks"], state["lr_scale"], state["kl_scale"]) == (1, 0.5, 2.0)

    proc = start(run_dir, tiny_dir, *guarded)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    guard = torch.load(ckpt_dir / "step_000008" / "guard.pt", weights_only=True)
    assert (guard["rollbacks"], guard["lr_scale"], guard["kl_scale"]) == (1, 0.5, 2.0)

    straight = run_training(tiny_grpo(*guarded))
    a, b = weights(straight.model_dir), weights(run_dir / "model")
    assert all(torch.equal(a[k], b[k]) for k in a), "the resume lost the guard's decisions"
    rows = {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl")}
    ref = {r["step"]: r for r in read_metrics(straight.run_dir / "metrics.jsonl")}
    assert rows[8]["actor/lr"] == ref[8]["actor/lr"] == ref[1]["actor/lr"] * 0.5
