"""Optional W&B / MLflow sinks: asking for one whose package is missing is a clear error."""

import importlib.util

import pytest

from keel.cli.main import main
from keel.monitor.optional import MissingPackageError, require
from tests.monitor.live import REPO


def test_require_names_the_field_and_the_package():
    with pytest.raises(MissingPackageError, match=r"monitor\.wandb: true needs .*keel_no_such"):
        require("keel_no_such_package", "monitor.wandb")
    require("json", "monitor.anything")  # an importable package passes


@pytest.mark.parametrize("field", ["wandb", "mlflow"])
def test_train_refuses_before_writing_the_run_dir(tiny_dir, tmp_path, capsys, field):
    assert importlib.util.find_spec(field) is None, "this test needs an environment without it"
    run_dir = tmp_path / "r"
    config = str(REPO / "examples" / "grpo_arith_tiny.yaml")
    sets = ["--set", f"models.actor={tiny_dir}", "--set", f"monitor.{field}=true"]
    code = main(["train", config, "--run-dir", str(run_dir), *sets])
    assert code == 2
    assert capsys.readouterr().err.startswith(f"keel: error: monitor.{field}: true needs")
    assert not run_dir.exists()
