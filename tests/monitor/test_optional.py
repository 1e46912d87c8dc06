"""The W&B and MLflow sinks: config sections, the package and credential checks, one W&B
offline run across a resume (read back from W&B's own run files), replayed steps, and MLflow's
local file store reopened by a second start. tests/monitor/test_mlflow_server.py runs MLflow
against a real server."""

import json
import struct
import sys
from pathlib import Path

import psutil
import pytest

from keel.checkpoint.export import EXPORT_RECORD as CHECKPOINT_EXPORT_RECORD
from keel.cli.main import main
from keel.config import validate
from keel.config.loading import ConfigError
from keel.config.schema import MlflowConfig, WandbConfig
from keel.controller import run_training
from keel.controller.outcome import RunPreempted
from keel.monitor import read_metrics
from keel.monitor.optional import (
    EXPORT_RECORD,
    MissingPackageError,
    MlflowSink,
    WandbSink,
    init_timeout,
    read_trackers,
    require,
    wandb_credentials,
    wandb_mode,
)
from tests.controller.test_runner_guard import GUARDED, adversarial
from tests.monitor.live import REPO, free_port, tiny_grpo

BLOCK = 32768  # W&B's run file: LevelDB-style log blocks of 32 KiB after a 7-byte header


def wandb_records(path: Path) -> list:
    """The protobuf records (wandb.proto Record) of a W&B run file `run-ID.wandb`: after the
    header `:W&B` + magic + version, records of (crc32 uint32, length uint16, type uint8) and
    the payload, never crossing a block end (a block's tail shorter than a header is padding);
    type 1 is a whole record, 2/3/4 its first/middle/last pieces."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    out, pos, pieces = [], 7, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):
            pos += left
            continue
        pieces += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            out.append(record)
            pieces = b""
    return out


def history(records: list) -> list[dict[str, float]]:
    """Each logged row of `records` as {key: value} (W&B's own `_step`, `_runtime`… left out)."""
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item
            }
            rows.append({k: v for k, v in items.items() if not k.startswith("_")})
    return rows


def of_kind(records: list, kind: str) -> list:
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


def wandb_processes() -> list[psutil.Process]:
    """This process's descendants that belong to W&B (its service, wandb-core)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "wandb" in " ".join(child.cmdline()).lower():
                found.append(child)
        except psutil.Error:
            pass
    return found


@pytest.fixture
def no_wandb_credentials(monkeypatch, tmp_path):
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))


def test_require_names_the_field_and_the_package():
    with pytest.raises(MissingPackageError, match=r"monitor\.wandb needs .*keel_no_such"):
        require("keel_no_such_package", "monitor.wandb")
    with pytest.raises(MissingPackageError, match=r"pip install mlflow-skinny"):
        require("keel_no_such_package", "monitor.mlflow", install="mlflow-skinny")
    require("json", "monitor.anything")  # an importable package passes


@pytest.mark.parametrize("field", ["wandb", "mlflow"])
def test_train_refuses_before_writing_the_run_dir(tiny_dir, tmp_path, capsys, field, monkeypatch):
    monkeypatch.setitem(sys.modules, field, None)  # the package cannot be imported
    run_dir = tmp_path / "r"
    config = str(REPO / "examples" / "grpo_arith_tiny.yaml")
    sets = ["--set", f"models.actor={tiny_dir}", "--set", f"monitor.{field}=true"]
    code = main(["train", config, "--run-dir", str(run_dir), *sets])
    assert code == 2
    assert capsys.readouterr().err.startswith(f"keel: error: monitor.{field} needs")
    assert not run_dir.exists()


def test_tracker_switches_and_sections(tmp_path):
    def monitor(**sinks):
        return validate(tiny_grpo(tmp_path, tmp_path / "r", **sinks)).monitor

    on = monitor(wandb=True, mlflow=True)
    assert on.wandb == WandbConfig() and on.mlflow == MlflowConfig()
    assert on.mlflow.experiment == "keel" and on.wandb.mode is None
    off = monitor(wandb=False, mlflow=False)
    assert off.wandb is None and off.mlflow is None
    full = monitor(
        wandb={"project": "p", "entity": "e", "mode": "offline", "tags": ["a"], "group": "g"},
        mlflow={"tracking_uri": "http://127.0.0.1:5000", "experiment": "x", "log_model": True},
    )
    assert full.wandb.tags == ["a"] and full.mlflow.log_model
    with pytest.raises(ConfigError, match=r"monitor\.wandb\.projetc: unknown key"):
        monitor(wandb={"projetc": "p"})
    with pytest.raises(ConfigError, match=r"monitor\.wandb\.mode"):
        monitor(wandb={"mode": "cloud"})
    with pytest.raises(ConfigError, match=r"monitor\.mlflow\.uri: unknown key"):
        monitor(mlflow={"uri": "http://x"})


def test_wandb_credentials_and_the_default_mode(tmp_path):
    none = {"NETRC": str(tmp_path / "missing")}
    assert wandb_credentials(none) is None
    assert wandb_mode(WandbConfig(), none) == "offline"
    assert wandb_mode(WandbConfig(mode="online"), none) == "online"
    assert wandb_mode(WandbConfig(), {**none, "WANDB_MODE": "online"}) == "online"
    keyed = {**none, "WANDB_API_KEY": "k" * 40}
    assert wandb_credentials(keyed) == "WANDB_API_KEY"
    assert wandb_mode(WandbConfig(), keyed) == "online"
    assert wandb_mode(WandbConfig(mode="offline"), keyed) == "offline"
    assert init_timeout({}) == init_timeout({"WANDB_INIT_TIMEOUT": "soon"}) == 30
    assert init_timeout({"WANDB_INIT_TIMEOUT": "5"}) == 5
    rc = tmp_path / "netrc"  # what `wandb login` writes
    rc.write_text("machine api.wandb.ai\n  login user\n  password " + "p" * 40 + "\n")
    assert wandb_credentials({"NETRC": str(rc)}) == str(rc)
    own_host = {"NETRC": str(rc), "WANDB_BASE_URL": "https://wandb.example.com"}
    assert wandb_credentials(own_host) is None  # the entry is for another host
    rc.write_text("machine api.wandb.ai login\n")  # unparseable: no credentials
    assert wandb_credentials({"NETRC": str(rc)}) is None


def test_online_without_credentials_fails_at_once_naming_the_field(
    tiny_dir, tmp_path, capsys, no_wandb_credentials
):
    run_dir = tmp_path / "r"
    config = str(REPO / "examples" / "grpo_arith_tiny.yaml")
    sets = ["--set", f"models.actor={tiny_dir}", "--set", "monitor.wandb={mode: online}"]
    assert main(["train", config, "--run-dir", str(run_dir), *sets]) == 2
    err = capsys.readouterr().err
    assert err.startswith("keel: error: monitor.wandb.mode: online needs W&B credentials")
    assert "WANDB_API_KEY" in err
    assert not run_dir.exists()


def test_online_with_a_server_out_of_reach_fails_within_the_init_timeout(
    tiny_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    config = str(REPO / "examples" / "grpo_arith_tiny.yaml")
    sets = ["--set", f"models.actor={tiny_dir}", "--set", "monitor.wandb={project: p}"]
    assert main(["train", config, "--run-dir", str(tmp_path / "r"), *sets]) == 2
    err = capsys.readouterr().err
    assert "keel: error: monitor.wandb: W&B did not start the run" in err
    assert "fails after 3s (WANDB_INIT_TIMEOUT)" in err
    assert wandb_processes() == []


def test_an_offline_run_is_one_wandb_run_across_a_resume(tiny_dir, tmp_path, no_wandb_credentials):
    raw = tiny_grpo(tiny_dir, tmp_path / "run", wandb={"project": "keel-test", "tags": ["t"]})
    raw["train"]["steps"], raw["eval"]["every"] = 4, 4  # evaluations at steps 0 and 4
    cfg = validate(raw)
    with pytest.raises(RunPreempted):
        run_training(cfg, stop_after=2)  # checkpoint at step 2, then stop
    run_id = read_trackers(tmp_path / "run")["wandb"]["id"]
    run_training(cfg)  # resumes from step 2
    assert read_trackers(tmp_path / "run")["wandb"] == {
        "id": run_id, "mode": "offline", "project": "keel-test", "last_step": 4,
    }  # fmt: skip
    folders = sorted((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(folders) == 2 and all(f.name.endswith(f"-{run_id}") for f in folders)
    starts = [wandb_records(f / f"run-{run_id}.wandb") for f in folders]
    for records in starts:
        (run,) = of_kind(records, "run")
        assert (run.run_id, run.project, list(run.tags)) == (run_id, "keel-test", ["t"])
    first, second = (history(records) for records in starts)
    assert [row["keel/step"] for row in first] == [0, 1, 2]  # step 0: the first evaluation
    assert [row["keel/step"] for row in second] == [3, 4]
    assert "eval/accuracy" in first[0] and "reward/mean" in second[-1]
    assert not any(k.startswith("replay/") for row in first + second for k in row)
    axes = {m.name: m.step_metric for m in of_kind(starts[1], "metric")}
    assert axes["reward/mean"] == "keel/step"
    # stopped before its end: exit 1 (W&B shows it failed until resumed); finished: exit 0
    assert [of_kind(records, "exit")[0].exit_code for records in starts] == [1, 0]
    assert wandb_processes() == []
    run_training(cfg, overwrite=True)  # a new run in the same folder: a new W&B run
    assert read_trackers(tmp_path / "run")["wandb"]["id"] != run_id
    assert len(list((tmp_path / "run" / "wandb").glob("offline-run-*"))) == 1


def test_replayed_steps_are_logged_under_replay(tmp_path, no_wandb_credentials):
    """After a guard rollback the run logs steps it logged before: W&B would drop them under
    their own keys (below its last step); they go to replay/<key> against replay/step."""
    sink = WandbSink(tmp_path, "r", {"train.lr": 0.1}, WandbConfig(), final_step=9)
    for step, value in [(1, 1.0), (2, 2.0), (3, 3.0), (2, 20.0), (3, 30.0), (4, 4.0)]:
        sink.log(step, {"actor/kl": value})
    sink.close()
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    records = wandb_records(next(folder.glob("run-*.wandb")))
    rows = history(records)
    kept = [(r["keel/step"], r["actor/kl"]) for r in rows if "actor/kl" in r]
    replayed = [(r["replay/step"], r["replay/actor/kl"]) for r in rows if "replay/step" in r]
    assert kept == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)]
    assert replayed == [(2, 20.0), (3, 30.0)]
    axes = {m.name: m.step_metric for m in of_kind(records, "metric")}
    assert axes["actor/kl"] == "keel/step" and axes["replay/actor/kl"] == "replay/step"
    assert read_trackers(tmp_path)["wandb"]["last_step"] == 4
    assert wandb_processes() == []


def test_a_guard_rollback_as_the_trackers_see_it(tiny_grpo, no_wandb_credentials, monkeypatch):
    """A real rollback (a reward that turns adversarial at step 5; the guard goes back to the
    checkpoint of step 4): the monitor gets step 5 twice, the tripped one and the replayed one.
    W&B keeps the first under reward/mean and the replay under replay/reward/mean; MLflow keeps
    both points of step 5 in reward/mean's history."""
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    trackers = ["monitor.wandb={project: keel-test}", "monitor.mlflow=true"]
    cfg = tiny_grpo(*GUARDED, *adversarial(5, 1), *trackers)
    run_training(cfg)
    run_dir = Path(cfg.run_dir)
    logged = [(r["step"], r["reward/mean"]) for r in read_metrics(run_dir / "metrics.jsonl")
              if "reward/mean" in r]  # fmt: skip
    steps = [step for step, _ in logged]
    assert steps == [1, 2, 3, 4, 5, 5, 6, 7, 8]
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    rows = history(wandb_records(next(folder.glob("run-*.wandb"))))
    kept = [(r["keel/step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
    replayed = [(r["replay/step"], r["replay/reward/mean"]) for r in rows if "replay/step" in r]
    assert kept == logged[:5] + logged[6:] and replayed == [logged[5]]
    client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    run_id = read_trackers(run_dir)["mlflow"]["run_id"]
    points = client.get_metric_history(run_id, "reward/mean")
    assert [(p.step, p.value) for p in points] == logged  # the same doubles, both 5s kept


def test_mlflow_file_store_reopens_the_recorded_run(tmp_path, monkeypatch):
    """Without a tracking URI (none in the config or MLFLOW_TRACKING_URI) MLflow writes a file
    store at RUN_DIR/mlruns; a second start of the run logs into the same MLflow run."""
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / EXPORT_RECORD).write_text('{"step": 2}\n')
    first = MlflowSink(tmp_path, "r", {"train.steps": 2, "seed": 0}, MlflowConfig(), final_step=4)
    first.log(1, {"reward/mean": 0.5})
    first.close()  # the export is of step 2, not 4: stopped before its end
    client = mlflow.MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    assert client.get_run(first.run_id).info.status == "KILLED"
    (tmp_path / "model" / EXPORT_RECORD).write_text('{"step": 4}\n')
    again = MlflowSink(tmp_path, "r", {"train.steps": 4, "seed": 0}, MlflowConfig(), final_step=4)
    assert again.run_id == first.run_id == read_trackers(tmp_path)["mlflow"]["run_id"]
    again.log(2, {"reward/mean": 0.7})
    again.close()
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"train.steps": "2", "seed": "0"}  # the first start's
    assert run.data.tags["changed/train.steps"] == "4"
    points = client.get_metric_history(first.run_id, "reward/mean")
    assert [(p.step, p.value) for p in points] == [(1, 0.5), (2, 0.7)]


def test_mlflow_out_of_reach_or_a_lost_run_is_a_clear_error(
    tmp_path, tiny_dir, capsys, monkeypatch
):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # MLflow's own retry setting
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens
    config = str(REPO / "examples" / "grpo_arith_tiny.yaml")
    sets = ["--set", f"models.actor={tiny_dir}", "--set", f"monitor.mlflow={{tracking_uri: {url}}}"]
    assert main(["train", config, "--run-dir", str(tmp_path / "r"), *sets]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"keel: error: monitor.mlflow.tracking_uri: MLflow at {url} refused")

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    MlflowSink(tmp_path, "r", {}, MlflowConfig(), final_step=1).close()
    entry = read_trackers(tmp_path)["mlflow"]
    (tmp_path / "trackers.json").write_text(
        json.dumps({"mlflow": {**entry, "run_id": "0123456789abcdef0123456789abcdef"}})
    )
    with pytest.raises(ConfigError, match=r"trackers\.json: MLflow run 0123.* cannot be reopened"):
        MlflowSink(tmp_path, "r", {}, MlflowConfig(), final_step=1)


def test_the_export_record_name_is_the_checkpoint_layers():
    assert EXPORT_RECORD == CHECKPOINT_EXPORT_RECORD
