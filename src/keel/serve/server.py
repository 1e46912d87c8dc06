"""Running `keel serve`: resolve MODEL, load the policy (or with `--reward` the reward model),
start uvicorn (optionally with TLS and `--follow`) and with `--grpc-port` the gRPC server on the
same batching queue, and on SIGTERM/SIGINT stop accepting connections on both, let in-flight
requests finish (at most serve.drain_timeout_s), drain the batching queue, and exit 0."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import uvicorn

from keel.checkpoint.policy import PolicySource, newest_healthy_checkpoint, resolve_policy
from keel.config.loading import ConfigError
from keel.models import resolve_model_path
from keel.serve.app import build_app
from keel.serve.config import ServeFileConfig
from keel.serve.follow import CheckpointFollower
from keel.serve.policy import ServedPolicy, read_weights
from keel.serve.scoring import ServedReward
from keel.serve.served import Served

if TYPE_CHECKING:
    import grpc  # the gRPC server is started only with --grpc-port (keel.serve.grpc_server)

BUILTIN = "builtin:"
log = logging.getLogger(__name__)


def policy_source(model: str, follow: bool) -> PolicySource:
    """MODEL → the folder to serve: `builtin:NAME`, an HF folder, a checkpoint or a run
    directory (keel.checkpoint.policy). With --follow, a run's newest healthy checkpoint (not
    its exported model/), so that newer checkpoints can follow it."""
    if model.startswith(BUILTIN):
        if follow:
            raise ConfigError(f"--follow needs a run directory, not {model}")
        return PolicySource(resolve_model_path(model))
    source = resolve_policy(model)
    if not follow:
        return source
    if source.run_dir is None:
        raise ConfigError(f"--follow needs a run directory (or a checkpoint of one): {model}")
    return newest_healthy_checkpoint(source.run_dir) or source


def model_name(model: str, cfg: ServeFileConfig) -> str:
    """serve.model_name, else MODEL's last path component (`tiny` for builtin:tiny)."""
    if cfg.serve.model_name:
        return cfg.serve.model_name
    if model.startswith(BUILTIN):
        return model.removeprefix(BUILTIN)
    return Path(model).expanduser().resolve().name


class TLSFiles(TypedDict, total=False):
    """uvicorn.Config's ssl options: both or neither."""

    ssl_certfile: str
    ssl_keyfile: str


def check_tls(cfg: ServeFileConfig) -> TLSFiles:
    """uvicorn's ssl options; the files must exist."""
    s = cfg.serve
    if s.tls_certfile is None or s.tls_keyfile is None:
        return {}
    for key, path in (("serve.tls_certfile", s.tls_certfile), ("serve.tls_keyfile", s.tls_keyfile)):
        if not Path(path).is_file():
            raise ConfigError(f"{key}: no such file: {path}")
    return {"ssl_certfile": s.tls_certfile, "ssl_keyfile": s.tls_keyfile}


class DrainingServer(uvicorn.Server):
    """uvicorn's server that marks the model draining (/readyz 503) and stops the gRPC server
    (new calls refused, running ones finish) as shutdown begins, says where it listens once it
    does, and exits 0 after a graceful SIGTERM instead of re-raising the signal."""

    def __init__(
        self, config: uvicorn.Config, policy: Served, grpc_server: grpc.Server | None = None
    ):
        super().__init__(config)
        self.policy = policy
        self.grpc_server = grpc_server

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        for server in self.servers:
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                scheme = "https" if self.config.ssl_certfile else "http"
                step = self.policy.step
                what = f"step {step}" if step is not None else "not a checkpoint"
                print(f"keel serve: {self.policy.name} ({what}) on {scheme}://{host}:{port}",
                      file=sys.stderr, flush=True)  # fmt: skip

    async def shutdown(self, sockets: list | None = None) -> None:  # type: ignore[override]
        self.policy.draining = True
        grace = self.config.timeout_graceful_shutdown
        stopped = self.grpc_server.stop(grace) if self.grpc_server is not None else None
        await super().shutdown(sockets)
        if stopped is not None:  # the batching queue closes after both sides have drained
            await asyncio.to_thread(stopped.wait, grace)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()  # handled: drained, exit normally


def serve(
    model: str | None,
    cfg: ServeFileConfig,
    *,
    host: str,
    port: int,
    follow: bool,
    reward: bool = False,
    grpc_port: int = 0,
) -> int:
    """Serve MODEL (with `reward`, a reward model behind /v1/score) until SIGTERM/SIGINT, over
    HTTP and, with grpc_port > 0, gRPC; 0 after a graceful drain."""
    tls = check_tls(cfg)
    if model is None:
        raise ConfigError("keel serve needs MODEL")
    if reward and follow:
        raise ConfigError("--follow serves a policy as it trains; not with --reward")
    sys.setswitchinterval(cfg.serve.switch_interval_ms / 1000)
    source = policy_source(model, follow)
    name = model_name(model, cfg)
    served: Served = ServedReward(source, cfg, name) if reward else ServedPolicy(source, cfg, name)
    app = build_app(served, cfg.serve)
    grpc_server = None
    follower = None
    try:
        if grpc_port:
            from keel.serve.grpc_server import start_grpc

            grpc_server = start_grpc(served, cfg.serve, host, grpc_port)
        if follow:
            assert source.run_dir is not None and isinstance(served, ServedPolicy)
            follower = CheckpointFollower(
                source.run_dir, served, lambda folder: read_weights(folder, cfg),
                cfg.serve.follow_interval_s,
            )  # fmt: skip
            follower.start()
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", access_log=False, lifespan="on",
            # uvicorn annotates int but hands it to asyncio.wait_for, which takes a float
            timeout_graceful_shutdown=cfg.serve.drain_timeout_s,  # pyright: ignore[reportArgumentType]
            **tls,
        )  # fmt: skip
        server = DrainingServer(config, served, grpc_server)
        server.run()
    finally:
        if follower is not None:
            follower.stop()
        if grpc_server is not None:
            grpc_server.stop(0)
        served.close(timeout=cfg.serve.drain_timeout_s)
    print("keel serve: stopped", file=sys.stderr, flush=True)
    return 0 if server.started else 1
