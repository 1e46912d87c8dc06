"""`keel serve` starting and stopping: HTTPS with a self-signed certificate, a graceful drain on
SIGTERM, serving a run as it trains (`--follow`), and bad MODEL arguments."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import signal
import socket
import subprocess
import threading
from pathlib import Path
from unittest.mock import ANY

import pytest

from keel.checkpoint.export import parse_model_id
from keel.cli.main import main
from tests.serve.live_server import LiveServer, wait_until


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (cryptography, else the openssl command)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither cryptography nor openssl to make a test certificate")
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
             "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
             "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
            check=True, capture_output=True,
        )  # fmt: skip
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(private.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(
        private.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert, key


def without_eos(tiny_dir: Path, folder: Path) -> Path:
    """A copy of the tiny model that never samples EOS: every answer runs to max_tokens."""
    from transformers import GenerationConfig

    shutil.copytree(tiny_dir, folder)
    gen = GenerationConfig.from_pretrained(folder)
    gen.suppress_tokens = [0, 1, 2]  # <pad>, <eos>, <unk>
    gen.save_pretrained(folder)
    return folder


def test_https_and_a_graceful_drain_on_sigterm(tiny_dir, tmp_path):
    cert, key = self_signed(tmp_path)
    model = without_eos(tiny_dir, tmp_path / "model")
    server = LiveServer(
        model, "--set", f"serve.tls_certfile={cert}", "--set", f"serve.tls_keyfile={key}",
        "--set", "serve.max_new_tokens=400", log=tmp_path / "serve.log", cafile=cert,
    )  # fmt: skip
    try:
        _drain_on_sigterm(server)
    finally:
        server.stop(signal.SIGKILL)  # a failed check leaves no server running


def _drain_on_sigterm(server: LiveServer) -> None:
    assert server.base_url.startswith("https://")
    assert server.request("GET", "/healthz") == (200, {"status": "ok"})
    body = {"model": "model", "prompt": "1+1=", "max_tokens": 300}
    answers: list[tuple[int, dict]] = []
    threads = [
        threading.Thread(
            target=lambda: answers.append(server.request("POST", "/v1/completions", body))
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    in_flight = "keel_serve_requests_in_flight"
    wait_until(lambda: server.metric(in_flight) >= 3, "3 requests in flight")
    server.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: refuses(server.port), "the draining server to stop accepting")
    for t in threads:
        t.join(60)
    assert server.proc.wait(60) == 0, server.text()
    assert [status for status, _ in answers] == [200, 200, 200]
    assert all(a["usage"]["completion_tokens"] == 300 for _, a in answers)
    assert "keel serve: stopped" in server.text()


def test_follow_serves_each_new_checkpoint_without_dropping_requests(tiny_grpo, tmp_path):
    from keel.checkpoint.policy import newest_healthy_checkpoint
    from keel.controller import run_training
    from keel.controller.outcome import RunPreempted

    cfg = tiny_grpo("train.steps=2", "checkpoint.save_steps=1", "checkpoint.keep=3")
    with pytest.raises(RunPreempted):
        run_training(cfg, stop_after=1)  # step 1 is checkpointed, the run is still going
    run_dir = Path(cfg.run_dir)
    server = LiveServer(
        run_dir, "--follow", "--set", "serve.follow_interval_s=0.2", log=tmp_path / "serve.log"
    )
    try:
        assert models(server)["step"] == 1
        first = versioned_id(server, step=1)
        body = {"model": first, "prompt": "1", "max_tokens": 1}  # the versioned id serves too
        assert server.request("POST", "/v1/completions", body)[0] == 200
        statuses, stop = [], threading.Event()

        def load() -> None:
            while not stop.is_set():
                body = {"model": "run", "prompt": "1+1=", "max_tokens": 4}
                statuses.append(server.request("POST", "/v1/completions", body)[0])

        loader = threading.Thread(target=load)
        loader.start()
        run_training(cfg)  # resumes from step 1 and trains step 2
        wait_until(lambda: models(server)["step"] == 2, "the server to follow step 2")
        answered = len(statuses)
        wait_until(lambda: len(statuses) > answered, "a request answered after the swap")
        stop.set()
        loader.join(30)
        assert models(server)["step"] == 2, server.text()
        assert statuses and set(statuses) == {200}
        # root names the checkpoint served now, as an absolute path; so does keel_serve_info
        newest = newest_healthy_checkpoint(run_dir)
        assert newest is not None and newest.step == 2
        assert models(server)["root"] == str(newest.folder.resolve())
        assert server.metric(f'keel_serve_info{{folder="{newest.folder}",model="run"}}') == 1
        assert server.metric("keel_serve_info") == 1  # the step-1 series is gone
        _, answer = server.request("POST", "/v1/completions", {"model": "run", "prompt": "1"})
        assert answer["system_fingerprint"] == "keel-step-2"
        assert server.metric("keel_serve_reloads_total") == 1
        assert server.metric("keel_serve_model_step") == 2
        second = versioned_id(server, step=2)
        assert second == newest.model_id and models(server)["model_id"] == second
        body = {"model": first, "prompt": "1", "max_tokens": 1}  # no longer served
        assert server.request("POST", "/v1/completions", body)[1]["error"]["code"] == (
            "model_not_found"
        )
        assert server.request("POST", "/v1/completions", {**body, "model": second})[0] == 200
    finally:
        assert server.stop() == 0, server.text()


def refuses(port: int) -> bool:
    """Whether a connection to 127.0.0.1:`port` is refused (the listening socket is closed)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except OSError:
        return True
    return False


def models(server: LiveServer) -> dict:
    status, body = server.request("GET", "/v1/models")
    assert status == 200, body
    return body["data"][0]


def versioned_id(server: LiveServer, step: int) -> str:
    """The second entry of /v1/models: the served checkpoint's versioned model id (the first
    is the model's name), for the run `run`'s lineage 1 at `step`."""
    _, body = server.request("GET", "/v1/models")
    name, versioned = (card["id"] for card in body["data"])
    assert name == "run" and body["data"][1]["step"] == step
    assert parse_model_id(versioned) == {"run": "run", "version": 1, "step": step, "stamp": ANY}
    return versioned


def test_bad_model_arguments_are_clear_errors(tmp_path, tiny_dir, capsys):
    assert main(["serve", str(tmp_path / "missing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert main(["serve", str(tiny_dir), "--follow"]) == 2
    assert "--follow needs a run directory" in capsys.readouterr().err
    assert main(["serve", str(tiny_dir), "--set", "serve.max_batch_sise=2"]) == 2
    assert "serve.max_batch_sise: unknown key" in capsys.readouterr().err
    bad_tls = [
        "--set",
        f"serve.tls_certfile={tmp_path}/c.pem",
        "--set",
        f"serve.tls_keyfile={tmp_path}/k.pem",
    ]
    assert main(["serve", str(tiny_dir), *bad_tls]) == 2
    assert "no such file" in capsys.readouterr().err
