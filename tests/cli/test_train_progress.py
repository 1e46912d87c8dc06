"""What a run says on a stderr that is not a terminal (a pipe here): a progress line at the
interval set (monitor.progress_every_steps), a line at once for each checkpoint, and the
warning when most groups' rewards do not vary; eval.every 0 evaluates nothing, and
`keel eval RUN_DIR` still finds the run's eval data."""

import json

from keel.guard import read_events
from keel.monitor import read_metrics

CONFIG = """\
models: {{actor: {model}}}
algorithm: {{name: grpo, kl_loss_coef: 0.0}}
data: {{train: builtin:arithmetic, eval: builtin:arithmetic, arithmetic: {{eval_size: 8}}}}
reward: {{fn: tests/cli/format_reward.py:constant}}
rollout: {{n: 4, max_new_tokens: 4}}
train: {{steps: 4, batch_size: 4, mini_batch_size: 16}}
eval: {{every: 0}}
checkpoint: {{save_steps: 2}}
monitor: {{progress_every_steps: 3, progress_every_seconds: 0, jsonl: true}}
"""


def test_progress_lines_on_a_pipe_no_evaluation_and_the_flat_groups_warning(
    keel, tiny_dir, tmp_path
):
    config = tmp_path / "run.yaml"
    config.write_text(CONFIG.format(model=tiny_dir))
    run_dir = tmp_path / "run"
    proc = keel("train", str(config), "--run-dir", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()

    def index(prefix: str) -> int:
        found = [i for i, line in enumerate(lines) if line.startswith(prefix)]
        assert found, f"no line starts with {prefix!r}:\n{proc.stderr}"
        return found[0]

    announced = index("4 steps; a progress line every 3 steps (monitor.progress_every_steps")
    assert announced == index("step 1/4") - 1  # with the first line, not at the start
    progress = [line.split("  ")[0] for line in lines if line.startswith("step ")]
    assert progress == ["step 1/4", "step 3/4", "step 4/4"]  # the first, every 3rd, the last
    assert " s/step, " in lines[index("step 1/4")]
    assert index("keel: [checkpoint] step 2: saved") < index("step 3/4")  # at once
    warning = lines[index("keel: [warning] step 3: 100% of the groups of step 3")]
    for remedy in ("rollout.n (now 4", "algorithm.filter_groups", "easier prompts"):
        assert remedy in warning

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # eval.every 0: no step-0 row
    assert not [k for r in rows for k in r if k.startswith("eval/")]
    assert [r["reward/all_equal_frac"] for r in rows] == [1.0] * 4
    flat = [e for e in read_events(run_dir / "events.jsonl") if e.get("rule") == "flat_groups"]
    assert [e["step"] for e in flat] == [3]  # after 3 steps in a row, then not every step

    # the run's config keeps data.eval: `keel eval RUN_DIR` needs no --data
    proc = keel("eval", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((run_dir / "eval" / "model" / "metrics.json").read_text())
    assert summary["examples"] == 8
