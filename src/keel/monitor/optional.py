"""The W&B and MLflow sinks, used only when their package is importable.

One tracker run per Keel run: the first start records each tracker's run id in
RUN_DIR/trackers.json (replaced atomically, keel.durable), and every later start of the same run
(a resume, a restart after a lost worker) reopens that tracker run. Steps a run logs again (after
a guard rollback, or a resume from a checkpoint older than the last logged step) are kept as each
tracker allows: W&B refuses a step below its last, so the sink never passes W&B a step: the
Keel step is the metric `keel/step` (each key's x-axis, define_metric), and a step at or below
the last one logged goes under `replay/<key>` with x-axis `replay/step`; MLflow accepts a step
again and keeps both points in the metric's history.
"""

from __future__ import annotations

import importlib.util
import json
import netrc
import os
import re
import secrets
import string
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from keel.config.loading import ConfigError
from keel.config.schema import MlflowConfig, WandbConfig
from keel.durable import replace_file

# `Any` here: a config value shown as a tracker's run parameter.

TRACKERS_FILE = "trackers.json"
# The record an export writes in RUN_DIR/model with its step (keel.checkpoint.export, a higher
# layer, owns it; tests/monitor/test_optional.py checks the two agree).
EXPORT_RECORD = "keel_export.json"
WANDB_HOST = "https://api.wandb.ai"
INIT_TIMEOUT_S = 30.0
STEP_KEY, REPLAY_PREFIX, REPLAY_STEP_KEY = "keel/step", "replay/", "replay/step"
MLFLOW_PARAM_CHARS = 6000  # MLflow refuses longer param values
MLFLOW_BATCH_PARAMS, MLFLOW_BATCH_METRICS = 100, 1000  # MLflow's log_batch limits


class MissingPackageError(ValueError):
    """A config asks for a sink whose package is not installed."""


class TrackerError(ConfigError):
    """A tracker that cannot run as configured (W&B online without credentials, a tracker run
    recorded in trackers.json that is gone); the message names the field or file."""


def require(package: str, field: str, install: str | None = None) -> None:
    """Raise MissingPackageError naming `field` when the module `package` is not importable;
    `install`: the pip requirement to suggest (default: `package`)."""
    if importlib.util.find_spec(package) is None:
        raise MissingPackageError(
            f"{field} needs the `{package}` package, which is not installed "
            f"(pip install {install or package}, or set {field}: false)"
        )


# ----------------------------------------------------------------------------- trackers.json
def read_trackers(run_dir: Path) -> dict[str, dict[str, Any]]:
    """RUN_DIR/trackers.json as {tracker: entry}; {} when the run has none yet."""
    path = run_dir / TRACKERS_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise TrackerError(
            f"{path} is unreadable ({exc}); delete it to start new tracker runs"
        ) from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise TrackerError(f"{path}: not a JSON object of tracker entries; delete it to start anew")
    return data


def record_tracker(run_dir: Path, tracker: str, entry: dict[str, Any]) -> None:
    """Set `tracker`'s entry of RUN_DIR/trackers.json (the file replaced atomically)."""
    data = read_trackers(run_dir)
    data[tracker] = entry
    replace_file(run_dir / TRACKERS_FILE, (json.dumps(data, indent=2) + "\n").encode("utf-8"))


def finished(run_dir: Path, final_step: int) -> bool:
    """Whether RUN_DIR/model is the export of step `final_step` (the run's end)."""
    try:
        record = json.loads((run_dir / "model" / EXPORT_RECORD).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and record.get("step") == final_step


# ------------------------------------------------------------------------------------- W&B
def wandb_credentials(environ: Mapping[str, str]) -> str | None:
    """Where W&B credentials for the host of WANDB_BASE_URL (default api.wandb.ai) come from:
    "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", the netrc file's path (NETRC, else ~/.netrc,
    written by `wandb login`), or None when there are none."""
    for var in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if environ.get(var):
            return var
    host = urlsplit(environ.get("WANDB_BASE_URL") or WANDB_HOST).hostname or ""
    path = Path(environ.get("NETRC") or Path(environ.get("HOME") or "~").expanduser() / ".netrc")
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (OSError, netrc.NetrcParseError):
        return None
    return str(path) if entry and entry[2] else None


def wandb_mode(section: WandbConfig, environ: Mapping[str, str]) -> str:
    """monitor.wandb.mode, or when unset: WANDB_MODE if it says online/offline, else online when
    W&B credentials are found (wandb_credentials), else offline."""
    if section.mode is not None:
        return section.mode
    if environ.get("WANDB_MODE") in ("online", "offline"):
        return environ["WANDB_MODE"]
    return "online" if wandb_credentials(environ) else "offline"


def check_wandb(section: WandbConfig, environ: Mapping[str, str]) -> None:
    """Refuse, before anything is written, W&B online without credentials (wandb.init would
    prompt or wait for the network)."""
    require("wandb", "monitor.wandb")
    if wandb_mode(section, environ) == "online" and wandb_credentials(environ) is None:
        raise TrackerError(
            "monitor.wandb.mode: online needs W&B credentials and none were found (set "
            "WANDB_API_KEY, or run `wandb login`); set monitor.wandb.mode: offline to log under "
            "RUN_DIR/wandb and `wandb sync` it later"
        )


def init_timeout(environ: Mapping[str, str]) -> float:
    """Seconds wandb.init may wait for the W&B server: WANDB_INIT_TIMEOUT when it is a positive
    number, else INIT_TIMEOUT_S (W&B's own default, 90, is longer)."""
    try:
        value = float(environ.get("WANDB_INIT_TIMEOUT", ""))
    except ValueError:
        return INIT_TIMEOUT_S
    return value if value > 0 and value != float("inf") else INIT_TIMEOUT_S


def new_run_id() -> str:
    """8 random lowercase letters and digits, the form of W&B's own run ids."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class WandbSink:
    """A W&B run named after RUN_DIR carrying the resolved config; offline runs live under
    RUN_DIR/wandb (each start of the Keel run adds a folder offline-run-TIME-ID with the same
    id: `wandb sync` uploads them in order into one run). Rows are logged without a W&B step, so
    W&B never drops one; see the module docstring for `keel/step` and `replay/`."""

    def __init__(
        self,
        run_dir: Path,
        name: str,
        config: dict[str, Any],
        section: WandbConfig,
        final_step: int,
        environ: Mapping[str, str] | None = None,
    ):
        require("wandb", "monitor.wandb")
        import wandb
        from wandb.errors import CommError, UsageError

        env = os.environ if environ is None else environ
        self.run_dir, self.final_step = run_dir, final_step
        saved = read_trackers(run_dir).get("wandb", {})
        self.entry: dict[str, Any] = {
            "id": saved.get("id") or new_run_id(),
            "mode": wandb_mode(section, env),
            "project": section.project,
            "last_step": int(saved.get("last_step", -1)),
        }
        record_tracker(run_dir, "wandb", self.entry)  # before init: a crash in it reuses the id
        timeout = init_timeout(env)
        settings = wandb.Settings(silent=True, console="off", init_timeout=timeout)
        try:
            self.run = wandb.init(
                id=self.entry["id"], resume="allow", mode=self.entry["mode"], dir=str(run_dir),
                project=section.project, entity=section.entity, group=section.group,
                tags=list(section.tags) or None, name=name, config=config, settings=settings,
            )  # fmt: skip
        except BaseException as exc:
            wandb.teardown()  # the service process it started
            if isinstance(exc, (CommError, UsageError)):
                raise TrackerError(
                    f"monitor.wandb: W&B did not start the run ({exc}); a server out of reach "
                    f"fails after {timeout:g}s (WANDB_INIT_TIMEOUT)"
                ) from None
            raise
        self.run.define_metric(STEP_KEY)
        self.run.define_metric(REPLAY_STEP_KEY)
        self.defined: set[str] = set()

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        replay = step <= self.entry["last_step"]
        prefix, axis = (REPLAY_PREFIX, REPLAY_STEP_KEY) if replay else ("", STEP_KEY)
        row: dict[str, float] = {prefix + key: value for key, value in metrics.items()}
        for key in row.keys() - self.defined:
            self.run.define_metric(key, step_metric=axis)
            self.defined.add(key)
        row[axis] = step
        self.run.log(row)
        if not replay:
            self.entry["last_step"] = step
            record_tracker(self.run_dir, "wandb", self.entry)

    def close(self) -> None:
        import wandb

        self.run.finish(exit_code=0 if finished(self.run_dir, self.final_step) else 1)
        wandb.teardown()  # stops W&B's service process


# ----------------------------------------------------------------------------------- MLflow
def mlflow_uri(section: MlflowConfig, run_dir: Path, environ: Mapping[str, str]) -> str:
    """monitor.mlflow.tracking_uri, else MLFLOW_TRACKING_URI, else a file store at
    RUN_DIR/mlruns."""
    return (
        section.tracking_uri
        or environ.get("MLFLOW_TRACKING_URI")
        or (run_dir / "mlruns").resolve().as_uri()
    )


def mlflow_key(key: str) -> str:
    """`key` with the characters MLflow refuses in a metric or param name (anything but
    letters, digits, `_ - . / :` and spaces) replaced by `_`."""
    return re.sub(r"[^\w\-./: ]", "_", key)


class MlflowSink:
    """An MLflow run in experiment monitor.mlflow.experiment; keys keep their `area/name` form.
    Params are the config of the run's first start: a resume that changed a key (train.steps,
    monitor.*, …) records the new value as the tag `changed/<key>` (MLflow refuses to change a
    param). A metrics row that cannot be sent (the server is down) is warned about and dropped:
    training goes on."""

    def __init__(
        self,
        run_dir: Path,
        name: str,
        params: dict[str, Any],
        section: MlflowConfig,
        final_step: int,
        environ: Mapping[str, str] | None = None,
    ):
        require("mlflow", "monitor.mlflow", install="mlflow-skinny")
        env = os.environ if environ is None else environ
        uri = mlflow_uri(section, run_dir, env)
        if uri.startswith("file:"):  # recent MLflow refuses the file store unless asked
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        import mlflow
        from mlflow.exceptions import MlflowException

        self.run_dir, self.final_step, self.section = run_dir, final_step, section
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        self.dropped = 0
        try:
            self._start(name, params, uri)
        except (MlflowException, OSError) as exc:
            raise TrackerError(
                f"monitor.mlflow.tracking_uri: MLflow at {uri} refused or did not answer "
                f"({exc}); an unreachable server is retried MLFLOW_HTTP_REQUEST_MAX_RETRIES "
                "times (MLflow's setting) before this error"
            ) from None

    def _start(self, name: str, params: dict[str, Any], uri: str) -> None:
        """Reopen the run trackers.json records for `uri`, or create one; log the params."""
        from mlflow.entities import Param, RunTag

        run_dir, section = self.run_dir, self.section
        saved = read_trackers(run_dir).get("mlflow", {})
        values = {mlflow_key(k): _param_text(v) for k, v in params.items()}
        if saved.get("tracking_uri") == uri and saved.get("run_id"):
            self.run_id = saved["run_id"]
            logged = self._reopen()
            changed = {k: v for k, v in values.items() if k in logged and logged[k] != v}
            values = {k: v for k, v in values.items() if k not in logged}
            tags = [RunTag(f"changed/{k}", v) for k, v in changed.items()]
            for i in range(0, len(tags), MLFLOW_BATCH_PARAMS):
                self.client.log_batch(self.run_id, tags=tags[i : i + MLFLOW_BATCH_PARAMS])
        else:
            experiment = self.client.get_experiment_by_name(section.experiment)
            exp_id = (
                experiment.experiment_id
                if experiment
                else self.client.create_experiment(section.experiment)
            )
            tags = {"keel.run_dir": str(run_dir.resolve())}
            self.run_id = self.client.create_run(exp_id, run_name=name, tags=tags).info.run_id
            record_tracker(run_dir, "mlflow", {"tracking_uri": uri, "run_id": self.run_id})
        batch = [Param(k, v) for k, v in values.items()]
        for i in range(0, len(batch), MLFLOW_BATCH_PARAMS):
            self.client.log_batch(self.run_id, params=batch[i : i + MLFLOW_BATCH_PARAMS])

    def _reopen(self) -> dict[str, str]:
        """Mark the recorded run RUNNING again; returns its params."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(self.run_id)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            raise TrackerError(
                f"{self.run_dir / TRACKERS_FILE}: MLflow run {self.run_id} cannot be reopened "
                f"({exc}); delete the file's mlflow entry to log to a new run"
            ) from None
        self.client.update_run(self.run_id, status="RUNNING")
        return dict(run.data.params)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        rows = [Metric(mlflow_key(k), v, stamp, step) for k, v in metrics.items()]
        try:
            for i in range(0, len(rows), MLFLOW_BATCH_METRICS):
                self.client.log_batch(self.run_id, metrics=rows[i : i + MLFLOW_BATCH_METRICS])
        except Exception as exc:  # a tracker outage must not stop training
            self.dropped += 1
            if self.dropped == 1:
                warnings.warn(
                    f"monitor.mlflow: step {step} was not logged ({exc}); later failures are "
                    "counted, not shown",
                    stacklevel=2,
                )

    def close(self) -> None:
        done = finished(self.run_dir, self.final_step)
        if done and self.section.log_model:
            self.client.log_artifacts(self.run_id, str(self.run_dir / "model"), "model")
        if self.dropped:
            self.client.set_tag(self.run_id, "keel.dropped_steps", str(self.dropped))
        self.client.set_terminated(self.run_id, status="FINISHED" if done else "KILLED")


def _param_text(value: Any) -> str:
    """A config value as an MLflow param value (None as "", cut to MLflow's length limit)."""
    return ("" if value is None else str(value))[:MLFLOW_PARAM_CHARS]
