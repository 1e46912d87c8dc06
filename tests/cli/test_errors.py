"""Bad input: one clear line on stderr, exit status 2, and nothing in the run dir damaged."""

import os
from pathlib import Path

import pytest

from tests.cli.conftest import REPO


def assert_clean_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("keel: error:")
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


@pytest.fixture
def keel_main(capsys, monkeypatch):
    """keel_main(*args) → (returncode, stderr) of `keel.cli.main.main` run in this process from
    the repository root: the same code as the console script, for errors raised before any
    model loads (no interpreter start-up per call)."""
    from types import SimpleNamespace

    from keel.cli.main import main

    monkeypatch.chdir(REPO)

    def run(*args: str) -> SimpleNamespace:
        capsys.readouterr()
        code = main(list(args))
        return SimpleNamespace(returncode=code, stderr=capsys.readouterr().err)

    return run


def test_config_typo(keel, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("models: {actor: builtin:tiny}\nalgorithm: {name: grpo}\ntrian: {lr: 1}\n")
    assert_clean_error(keel("train", str(cfg)), str(cfg), "trian", "did you mean 'train'")


def test_missing_model_path(keel_main, tmp_path):
    proc = keel_main("train", "examples/grpo_arith_tiny.yaml", "--run-dir", str(tmp_path / "r"),
                "--set", "models.actor=/nonexistent/model")  # fmt: skip
    assert_clean_error(proc, "/nonexistent/model")
    assert not (tmp_path / "r").exists()


def test_malformed_dataset_line(keel_main, tiny_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", \n')
    proc = keel_main("train", "examples/grpo_arith_tiny.yaml", "--run-dir", str(tmp_path / "r"),
                "--set", f"models.actor={tiny_dir}", "--set", f"data.train={data}")  # fmt: skip
    assert_clean_error(proc, f"{data}:2")


def test_reward_that_raises_stops_and_keeps_earlier_files(keel, tiny_dir, tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("keep me")
    proc = keel("train", "examples/grpo_arith_tiny.yaml", "--run-dir", str(run_dir),
                "--set", f"models.actor={tiny_dir}", "--set", "data.arithmetic.eval_size=8",
                "--set", "reward.fn=tests/cli/format_reward.py:explode")  # fmt: skip
    assert_clean_error(proc, "reward service unavailable", "reward.on_error")
    assert (run_dir / "notes.txt").read_text() == "keep me"


def test_existing_run_is_not_overwritten(keel_main, tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = keel_main("train", "examples/grpo_arith_tiny.yaml", "--run-dir", str(run_dir))
    assert_clean_error(proc, "already holds a run", "--overwrite")
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_debug_shows_the_traceback(keel, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("models: {actor: builtin:tiny}\nalgorithm: {name: nope}\n")
    proc = keel("--debug", "config", "validate", str(cfg))
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr


def test_overlong_prompt_fails_before_the_run_directory_exists(keel_main, tiny_dir, tmp_path):
    run_dir = str(tmp_path / "r")
    overrides = ["--set", f"models.actor={tiny_dir}", "--set", "data.max_prompt_length=4"]
    proc = keel_main("train", "examples/grpo_arith_tiny.yaml", "--run-dir", run_dir, *overrides)
    assert_clean_error(proc, "data.max_prompt_length (4)")
    assert not (tmp_path / "r").exists()


def test_infinite_learning_rate_is_refused_before_anything_is_written(keel_main, tmp_path):
    run_dir = tmp_path / "r"
    proc = keel_main("train", "examples/grpo_arith_tiny.yaml", "--run-dir", str(run_dir),
                     "--set", "train.lr=.inf")  # fmt: skip
    assert_clean_error(proc, "train.lr: ", "finite")
    assert not run_dir.exists()


def tiny_run(tiny_dir, run_dir, *sets):
    args = ["train", "examples/grpo_arith_tiny.yaml", "--run-dir", str(run_dir)]
    for s in [f"models.actor={tiny_dir}", "data.arithmetic.eval_size=8", "train.steps=2",
              "train.batch_size=4", "train.mini_batch_size=4", "rollout.n=4", *sets]:  # fmt: skip
        args += ["--set", s]
    return args


@pytest.mark.parametrize(
    ("fn", "needle"), [("exits", "SystemExit(0)"), ("interrupts", "KeyboardInterrupt()")]
)
def test_reward_that_exits_or_interrupts_is_a_reward_error(keel, tiny_dir, tmp_path, fn, needle):
    run_dir = tmp_path / "r"
    proc = keel(*tiny_run(tiny_dir, run_dir, f"reward.fn=tests/cli/format_reward.py:{fn}"))
    assert_clean_error(proc, f"format_reward.py:{fn} failed on row 0", needle)
    assert not (run_dir / "model").exists()


def test_reward_that_never_returns_stops_the_run_at_the_default_hung_call_bound(
    keel, tiny_dir, tmp_path
):
    sets = [
        "reward.fn=tests/cli/format_reward.py:never_returns", "reward.on_error=fallback",
        "reward.timeout_s=0.05", "reward.max_concurrency=2",
    ]  # fmt: skip
    proc = keel(*tiny_run(tiny_dir, tmp_path / "r", *sets), timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]  # after the progress and the stop event
    assert last.startswith("keel: error:")
    assert "32 calls are still running after timing out" in last
    assert "reward.max_hung_calls=32" in last
    assert not (tmp_path / "r" / "model").exists()


def test_dataset_that_is_not_utf8_names_the_file_and_line(keel_main, tiny_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xff+2=", "answer": "3"}\n')
    proc = keel_main("train", "examples/grpo_arith_tiny.yaml", "--run-dir", str(tmp_path / "r"),
                "--set", f"models.actor={tiny_dir}", "--set", f"data.train={data}")  # fmt: skip
    assert_clean_error(proc, f"{data}:2: not valid UTF-8")
    assert not (tmp_path / "r").exists()


def test_config_that_is_not_utf8_names_the_file_and_line(keel_main, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_bytes(b"models: {actor: builtin:tiny}\n# r\xe9sum\xe9\nalgorithm: {name: grpo}\n")
    for command in (["config", "validate"], ["train"]):
        assert_clean_error(keel_main(*command, str(cfg)), f"{cfg}:2: not valid UTF-8")


def unusable_run_dirs(tmp_path):
    """(run_dir, what the error must say) for run directories no run can be written to."""
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    cases = [(afile, "is not a directory"), (afile / "r", f"{afile} is not a directory"),
             (Path("/sys/keel-run"), "is not writable")]  # fmt: skip
    if os.geteuid() != 0:  # root writes in any folder whatever its mode
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        cases.append((locked / "r", "is not writable"))
    return cases


def test_unusable_run_dir_is_an_error_before_models_load(keel_main, tmp_path):
    for run_dir, needle in unusable_run_dirs(tmp_path):
        proc = keel_main("train", "examples/grpo_arith_tiny.yaml", "--run-dir", str(run_dir),
                         "--set", "models.actor=/nonexistent/model")  # fmt: skip
        assert_clean_error(proc, f"run_dir {run_dir}", needle)
        assert "/nonexistent/model" not in proc.stderr  # checked before any model loads
    assert (tmp_path / "afile").read_text() == "not a folder"


def test_prompts_and_responses_past_the_models_context_are_refused(keel_main, tiny_dir, tmp_path):
    proc = keel_main(*tiny_run(tiny_dir, tmp_path / "r", "data.max_prompt_length=6000"))
    assert_clean_error(
        proc, "data.max_prompt_length (6000) + rollout.max_new_tokens (6) = 6006 tokens",
        f"models.actor ({tiny_dir})", "at most 256 tokens",
    )  # fmt: skip
    assert not (tmp_path / "r").exists()


def test_every_user_error_class_is_named_where_it_is_defined():
    """keel.cli.main looks the bad-input exceptions up by module and name, without importing
    them: each entry must name a real exception class of that module."""
    import importlib

    from keel.cli.main import OUTCOME, USER_ERRORS

    for module, name in [*USER_ERRORS, (OUTCOME, "RunPreempted"), (OUTCOME, "RunStopped")]:
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, Exception) and cls.__module__ == module, (module, name)


def test_config_validate_does_not_import_transformers():
    import subprocess
    import sys

    code = (
        "import sys; from keel.cli.main import main; "
        "rc = main(['config', 'validate', 'examples/grpo_arith_tiny.yaml']); "
        "assert rc == 0, rc; "
        "print('transformers' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"  # 4 s of imports a config check skips


BAD_CONFIGS = [  # (the file's text after its first two lines, what the error must name)
    ("seed: -1\n", ["run.yaml", "seed: must be an integer from 0 to 2147483647"]),
    (f"seed: {2**70}\n", ["run.yaml", "seed: must be an integer from 0 to 2147483647"]),
    ("train: {steps: true}\n", ["run.yaml", "train.steps: a boolean where a number is meant"]),
    ("train: {steps: 2}\nseed: 1\ntrain: {lr: 0.1}\n", ["run.yaml:5: duplicate key 'train'"]),
    ("reward:\n  kwargs: {a: &a [1, 2], b: *a}\n", ["run.yaml:4: YAML anchors and aliases"]),
]


@pytest.mark.parametrize(("text", "needles"), BAD_CONFIGS, ids=lambda v: str(v)[:24])
def test_bad_config_values_exit_2_before_any_model_loads(keel_main, tmp_path, text, needles):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("models: {actor: /nonexistent/model}\nalgorithm: {name: grpo}\n" + text)
    for command in (["config", "validate"], ["train", "--run-dir", str(tmp_path / "r")]):
        proc = keel_main(*command, str(cfg))
        assert_clean_error(proc, *needles)
        assert "/nonexistent/model" not in proc.stderr  # refused before any model loads
        assert len(proc.stderr.strip().splitlines()) <= 2  # the file, then the key
    assert not (tmp_path / "r").exists()


def test_a_model_folder_that_cannot_serve_the_config_exits_2_naming_it(keel_main, tiny_dir,
                                                                       tmp_path):  # fmt: skip
    """A tokenizer without the chat template data.apply_chat_template needs, and a config.json
    whose shapes are not the weights': exit 2 naming the folder (and setting or tensor)."""
    import json
    import shutil

    no_template = tmp_path / "no-template"
    shutil.copytree(tiny_dir, no_template)
    (no_template / "chat_template.jinja").unlink()
    proc = keel_main(*tiny_run(no_template, tmp_path / "r", "data.apply_chat_template=true"))
    assert_clean_error(proc, str(no_template), "no chat template", "data.apply_chat_template")
    lying = tmp_path / "lying"
    shutil.copytree(tiny_dir, lying)
    config = json.loads((lying / "config.json").read_text())
    (lying / "config.json").write_text(json.dumps({**config, "intermediate_size": 512}))
    proc = keel_main(*tiny_run(lying, tmp_path / "r"))
    assert_clean_error(proc, f"{lying / 'config.json'} does not match the weights",
                       "tensor model.layers.0.mlp.down_proj.weight")  # fmt: skip
    assert not (tmp_path / "r").exists()
