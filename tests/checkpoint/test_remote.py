"""Object storage round trip against a real local S3-compatible server (moto's server mode, a
subprocess on a free 127.0.0.1 port) through fsspec/s3fs: upload each checkpoint, resume a new
run directory from the bucket."""

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from keel.controller import run_training
from keel.guard import read_events
from keel.monitor import read_metrics


@pytest.fixture
def s3_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.2)
    options = {"endpoint_url": url, "key": "testing", "secret": "testing"}
    import s3fs

    s3fs.S3FileSystem(**options).mkdir("keel-ckpt")  # no region: us-east-1, no constraint
    yield options
    proc.terminate()
    proc.wait(timeout=10)


def test_upload_and_resume_from_s3(tiny_grpo, tmp_path, s3_server):
    import s3fs

    cfg = tiny_grpo(
        "train.steps=2", "checkpoint.save_steps=2", "checkpoint.upload_to=s3://keel-ckpt/run1"
    )
    cfg.checkpoint.storage_options = s3_server
    run_training(cfg)
    fs = s3fs.S3FileSystem(**s3_server)
    assert fs.cat_file("keel-ckpt/run1/latest").decode().strip() == "step_000002"
    remote = "keel-ckpt/run1/step_000002"
    local = Path(cfg.run_dir) / "checkpoints" / "step_000002"
    assert fs.exists(f"{remote}/COMPLETE")
    assert (
        fs.cat_file(f"{remote}/actor/model.safetensors")
        == (local / "actor" / "model.safetensors").read_bytes()
    )
    assert any(
        e.get("url", "").endswith("step_000002")
        for e in read_events(Path(cfg.run_dir) / "events.jsonl")
    )

    other = cfg.model_copy(deep=True)
    other.run_dir = str(tmp_path / "elsewhere")
    other.train.steps = 3
    result = run_training(other, resume="s3://keel-ckpt/run1")
    assert result.resumed_from == 2
    fetched = Path(other.run_dir) / "checkpoints" / "step_000002" / "actor" / "model.safetensors"
    assert fetched.read_bytes() == (local / "actor" / "model.safetensors").read_bytes()


def test_failed_upload_is_an_event_and_training_goes_on(tiny_grpo):
    cfg = tiny_grpo(
        "train.steps=2", "checkpoint.save_steps=1", "checkpoint.upload_to=file:///dev/null/x"
    )
    result = run_training(cfg)
    failed = [
        e for e in read_events(Path(cfg.run_dir) / "events.jsonl") if "upload to" in e["message"]
    ]
    assert [e["step"] for e in failed] == [1, 2] and "failed" in failed[0]["message"]
    assert result.model_dir.is_dir()


def test_an_unreachable_store_does_not_delay_training(tiny_grpo):
    """Uploads to an S3 endpoint where nothing listens run in the background: the steps and
    saves go on at their own pace, the upload waiting behind a running one is superseded by the
    newer checkpoint, and the end of the run waits checkpoint.upload_wait_s at most."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections are refused
    cfg = tiny_grpo(
        "train.steps=3", "checkpoint.save_steps=1", "checkpoint.upload_to=s3://keel-ckpt/run",
        "checkpoint.upload_wait_s=0.5",
    )  # fmt: skip
    cfg.checkpoint.storage_options = {
        "endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s",
    }  # fmt: skip
    start = time.monotonic()
    run_training(cfg)
    took = time.monotonic() - start
    saved = {
        r["step"]: r["checkpoint/saved_at"]
        for r in read_metrics(Path(cfg.run_dir) / "metrics.jsonl")
        if "checkpoint/saved_at" in r
    }
    # One attempt to upload takes about 5 s (botocore's retries), and blocked each save before.
    assert saved[3] - saved[1] < 4.0, saved
    assert took < 15.0
    uploads = [e for e in read_events(Path(cfg.run_dir) / "events.jsonl") if "upload" in e]
    assert {(e["step"], e["upload"]) for e in uploads} == {
        (1, "unfinished"), (2, "skipped"), (3, "unfinished"),
    }  # fmt: skip
    assert Path(cfg.run_dir, "model").is_dir()
