"""Exact resume: N steps straight vs K steps, a stop, and a resume give bitwise-identical weights
and identical per-step metrics (timings aside). Parametrized over the example configs; a new
example (PPO, DPO, …) is covered by adding it to examples/ (and, if it needs them, to
RESUME_OVERRIDES)."""

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from keel.checkpoint import list_checkpoints
from keel.config.loading import load_config
from keel.controller import run_training
from keel.controller.outcome import RunPreempted
from keel.guard import read_events
from keel.monitor import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
REWARD = f"reward.fn={ROOT / 'tests/cli/format_reward.py'}:digit_fraction"
TINY = [
    "train.steps=4", "eval.every=2", "data.arithmetic.eval_size=8", "checkpoint.save_steps=2",
    "train.batch_size=4", "train.mini_batch_size=4", "train.warmup_steps=1", "rollout.n=4",
    "monitor.progress=false",
]  # fmt: skip
# A graded reward so that GRPO's advantages are not all zero on the untrained tiny model.
RESUME_OVERRIDES: dict[str, list[str]] = {
    "grpo_arith_tiny.yaml": [REWARD],
    "grpo_guess_number_tiny.yaml": ["rollout.max_turns=2"],  # episodes of 2 turns: cheaper
    "grpo_calculator_tiny.yaml": [REWARD, "rollout.max_new_tokens=8"],
}
VOLATILE = ("timing/", "perf/", "checkpoint/")


def weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def stable(rows: list[dict]) -> dict[int, dict]:
    """Per step (the last row wins), without the timing and checkpoint metrics."""
    out = {}
    for row in rows:
        out[row["step"]] = {k: v for k, v in row.items() if not k.startswith(VOLATILE)}
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_exact_resume(path: Path, tmp_path: Path, tiny_dir: Path):
    check_exact_resume(path, tmp_path, tiny_dir, [])


MIXED = ["grpo_arith_tiny.yaml", "ppo_arith_tiny.yaml"]


@pytest.mark.parametrize("name", MIXED)
def test_exact_resume_in_mixed_precision(name: str, tmp_path: Path, tiny_dir: Path):
    """bf16 autocast over float32 master weights: the checkpoint holds the master weights and
    the float32 optimizer states, so a resumed run is bitwise the straight one."""
    check_exact_resume(ROOT / "examples" / name, tmp_path, tiny_dir, ["models.dtype=bfloat16"])


@pytest.mark.parametrize("staleness", [1, 2])
def test_exact_resume_with_asynchronous_rollout(staleness: int, tmp_path: Path, tiny_dir: Path):
    """The batches generated ahead of the checkpoint are in it: the resumed run trains on the
    very batches the straight run trained on, and its generation continues the same RNG."""
    path = ROOT / "examples" / "grpo_arith_tiny.yaml"
    check_exact_resume(path, tmp_path, tiny_dir, [f"rollout.max_staleness={staleness}"])
    rows = stable(read_metrics(tmp_path / "split" / "metrics.jsonl"))
    lags = [rows[s]["rollout/weight_version_lag"] for s in (1, 2, 3, 4)]
    assert lags == [min(s, staleness) for s in range(4)]


@pytest.mark.parametrize("staleness", [1, 2])
def test_exact_resume_with_interruptible_rollout(staleness: int, tmp_path: Path, tiny_dir: Path):
    """rollout.interruptible: the rows of the batch generating ahead take each push at their
    third token. Where that happens is decided by the data, not by timing, so a resumed run
    is still the straight one; the lag counted by each batch's oldest token stays within
    max_staleness, and from the first push on the rows mix two versions."""
    path = ROOT / "examples" / "grpo_arith_tiny.yaml"
    extra = [f"rollout.max_staleness={staleness}", "rollout.interruptible=true",
             "rollout.interrupt_at=2"]  # fmt: skip
    check_exact_resume(path, tmp_path, tiny_dir, extra)
    rows = stable(read_metrics(tmp_path / "split" / "metrics.jsonl"))
    lags = [rows[s]["rollout/weight_version_lag"] for s in (1, 2, 3, 4)]
    assert lags == [min(s, staleness) for s in range(4)]
    mixed = [rows[s]["rollout/version_mixed_rows_frac"] for s in (1, 2, 3, 4)]
    # batch s + k is addressed by step s's push: batches 1..k are one version's
    assert mixed[:staleness] == [0.0] * staleness and all(m > 0 for m in mixed[staleness:])


def check_exact_resume(path: Path, tmp_path: Path, tiny_dir: Path, extra: list[str]) -> None:
    overrides = [*TINY, f"models.actor={tiny_dir}", *RESUME_OVERRIDES.get(path.name, []), *extra]
    straight = load_config(path, [*overrides, f"run_dir={tmp_path / 'straight'}"])
    run_training(straight, config_dir=path.parent)

    split = load_config(path, [*overrides, f"run_dir={tmp_path / 'split'}"])
    with pytest.raises(RunPreempted):
        run_training(split, config_dir=path.parent, stop_after=1)  # → checkpoint at step 1
    assert [c.step for c in list_checkpoints(tmp_path / "split" / "checkpoints")] == [1]
    result = run_training(split, config_dir=path.parent)
    assert result.resumed_from == 1

    a, b = weights(tmp_path / "straight" / "model"), weights(tmp_path / "split" / "model")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "weights differ after resume"
    rows_a = stable(read_metrics(tmp_path / "straight" / "metrics.jsonl"))
    rows_b = stable(read_metrics(tmp_path / "split" / "metrics.jsonl"))
    # step 0 is the evaluation before training: none in an example without held-out data
    assert sorted(rows_a) in ([0, 1, 2, 3, 4], [1, 2, 3, 4])
    assert rows_a == rows_b
    events = [e["event"] for e in read_events(tmp_path / "split" / "events.jsonl")]
    assert "signal" in events and "resume" in events


def test_resume_rules_for_a_finished_or_changed_run(tiny_grpo):
    from keel.controller.resume import RunDirError

    cfg = tiny_grpo("train.steps=2", "checkpoint.save_steps=1")
    run_training(cfg)
    assert run_training(cfg).finished  # auto: nothing left to do, and not an error
    with pytest.raises(RunDirError, match="already holds a run"):
        run_training(cfg, resume="never")
    changed = tiny_grpo("train.steps=3", "checkpoint.save_steps=1", "train.lr=0.1")
    with pytest.raises(RunDirError, match=r"config differs in train\.lr"):
        run_training(changed)
    longer = tiny_grpo("train.steps=3", "checkpoint.save_steps=1")
    assert run_training(longer).resumed_from == 2  # raising train.steps continues the run
    assert run_training(longer, overwrite=True).resumed_from == 0


def test_skipped_bad_rows_are_counted(tiny_grpo, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(
        '{"prompt": "1+1=", "answer": "2"}\n{"prompt": \n{"prompt": "2+3=", "answer": "5"}\n'
    )
    cfg = tiny_grpo("train.steps=1", f"data.train={data}", "data.on_bad_row=skip")
    run_training(cfg)
    rows = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    assert rows[0]["data/skipped_rows"] == 1.0


def test_a_default_run_resumes_after_a_crash(tmp_path, tiny_dir, monkeypatch):
    """checkpoint.save_steps defaults to 50: a run that dies at step 52 goes on from step 50."""
    from keel.config import validate
    from keel.controller.sft import SFTController

    cfg = validate({
        "run_dir": str(tmp_path / "run"), "models": {"actor": str(tiny_dir)},
        "algorithm": {"name": "sft"}, "data": {"arithmetic": {"eval_size": 2}},
        "train": {"steps": 53, "batch_size": 2}, "eval": {"every": 0},
        "monitor": {"progress": False},
    })  # fmt: skip
    original = SFTController.step

    def crash_at_52(self, step):
        if step == 52:
            raise RuntimeError("the machine went away")
        return original(self, step)

    monkeypatch.setattr(SFTController, "step", crash_at_52)
    with pytest.raises(RuntimeError, match="went away"):
        run_training(cfg)
    assert [c.step for c in list_checkpoints(tmp_path / "run" / "checkpoints")] == [50]
    monkeypatch.setattr(SFTController, "step", original)
    assert run_training(cfg).resumed_from == 50
    assert [c.step for c in list_checkpoints(tmp_path / "run" / "checkpoints")] == [50, 53]


def test_a_checkpoint_config_from_before_new_keys_and_resolved_paths_still_matches(
    tiny_grpo, tmp_path, monkeypatch
):
    """config.yaml of an older run: no data.columns.messages, a data path relative to the
    working directory. Resuming it with today's config (the same run) sees no change."""
    import yaml

    from keel.config.loading import dump_config
    from keel.controller.resume import config_changes

    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    current = tiny_grpo(f"data.train={tmp_path / 'train.jsonl'}")
    old = yaml.safe_load(dump_config(current))
    del old["data"]["columns"]["messages"]
    old["data"]["train"] = "train.jsonl"
    assert config_changes(yaml.safe_dump(old), dump_config(current)) == []
    old["data"]["columns"]["prompt"] = "question"
    assert config_changes(yaml.safe_dump(old), dump_config(current)) == ["data.columns.prompt"]


def corrupt(path: Path) -> None:
    """Replace one byte of `path` with a byte that is not UTF-8, keeping its size."""
    data = bytearray(path.read_bytes())
    data[2] = 0xFF
    path.write_bytes(bytes(data))


def test_resume_files_that_are_not_utf8_are_clear_errors(tiny_grpo):
    cfg = tiny_grpo("train.steps=2", "checkpoint.save_steps=1")
    run_training(cfg)
    run_dir, longer = Path(cfg.run_dir), tiny_grpo("train.steps=3", "checkpoint.save_steps=1")
    # (a line of metrics.jsonl that is not UTF-8 is set aside on resume, not lost: see
    # test_a_bad_middle_line_of_events_is_set_aside_on_resume)
    corrupt(run_dir / "checkpoints" / "step_000002" / "config.yaml")
    with pytest.warns(UserWarning, match="config.yaml is unreadable"):
        assert run_training(longer).resumed_from == 1  # falls back to the checkpoint before


@pytest.mark.parametrize(
    ("truncation", "key"), [("left", "data/truncated_prompts"), ("drop", "data/dropped_prompts")]
)
def test_prompts_over_the_limit_are_truncated_or_dropped_and_counted(
    tiny_grpo, tmp_path, truncation, key
):
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1" * 40 + "+2=", "answer": "3"},
            {"prompt": "2+3=", "answer": "5"}]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_grpo("train.steps=2", f"data.train={data}", "data.max_prompt_length=16",
                    f"data.truncation={truncation}")  # fmt: skip
    run_training(cfg)
    rows = read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
    assert rows[0][key] == 1.0 and rows[-1]["step"] == 2  # the long prompt did not stop it


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under `folder` with its content (None for a folder)."""
    return {
        str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
        for p in sorted(folder.rglob("*"))
    }


def test_torn_last_lines_are_set_aside_on_resume(tiny_grpo):
    """A full disk tore the last line of metrics.jsonl and of events.jsonl: readers leave it
    out, and the resume moves it to NAME.bad (an event says so) instead of failing."""
    from keel.report import load_run

    cfg = tiny_grpo("train.steps=2", "checkpoint.save_steps=1")
    with pytest.raises(RunPreempted):
        run_training(cfg, stop_after=1)
    run_dir = Path(cfg.run_dir)
    with (run_dir / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 2, "reward/me')
    with (run_dir / "events.jsonl").open("a") as fh:
        fh.write('{"time": 1, "step": 2, "ev')
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1]
    assert read_events(run_dir / "events.jsonl")[-1]["event"] == "stop"
    assert [r["step"] for r in load_run(run_dir).metrics] == [0, 1]

    assert run_training(cfg).resumed_from == 1
    for name in ("metrics.jsonl", "events.jsonl"):
        lines = (run_dir / name).read_text().splitlines()
        assert all(json.loads(line) for line in lines), name  # no torn line left anywhere
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]
    events = read_events(run_dir / "events.jsonl")
    moved = [e["message"] for e in events if e["message"].startswith("moved a torn last line")]
    assert len(moved) == 2 and "metrics.jsonl " in moved[0] and "events.jsonl " in moved[1]
    assert (run_dir / "metrics.jsonl.bad").read_text() == '{"step": 2, "reward/me\n'
    assert (run_dir / "events.jsonl.bad").read_text() == '{"time": 1, "step": 2, "ev\n'


def test_a_refused_config_change_touches_nothing(tiny_grpo):
    from keel.controller.resume import RunDirError

    cfg = tiny_grpo("train.steps=2", "checkpoint.save_steps=1")
    run_training(cfg)
    run_dir = Path(cfg.run_dir)
    (run_dir / "checkpoints" / ".tmp-step_000003-99").mkdir()  # a killed save's leftover
    before = snapshot(run_dir)
    changed = tiny_grpo("train.steps=3", "checkpoint.save_steps=1", "train.lr=0.1")
    with pytest.raises(RunDirError, match=r"config differs in train\.lr"):
        run_training(changed)
    assert snapshot(run_dir) == before


def test_train_steps_below_the_newest_checkpoint_is_refused(tiny_grpo):
    from keel.controller.resume import RunDirError

    cfg = tiny_grpo("train.steps=4", "checkpoint.save_steps=1")
    with pytest.raises(RunPreempted):
        run_training(cfg, stop_after=3)
    before = snapshot(Path(cfg.run_dir))
    with pytest.raises(RunDirError, match=r"at step 3, past train\.steps=2"):
        run_training(tiny_grpo("train.steps=2", "checkpoint.save_steps=1"))
    assert snapshot(Path(cfg.run_dir)) == before
    assert not (Path(cfg.run_dir) / "model").exists()


def test_a_run_without_a_checkpoint_restarts_with_the_same_config(tiny_grpo):
    """A run that ends (or is killed) before any checkpoint restarts at step 0 when the same
    command runs again; a changed config or a finished run is still refused."""
    from keel.controller.resume import RunDirError

    cfg = tiny_grpo("train.steps=1", "checkpoint.save_steps=0")  # no checkpoint
    run_training(cfg)
    run_dir = Path(cfg.run_dir)
    assert run_training(cfg).finished  # model/ records step 1 = train.steps
    (run_dir / "model").rename(run_dir / "model-was")  # as if killed before the export
    with pytest.raises(RunDirError, match=r"cannot restart .* differs in train\.lr"):
        run_training(tiny_grpo("train.steps=1", "checkpoint.save_steps=0", "train.lr=0.1"))
    rows = len(read_metrics(run_dir / "metrics.jsonl"))
    result = run_training(tiny_grpo("train.steps=2", "checkpoint.save_steps=0"))
    assert result.resumed_from == 0 and result.model_dir.is_dir()
    [restart] = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "restart"]
    assert restart["reason"] == "no_checkpoint" and restart["step"] == 0
    steps = [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert steps[:rows] == [0, 1] and steps[rows:] == [0, 1, 2]  # appended, nothing lost


def test_lora_run_resumes_exactly_from_an_adapter_only_checkpoint(tiny_grpo, tmp_path, tiny_dir):
    """A LoRA GRPO run (with its adapter-disabled reference): 3 steps straight vs 2 steps, a
    stop and a resume give identical merged exports and metrics; the checkpoint holds the
    adapter and optimizer only; model/ is a plain HF folder with the adapter merged in."""
    from transformers import AutoModelForCausalLM

    lora = ["models.lora.r=4", "models.lora.alpha=8", "train.lr=1e-3", "train.steps=3"]
    straight = tiny_grpo(*lora, f"run_dir={tmp_path / 'straight'}")
    assert straight.algorithm.kl_loss_coef > 0  # the reference role exists
    run_training(straight)
    split = tiny_grpo(*lora, "checkpoint.save_steps=2", f"run_dir={tmp_path / 'split'}")
    with pytest.raises(RunPreempted):
        run_training(split, stop_after=2)
    [ckpt] = list_checkpoints(tmp_path / "split" / "checkpoints")
    assert sorted(p.name for p in (ckpt.path / "actor").iterdir()) == ["state.pt"]
    state = torch.load(ckpt.path / "actor" / "state.pt", weights_only=True)
    assert state["model"] and all(".lora_" in k for k in state["model"])
    assert state["optimizer"]["state"] and state["weight_version"] == 2
    assert run_training(split).resumed_from == 2

    a, b = weights(tmp_path / "straight" / "model"), weights(tmp_path / "split" / "model")
    assert a.keys() == b.keys() == weights(tiny_dir).keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "weights differ after resume"
    base = weights(tiny_dir)
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"])  # fmt: skip
    assert torch.equal(a["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    rows_a = stable(read_metrics(tmp_path / "straight" / "metrics.jsonl"))
    assert rows_a == stable(read_metrics(tmp_path / "split" / "metrics.jsonl"))
    assert not (tmp_path / "straight" / "model" / "adapter_config.json").exists()
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "model")).__name__ == (
        "LlamaForCausalLM"
    )


def test_a_guard_state_the_guard_cannot_have_written_is_refused_and_never_applied(tiny_grpo):
    """lr_scale NaN or -1000 (the LR would turn negative: gradient ascent), rollbacks -100: the
    rerun is refused (GuardStateError: exit 2) naming the file and the field; nothing in RUN_DIR
    changes. --reset-guard replaces the file and continues."""
    from keel.guard import GuardStateError

    cfg = tiny_grpo("train.steps=1", "checkpoint.save_steps=1")
    run_training(cfg)
    run_dir, longer = Path(cfg.run_dir), tiny_grpo("train.steps=2", "checkpoint.save_steps=1")
    state = run_dir / "guard_state.json"
    for values, field in (('"lr_scale": NaN, "rollbacks": 0', "lr_scale"),
                          ('"lr_scale": -1000, "rollbacks": -100', "rollbacks")):  # fmt: skip
        state.write_text('{"kl_scale": 1.0, "rollback": null, "stop": null, ' + values + "}")
        before = snapshot(run_dir)
        with pytest.raises(GuardStateError, match=rf"{state}: {field} .*--reset-guard"):
            run_training(longer)
        assert snapshot(run_dir) == before
    result = run_training(longer, reset_guard=True)
    assert result.resumed_from == 1
    assert json.loads(state.read_text())["lr_scale"] == 1.0


def test_checkpoint_count_continues_after_a_resume(tiny_grpo):
    """checkpoint/count counts the run's checkpoints: after a resume it goes on from the
    checkpoint's count (it used to start again at 1)."""
    cfg = tiny_grpo("train.steps=3", "checkpoint.save_steps=1")
    with pytest.raises(RunPreempted):
        run_training(cfg, stop_after=1)
    run_training(cfg)
    rows = stable_all(read_metrics(Path(cfg.run_dir) / "metrics.jsonl"))
    assert [rows[s]["checkpoint/count"] for s in (1, 2, 3)] == [1.0, 2.0, 3.0]


def stable_all(rows: list[dict]) -> dict[int, dict]:
    """Per step, the last row wins (every key kept)."""
    return {row["step"]: row for row in rows}


def test_a_refused_rerun_does_not_touch_run_dir(tiny_grpo):
    """The run-directory checks used to create and remove a probe file in RUN_DIR before
    refusing, which changed its modification time."""
    from keel.config.loading import dump_config
    from keel.controller.resume import RunDirError

    run_dir = Path(tiny_grpo().run_dir)
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(dump_config(tiny_grpo("train.lr=0.1")))
    (run_dir / "metrics.jsonl").write_text('{"step": 0}\n')
    os.utime(run_dir, ns=(1_000_000_000, 1_000_000_000))
    before = (snapshot(run_dir), run_dir.stat().st_mtime_ns)
    with pytest.raises(RunDirError, match=r"cannot restart .* differs in train\.lr"):
        run_training(tiny_grpo())
    assert (snapshot(run_dir), run_dir.stat().st_mtime_ns) == before


def test_resume_never_on_a_run_with_checkpoints_says_what_it_holds(tiny_grpo):
    """--resume never in a RUN_DIR with checkpoints used to say "no checkpoint to resume from"."""
    from keel.controller.resume import RunDirError

    cfg = tiny_grpo("train.steps=2", "checkpoint.save_steps=1")
    with pytest.raises(RunPreempted):
        run_training(cfg, stop_after=1)
    with pytest.raises(RunDirError) as refused:
        run_training(cfg, resume="never")
    message = str(refused.value)
    assert "already holds a run" in message and "--overwrite" in message
    assert "no checkpoint" not in message
    assert "checkpoint at step 1" in message and "--resume never" in message


def test_an_unusable_meta_json_is_an_event_saying_what_is_wrong(tiny_grpo):
    """A checkpoint whose meta.json is not JSON, or records another step than its folder's, is
    skipped with a `restart` event that says which (no raw Python warning)."""
    import warnings

    cfg = tiny_grpo("train.steps=3", "checkpoint.save_steps=1")
    with pytest.raises(RunPreempted):
        run_training(cfg, stop_after=2)
    root = Path(cfg.run_dir) / "checkpoints"
    (root / "step_000002" / "meta.json").write_text('{"step": 999999}')
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any raw warning fails the test
        assert run_training(cfg).resumed_from == 1
    restarts = [e for e in read_events(Path(cfg.run_dir) / "events.jsonl")
                if e["event"] == "restart"]  # fmt: skip
    [skipped] = [e["message"] for e in restarts if "step_000002" in e["message"]]
    assert "meta.json records step 999999" in skipped and "unreadable" not in skipped
    assert "lacks healthy, time, metrics" in skipped

    with pytest.raises(RunPreempted):
        run_training(tiny_grpo("train.steps=4", "checkpoint.save_steps=1"), stop_after=4)
    (root / "step_000004" / "meta.json").write_text('{"step": 4, ')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert run_training(tiny_grpo("train.steps=4", "checkpoint.save_steps=1")).resumed_from == 3
    messages = [e["message"] for e in read_events(Path(cfg.run_dir) / "events.jsonl")]
    assert any("step_000004: meta.json is not valid JSON" in m for m in messages)


def test_a_bad_middle_line_of_events_is_set_aside_on_resume(tiny_grpo):
    """A line of events.jsonl that is not a JSON object, in the middle of the file: the resume
    moves it (and a torn last line) to events.jsonl.bad, byte for byte, with an event stamped
    with the step the run resumes at; `keel report` then reads the run."""
    from keel.report import load_run

    cfg = tiny_grpo("train.steps=3", "checkpoint.save_steps=1")
    with pytest.raises(RunPreempted):
        run_training(cfg, stop_after=2)
    run_dir = Path(cfg.run_dir)
    events = run_dir / "events.jsonl"
    lines = events.read_bytes().splitlines(keepends=True)
    bad = b'{"time": 1, "step": 1, "event": "chec\xffkpoint", "mess\n'
    events.write_bytes(b"".join(lines[:2]) + bad + b"".join(lines[2:]) + b'{"time": 2, "st')
    metrics = run_dir / "metrics.jsonl"
    corrupt(metrics)  # its first line (step 0) is no longer UTF-8
    rows = metrics.read_bytes().splitlines(keepends=True)
    assert run_training(cfg).resumed_from == 2
    assert (run_dir / "metrics.jsonl.bad").read_bytes() == rows[0]  # set aside, byte for byte
    assert metrics.read_bytes().splitlines(keepends=True)[:2] == rows[1:3]
    assert (run_dir / "events.jsonl.bad").read_bytes() == bad + b'{"time": 2, "st\n'
    kept = events.read_bytes().splitlines(keepends=True)
    assert kept[: len(lines)] == lines  # every good line stays, in order
    assert all(json.loads(line) for line in kept)
    moved = [e for e in read_events(events) if "events.jsonl.bad" in e["message"]]
    assert len(moved) == 2 and {e["step"] for e in moved} == {2}
    assert "line 3" in moved[0]["message"] and "torn last line" in moved[1]["message"]
    assert [e["step"] for e in load_run(run_dir).events][-1] == 3  # the report reads the run


def test_a_rerun_of_a_finished_run_says_so_and_touches_nothing(tiny_grpo):
    """The same command again after the run finished (e.g. a Kubernetes Job retrying a pod
    killed right after the export) is not an error: it says the run is finished. A changed
    config is still refused."""
    from keel.controller.resume import RunDirError

    cfg = tiny_grpo("train.steps=2", "checkpoint.save_steps=1")
    first = run_training(cfg)
    run_dir = Path(cfg.run_dir)
    before = snapshot(run_dir)
    again = run_training(cfg)
    assert again.finished and again.resumed_from == 2 and again.model_dir == first.model_dir
    assert again.last_eval == first.last_eval and again.first_eval == first.first_eval
    assert snapshot(run_dir) == before
    with pytest.raises(RunDirError, match=r"config differs in train\.lr"):
        run_training(tiny_grpo("train.steps=2", "checkpoint.save_steps=1", "train.lr=0.1"))
    assert snapshot(run_dir) == before


def test_a_run_killed_before_its_export_is_not_taken_for_finished(tiny_grpo, monkeypatch):
    """Continued past an earlier finish (train.steps raised), killed after its last checkpoint
    but before the new export: model/ still holds the old policy, so the run is not finished;
    the rerun exports the policy of the last step."""
    import keel.controller.keeping as keeping

    run_training(tiny_grpo("train.steps=2", "checkpoint.save_steps=1"))
    longer = tiny_grpo("train.steps=3", "checkpoint.save_steps=1")
    real = keeping.save_policy

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as if killed here

    monkeypatch.setattr(keeping, "save_policy", killed)
    with pytest.raises(KeyboardInterrupt):
        run_training(longer)
    monkeypatch.setattr(keeping, "save_policy", real)
    run_dir = Path(longer.run_dir)
    result = run_training(longer)
    assert not result.finished and result.resumed_from == 3
    exported = weights(run_dir / "model")
    final = weights(run_dir / "checkpoints" / "step_000003" / "actor")
    assert all(torch.equal(exported[k], final[k]) for k in final)
    assert run_training(longer).finished


def test_a_resume_removes_what_an_export_killed_midway_left(tiny_grpo):
    """A kill (SIGKILL: no clean-up runs) inside the final export leaves its temporary folder
    RUN_DIR/.tmp-model-PID/ beside no model/; the resume deletes it, says so, and exports."""
    cfg = tiny_grpo("train.steps=1", "checkpoint.save_steps=1")
    run_training(cfg)
    run_dir = Path(cfg.run_dir)
    (run_dir / "model").rename(run_dir / ".tmp-model-4242")  # the export, killed before its rename
    (run_dir / ".tmp-model-4242" / "keel_export.json").unlink()
    result = run_training(cfg)
    assert result.resumed_from == 1 and (run_dir / "model").is_dir()
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".tmp-")]
    deleted = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "restart"]
    assert [e["message"] for e in deleted] == [f"deleted the unfinished {run_dir}/.tmp-model-4242"]
