"""`keel serve MODEL`: the policy behind an OpenAI-compatible HTTP API (keel.serve), or with
`--reward` a reward model behind /v1/score; with `--grpc-port` also over gRPC.

FastAPI, uvicorn, grpcio and torch are imported when the command runs, not when the parser is
built."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """The `serve` subcommand and its options."""
    p = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API (and gRPC), or a reward "
        "model (--reward)",
    )  # fmt: skip
    p.add_argument(
        "model", metavar="MODEL",
        help="a run directory, a checkpoint (RUN_DIR/checkpoints/step_N), an HF folder, a GGUF "
        "file or builtin:NAME (with --reward: a reward model, e.g. an rm run or "
        "builtin:tiny-pref-rm)",
    )  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (8000; 0: any)")
    p.add_argument("--config", type=Path, help="serve.yaml: serve, rollout, models, resources")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE",
        help="override a serve config key, e.g. --set serve.max_batch_size=32 (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--follow", action="store_true",
        help="MODEL is a run directory: serve its newest healthy checkpoint as training "
        "publishes them",
    )  # fmt: skip
    p.add_argument(
        "--reward", action="store_true",
        help="MODEL is a reward model (a scalar-head classifier, as the rm stage trains): serve "
        "POST /v1/score, the protocol of reward.url, instead of completions",
    )  # fmt: skip
    p.add_argument(
        "--grpc-port", type=int, default=0, metavar="N",
        help="also serve gRPC (src/keel/serve/keel_serve.proto) on port N, sharing the batching "
        "queue (0: no gRPC, the default)",
    )  # fmt: skip


def serve(args: argparse.Namespace) -> int:
    from keel.serve.config import load_serve_config
    from keel.serve.server import serve as run_server

    cfg = load_serve_config(args.config, args.set)
    return run_server(
        args.model, cfg, host=args.host, port=args.port, follow=args.follow,
        reward=args.reward, grpc_port=args.grpc_port,
    )  # fmt: skip
