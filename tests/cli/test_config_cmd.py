"""`keel config validate` and `keel config show`."""


def test_validate_ok(keel):
    proc = keel("config", "validate", "examples/grpo_arith_tiny.yaml")
    assert proc.returncode == 0, proc.stderr
    assert "ok" in proc.stdout


def test_show_prints_resolved_config_and_derived_numbers(keel):
    overrides = ["train.batch_size=8", "rollout.n=4", "train.mini_batch_size=16",
                 "train.micro_batch_size=4"]  # fmt: skip
    args = [x for o in overrides for x in ("--set", o)]
    proc = keel("config", "show", "examples/grpo_arith_tiny.yaml", *args)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "batch_size: 8" in out
    assert "sequences_per_step: 32" in out
    assert "mini_batches_per_step: 2" in out
    assert "grad_accumulation_steps: 4" in out


def test_bad_batch_algebra_is_caught_before_anything_loads(keel):
    proc = keel("config", "validate", "examples/grpo_arith_tiny.yaml",
                "--set", "train.mini_batch_size=100")  # fmt: skip
    assert proc.returncode == 2
    assert "train.mini_batch_size (100)" in proc.stderr
