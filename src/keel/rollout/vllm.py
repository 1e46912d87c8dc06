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

Beside this module: vLLM's import, start-up checks and arguments, and the caller's process state
kept (`vllm_process.py`), the LoRA rules (`vllm_lora.py`), the functions run in vLLM's worker
(`vllm_worker.py`), the decoder (`vllm_decoder.py`).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from keel.data.encoding import stop_ids
from keel.data.examples import Example
from keel.models.eos import eos_token_ids
from keel.rollout.protocol import (
    AdapterWeights,
    Completions,
    RowRequest,
    SamplingParams,
    StepHook,
)
from keel.rollout.responses import cut_completions, generate_examples, pad_token_id
from keel.rollout.vllm_decoder import VLLMDecoder, chosen_logprobs
from keel.rollout.vllm_lora import (
    adapter_config_refusal,
    architecture_lora_refusal,
    lora_rank_reserved,
    lora_refusal,
)
from keel.rollout.vllm_process import (
    SimpleGenerationConfig,
    check_alone_in_process,
    check_head_size,
    eager_helpers,
    engine_args,
    engine_env,
    import_vllm,
    kept_rng,
    preserved_process_state,
    transformers_classes_kept,
)
from keel.rollout.vllm_worker import (
    begin_worker_reload,
    finish_worker_reload,
    install_row_logprobs,
    load_worker_weights,
    worker_lora_modules,
)
from keel.types import Batch, Tokenizer

if TYPE_CHECKING:
    from keel.config.schema import RolloutConfig
    from keel.rollout.protocol import EngineInputs


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
        # batching; seed is drawn from torch's generator (seeded by Keel), so a run is
        # reproducible from its seed. vLLM's sampler also draws from that generator; kept_rng
        # puts it back, so the engine moves it by the seed's draw only, as a pool of engines in
        # processes of their own does (keel.rollout.pool: the same run for 1 or N engines).
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
        with eager_helpers(self.eager), kept_rng():
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
        # Any: pyright, where vLLM is not installed, resolves `vllm` to this very module
        vllm_params: Any = VLLMSamplingParams
        return vllm_params(
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


def _shutdown_quietly(llm: Any) -> None:
    """Stop the engine core (and its child process, if any); errors at exit are swallowed."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()
