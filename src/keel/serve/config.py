"""The typed configuration of `keel serve`: the `serve` section (limits, batching, auth, TLS),
the rollout engine's options reused from a run's `rollout` section, and the few `models` /
`resources` keys that say how the policy is loaded. Read from `--config serve.yaml`, then
`--set serve.x=y` overrides; unknown keys are errors naming the key."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator
from pydantic_core import ErrorDetails

from keel.config.loading import ConfigError, parse_override, read_yaml, set_path
from keel.config.schema import RolloutConfig
from keel.config.section import Section

API_KEY_ENV = "KEEL_API_KEY"


class ServeConfig(Section):
    """How `keel serve` batches, limits and protects requests."""

    model_name: str | None = Field(
        default=None,
        description="the model id in /v1/models and requests; default: MODEL's folder name",
    )
    max_batch_size: int = Field(
        default=64,
        ge=1,
        description="most rows (prompts × n) in one generate call (continuous: rows decoding at "
        "once); also one request's",
    )
    max_wait_ms: float = Field(
        default=5.0,
        ge=0,
        description="serve.batching=batch: longest a request waits for others to share its "
        "generate call",
    )
    batching: Literal["continuous", "batch"] | None = Field(
        default=None,
        description="continuous: requests join and leave the running decode batch per token "
        "(an engine with a step API: HF, vLLM); batch: one generate call per batch of "
        "requests; null: continuous where the engine can",
    )
    max_prompt_tokens: int = Field(default=512, ge=1, description="longest prompt, in tokens")
    max_new_tokens: int = Field(
        default=256, ge=1, description="largest max_tokens a request may ask"
    )
    max_body_bytes: int = Field(default=1 << 20, ge=1, description="largest request body, in bytes")
    max_pending_requests: int = Field(
        default=1024, ge=1, description="requests queued or generating; beyond it: 429"
    )
    api_key: str | None = Field(
        default=None,
        description=f"bearer token every /v1 request must carry; default: ${API_KEY_ENV}",
    )
    api_key_env: str = Field(
        default=API_KEY_ENV, description="environment variable read for api_key"
    )
    tls_certfile: str | None = Field(default=None, description="PEM certificate: serve HTTPS")
    tls_keyfile: str | None = Field(default=None, description="PEM private key of tls_certfile")
    follow_interval_s: float = Field(
        default=5.0, gt=0, description="--follow: seconds between looks for a newer checkpoint"
    )
    drain_timeout_s: float = Field(
        default=30.0, gt=0, description="SIGTERM: longest wait for in-flight requests to finish"
    )
    switch_interval_ms: float = Field(
        default=1.0,
        gt=0,
        description="Python's thread switch interval (sys.setswitchinterval): how long the "
        "generating thread may hold the GIL while requests wait to be read and answered",
    )
    torch_threads: int | None = Field(
        default=None,
        ge=1,
        description="torch intra-op threads of the generating thread; null: torch's",
    )
    apply_chat_template: bool = Field(
        default=False,
        description="--reward: text prompts go through the reward model's chat template too (as "
        "in a run with data.apply_chat_template); message lists always do",
    )
    tool_format: Literal["auto", "hermes", "llama3_json", "mistral"] = Field(
        default="auto",
        description="how the model writes tool calls (chat requests with tools), as "
        "data.tool_format; auto: the one its chat template writes",
    )
    grpc_workers: int = Field(
        default=64,
        ge=1,
        description="--grpc-port: threads answering gRPC calls (each waits on its batch)",
    )

    @model_validator(mode="after")
    def _tls_pair(self) -> ServeConfig:
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("serve.tls_certfile and serve.tls_keyfile go together: set both")
        return self

    def bearer_token(self) -> str | None:
        """serve.api_key, else the environment variable serve.api_key_env names (None: no auth)."""
        return self.api_key or os.environ.get(self.api_key_env) or None


class ServeModels(Section):
    """How the served policy is loaded (the keys of a run's `models` section that apply)."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = None


class ServeResources(Section):
    """Where the policy runs."""

    device: Literal["auto", "cpu", "cuda"] = "auto"


class ServeFileConfig(Section):
    """A serve.yaml: `serve`, `rollout` (engine options; its sampling keys are per request),
    `models` (dtype, attention kernel), `resources` (device)."""

    serve: ServeConfig = ServeConfig()
    rollout: RolloutConfig = RolloutConfig()
    models: ServeModels = ServeModels()
    resources: ServeResources = ServeResources()


def load_serve_config(path: Path | None, overrides: Iterable[str] = ()) -> ServeFileConfig:
    """serve.yaml (None: the defaults) with `--set key=value` overrides applied, validated; every
    problem is a ConfigError naming its dotted key."""
    raw = read_yaml(path) if path is not None else {}
    for item in overrides:
        key, value = parse_override(item)
        set_path(raw, key, value, source=f"--set {item}")
    try:
        return ServeFileConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [_problem(err) for err in exc.errors()]
        source = str(path) if path is not None else "serve config"
        raise ConfigError("\n".join([f"{source}: invalid serve config", *lines])) from None


def _problem(err: ErrorDetails) -> str:
    key = ".".join(str(p) for p in err["loc"])
    if err["type"] == "extra_forbidden":
        return f"  {key}: unknown key"
    msg = err["msg"].removeprefix("Value error, ")
    return f"  {key}: {msg}" if key else f"  {msg}"
