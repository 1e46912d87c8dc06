"""monitor.mlflow against a real MLflow tracking server started on 127.0.0.1 (from .venv-mlflow,
which scripts/install-test-tools creates): params, one point per step, the exported model as an
artifact, one MLflow run across a resume, and replayed steps."""

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from keel.cli.main import main
from keel.config.schema import MlflowConfig
from keel.monitor.optional import MlflowSink, read_trackers
from tests.conftest import TINY_GRPO
from tests.monitor.live import REPO, free_port

SERVER = REPO / ".venv-mlflow" / "bin" / "mlflow"
START_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The URL of an MLflow server (SQLite backend, artifacts served from a temporary folder);
    killed, with its workers, at the end of the module."""
    if not SERVER.is_file():
        pytest.fail(
            f"{SERVER} is missing: run scripts/install-test-tools (make test does)", pytrace=False
        )
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    log = (root / "server.log").open("wb")
    proc = subprocess.Popen(
        [str(SERVER), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
         "--artifacts-destination", str(root / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start: {(root / 'server.log').read_text()}")
            time.sleep(0.25)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def client(url):
    import mlflow

    return mlflow.MlflowClient(tracking_uri=url)


def train(tiny_dir, run_dir, url, steps):
    config = str(REPO / "examples" / "grpo_arith_tiny.yaml")
    reward = f"reward.fn={REPO / 'tests/cli/format_reward.py'}:digit_fraction"
    sets = [
        *TINY_GRPO, f"models.actor={tiny_dir}", reward, f"train.steps={steps}",
        "checkpoint.save_steps=2", "monitor.tensorboard=false",
        f"monitor.mlflow={{tracking_uri: {url}, experiment: keel-e2e, log_model: true}}",
    ]  # fmt: skip
    args = ["train", config, "--run-dir", str(run_dir)]
    assert main([*args, *(a for s in sets for a in ("--set", s))]) == 0


def test_a_run_and_its_resume_are_one_mlflow_run(server, tiny_dir, tmp_path):
    run_dir = tmp_path / "run"
    train(tiny_dir, run_dir, server, steps=2)
    run_id = read_trackers(run_dir)["mlflow"]["run_id"]
    assert read_trackers(run_dir)["mlflow"]["tracking_uri"] == server
    c = client(server)
    assert c.get_run(run_id).info.status == "FINISHED"
    train(tiny_dir, run_dir, server, steps=4)  # resumes from the checkpoint of step 2
    experiment = c.get_experiment_by_name("keel-e2e")
    runs = c.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    params = run.data.params
    assert params["algorithm.name"] == "grpo" and params["rollout.n"] == "4"
    assert params["train.steps"] == "2"  # the first start's; MLflow refuses a changed param
    assert run.data.tags["changed/train.steps"] == "4"
    assert run.data.tags["keel.run_dir"] == str(run_dir.resolve())
    for key in ("reward/mean", "actor/kl", "timing/rollout_s"):
        assert [p.step for p in c.get_metric_history(run_id, key)] == [1, 2, 3, 4], key
    assert [p.step for p in c.get_metric_history(run_id, "eval/accuracy")] == [0, 2, 4]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = {row["step"]: row["reward/mean"] for row in rows if "reward/mean" in row}
    assert {p.step: p.value for p in c.get_metric_history(run_id, "reward/mean")} == logged
    artifacts = {Path(f.path).name for f in c.list_artifacts(run_id, "model")}
    assert {"config.json", "model.safetensors", "keel_export.json"} <= artifacts
    record = c.download_artifacts(run_id, "model/keel_export.json", str(tmp_path))
    assert json.loads(Path(record).read_text())["step"] == 4  # the resumed run's export


def test_replayed_steps_keep_both_points(server, tmp_path):
    """A guard rollback logs steps again: MLflow keeps every point, in the order logged."""
    section = MlflowConfig(tracking_uri=server, experiment="keel-replay")
    sink = MlflowSink(tmp_path, "replay", {"seed": 0}, section, final_step=5)
    for step, value in [(1, 1.0), (2, 2.0), (3, 3.0), (2, 20.0), (3, 30.0), (4, 4.0)]:
        sink.log(step, {"actor/kl": value})
    sink.close()
    c = client(server)
    points = c.get_metric_history(sink.run_id, "actor/kl")
    assert [(p.step, p.value) for p in points] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (2, 20.0), (3, 30.0), (4, 4.0)
    ]  # fmt: skip
    run = c.get_run(sink.run_id)
    assert run.data.metrics["actor/kl"] == 4.0  # the latest: the highest step
    assert run.info.status == "KILLED"  # no export of step 5: stopped before its end
