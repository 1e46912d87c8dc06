"""Object storage round trip against a real local S3-compatible server (moto's server mode, a
subprocess on a free 127.0.0.1 port, with its KMS) through fsspec/s3fs: upload each checkpoint
and the export under their model ids, encrypted server-side, resume a new run directory from
the bucket."""

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from unittest.mock import ANY

import pytest

from keel.checkpoint.export import ADAPTER_FOLDER, export_record, parse_model_id
from keel.checkpoint.remote import (
    download_checkpoint,
    upload_checkpoint,
    upload_export,
    upload_options,
)
from keel.checkpoint.state import CheckpointError
from keel.controller import run_training
from keel.guard import read_events
from keel.monitor import read_metrics
from tests.checkpoint.test_export import lora_sft


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


def s3_client(options: dict, service: str):
    import boto3

    return boto3.client(
        service, endpoint_url=options["endpoint_url"], aws_access_key_id=options["key"],
        aws_secret_access_key=options["secret"], region_name="us-east-1",
    )  # fmt: skip


def encryption_of(s3, bucket: str, prefix: str) -> dict[str, tuple[str, str | None]]:
    """Every object under `prefix`: (ServerSideEncryption, SSEKMSKeyId) as S3 reports them."""
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]]
    heads = {key: s3.head_object(Bucket=bucket, Key=key) for key in keys}
    return {k: (h.get("ServerSideEncryption"), h.get("SSEKMSKeyId")) for k, h in heads.items()}


def test_upload_and_resume_from_s3(tiny_grpo, tmp_path, s3_server):
    """SSE-KMS uploads under versioned names: every object of the checkpoint and of the
    exported policy (and each `latest`) is encrypted with the run's KMS key, as S3 reports it;
    the remote folders are named by their model ids; --resume from the bucket still works."""
    import s3fs

    key_id = s3_client(s3_server, "kms").create_key()["KeyMetadata"]["KeyId"]
    cfg = tiny_grpo(
        "train.steps=2", "checkpoint.save_steps=2", "checkpoint.upload_to=s3://keel-ckpt/run1",
        f"checkpoint.upload_encryption={{type: 'aws:kms', kms_key_id: {key_id}}}",
    )  # fmt: skip
    cfg.checkpoint.storage_options = s3_server
    result = run_training(cfg)
    fs = s3fs.S3FileSystem(**s3_server)
    local = Path(cfg.run_dir) / "checkpoints" / "step_000002"
    model_id = json.loads((local / "meta.json").read_text())["model_id"]
    assert parse_model_id(model_id) == {"run": "run", "version": 1, "step": 2, "stamp": ANY}
    assert fs.cat_file("keel-ckpt/run1/latest").decode().strip() == model_id
    remote = f"keel-ckpt/run1/{model_id}"
    assert fs.exists(f"{remote}/COMPLETE")
    assert (
        fs.cat_file(f"{remote}/actor/model.safetensors")
        == (local / "actor" / "model.safetensors").read_bytes()
    )
    exported = export_record(result.model_dir)
    assert exported["model_id"].startswith("run-v1-s2-") and exported["run_version"] == 1
    assert fs.cat_file("keel-ckpt/run1/models/latest").decode().strip() == exported["model_id"]
    assert json.loads(fs.cat_file(f"keel-ckpt/run1/models/{exported['model_id']}/"
                                  "keel_export.json")) == exported  # fmt: skip
    urls = [e.get("url", "") for e in read_events(Path(cfg.run_dir) / "events.jsonl")]
    assert any(u.endswith(model_id) for u in urls)
    assert any(u.endswith(f"models/{exported['model_id']}") for u in urls)
    encrypted = encryption_of(s3_client(s3_server, "s3"), "keel-ckpt", "run1/")
    assert len(encrypted) > 10 and f"run1/{model_id}/meta.json" in encrypted
    assert f"run1/models/{exported['model_id']}/model.safetensors" in encrypted
    assert {sse for sse, _ in encrypted.values()} == {"aws:kms"}
    assert all(kms is not None and kms.endswith(key_id) for _, kms in encrypted.values())

    other = cfg.model_copy(deep=True)
    other.run_dir = str(tmp_path / "elsewhere")
    other.train.steps = 3
    result = run_training(other, resume="s3://keel-ckpt/run1")
    assert result.resumed_from == 2
    fetched = Path(other.run_dir) / "checkpoints" / "step_000002" / "actor" / "model.safetensors"
    assert fetched.read_bytes() == (local / "actor" / "model.safetensors").read_bytes()


def test_aes256_uploads_and_older_layouts(tiny_grpo, tmp_path, s3_server):
    """SSE-S3 (AES256) on every object; a bucket in the layout uploads had before model ids
    (URL/step_NNNNNN/, `latest` naming it) still resumes, into checkpoints/step_NNNNNN."""
    import s3fs

    cfg = tiny_grpo("train.steps=1", "checkpoint.save_steps=1")
    run_training(cfg)
    local = Path(cfg.run_dir) / "checkpoints" / "step_000001"
    options = upload_options("s3://keel-ckpt/aes", s3_server, {"type": "AES256"})
    url = upload_checkpoint(local, "s3://keel-ckpt/aes", options)
    assert url == f"s3://keel-ckpt/aes/{json.loads((local / 'meta.json').read_text())['model_id']}"
    encrypted = encryption_of(s3_client(s3_server, "s3"), "keel-ckpt", "aes/")
    assert len(encrypted) > 10 and set(encrypted.values()) == {("AES256", None)}

    fs = s3fs.S3FileSystem(**s3_server)  # as uploads were written before model ids
    fs.put(str(local), "keel-ckpt/old/step_000001", recursive=True)
    fs.pipe_file("keel-ckpt/old/latest", b"step_000001\n")
    fetched = download_checkpoint("s3://keel-ckpt/old", tmp_path / "ckpts", s3_server)
    assert fetched == tmp_path / "ckpts" / "step_000001"
    assert (fetched / "actor" / "model.safetensors").read_bytes() == (
        local / "actor" / "model.safetensors"
    ).read_bytes()


def test_a_lora_runs_adapter_is_uploaded_in_its_export(tiny_dir, tmp_path, s3_server):
    """A LoRA run's RUN_DIR/adapter goes up inside its export's folder
    (URL/models/<model id>/adapter/), encrypted like every other object, before the export
    record; an adapter folder without peft's config is refused before anything is written."""
    import s3fs

    run_dir = tmp_path / "run"
    cfg = lora_sft(
        tiny_dir, run_dir, "train.steps=1", "checkpoint.upload_to=s3://keel-ckpt/lora",
        "checkpoint.upload_encryption={type: AES256}",
    )  # fmt: skip
    cfg.checkpoint.storage_options = s3_server
    result = run_training(cfg)
    model_id = export_record(result.model_dir)["model_id"]
    fs = s3fs.S3FileSystem(**s3_server)
    remote = f"keel-ckpt/lora/models/{model_id}"
    assert fs.cat_file("keel-ckpt/lora/models/latest").decode().strip() == model_id
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (
            fs.cat_file(f"{remote}/adapter/{name}")
            == (run_dir / ADAPTER_FOLDER / name).read_bytes()
        )
    assert (
        fs.cat_file(f"{remote}/model.safetensors")
        == (result.model_dir / "model.safetensors").read_bytes()
    )
    encrypted = encryption_of(s3_client(s3_server, "s3"), "keel-ckpt", "lora/")
    assert f"lora/models/{model_id}/adapter/adapter_model.safetensors" in encrypted
    assert f"lora/models/{model_id}/keel_export.json" in encrypted
    assert set(encrypted.values()) == {("AES256", None)}

    options = upload_options("s3://keel-ckpt/bad", s3_server, {"type": "AES256"})
    with pytest.raises(CheckpointError, match=r"no adapter_config\.json"):
        upload_export(result.model_dir, "s3://keel-ckpt/bad", options, tmp_path)
    assert not fs.exists("keel-ckpt/bad")


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
