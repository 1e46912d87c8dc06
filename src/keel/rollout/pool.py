"""Several vLLM engines behind a router (`rollout.vllm.engines` > 1, or
`rollout.vllm.tensor_parallel_size` > 1): an `EnginePool` is a `RolloutEngine` whose engines
each run a `VLLMRolloutEngine` in an OS process of their own.

Processes. Each engine is a child started with multiprocessing's `spawn` and one pipe
(`engine_main`, keel.rollout.pool_process), which serves the pool's requests in order: a method
name and its arguments in, the result (or the exception) out. On a CPU each engine is pinned to
its own cores (`os.sched_setaffinity` of the child itself, and vLLM's
`VLLM_CPU_OMP_THREADS_BIND` in its environment: engine i takes the i-th share of the cores the
parent may run on; cores are shared only when there are fewer than engines ×
tensor_parallel_size). No engine outlives the pool: a child checks its parent every `WATCH_S`
and exits when it is gone (a parent killed by SIGKILL included), `close()` asks each to shut
vLLM down and joins it, then kills what is left, and a pool collected or left unclosed at the
interpreter's exit kills its engines. With `tensor_parallel_size` > 1 vLLM starts its own worker
processes inside the child (its multiprocessing executor; on a CPU each rank gets its own share
of the engine's cores).

Generation. `generate_ids` draws one sampling seed per row in this process (as the single
engine does: from torch's generator), asks the router (`keel.rollout.router`) which engine
serves which prompt (a prompt's n rows together; a prompt that extends an earlier one, e.g.
an episode's next turn, on that prompt's engine), and runs every engine's share at once
(`VLLMRolloutEngine.generate_rows` with the rows' own seeds, so a row samples the same tokens
whichever engine serves it). Pushes and generation never overlap (one lock).

Weights. A push is broadcast: `begin_weight_update`, each bucket (`load_weight_bucket`)
sent to every live engine as it arrives, `finish_weight_update(version)`, each returning
once every live engine has answered; `finish_weight_update` checks that every engine reports
the pushed version, so no engine generates with older weights once a push has returned. A
bucket crosses the pipe as raw bytes (`pack_bucket`, keel.rollout.pool_pipe: one copy of the
bucket in this process, the tensors rebuilt in the child over one buffer of the bucket's size,
which the engine's layerwise reload copies from). `update_weights(state, version)` streams the state
in buckets of `BUCKET_BYTES`.

Failure. An engine whose process dies (its pipe closes) leaves the router, and the rows it
was generating are generated again on the live engines (with their seeds: the same tokens);
a push goes on to the engines left. A fresh process is started in its place at once: it
joins the next push (waited for at its start) and takes that push in full before the router
gives it anything (while no push has happened yet, the folder's weights are current and it
takes requests once started). `rollout/engine_failures`, `rollout/engines_replaced`,
`rollout/engines_live`. Only when no engine can serve a call (every one dead, their
replacements still without weights) does the pool raise `EnginesLostError`, which the rollout
worker reports as a lost worker (the run's group restart).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from keel.config.loading import ConfigError
from keel.data.examples import Example
from keel.rollout.pool_pipe import (
    EngineDied,
    EngineHandle,
    kill_engine,
    kill_engines,
    pack_bucket,
    read_answer,
    send_request,
)
from keel.rollout.pool_process import engine_cores, engine_gpus, engine_main
from keel.rollout.protocol import Completions, Decoder, SamplingParams
from keel.rollout.responses import generate_examples
from keel.rollout.router import Router
from keel.types import Batch, Tokenizer

if TYPE_CHECKING:
    from keel.config.schema import RolloutConfig
    from keel.rollout.protocol import EngineInputs

BUCKET_BYTES = 64 * 2**20  # update_weights(state): the state streamed in buckets of this size
START_TIMEOUT_S = 600.0  # for an engine to start (vLLM's import and build)
CLOSE_TIMEOUT_S = 30.0  # for an engine to shut down before it is killed


class EnginesLostError(RuntimeError):
    """Every engine of the pool died: nothing is left to generate with."""


def _no_copy() -> torch.nn.Module:
    raise RuntimeError("a vLLM engine of a pool loads its own weights")


class EnginePool:
    """A `RolloutEngine` over several vLLM engines in processes of their own (module
    docstring). Built by `EnginePool.build`; `metrics()` are its per-engine figures
    (rollout/engine{i}/...), `rollout/engine_failures` and `rollout/engines_live`."""

    shares_module = False
    step_hook = None  # an interruptible rollout's hook is not called: rows finish as begun

    def __init__(
        self,
        handles: list[EngineHandle],
        tokenizer: Tokenizer,
        *,
        eos_ids: Sequence[int],
        pad_id: int,
        chat: bool,
        max_prompt_length: int,
        truncation: str,
        target: tuple[str, str],
        max_model_len: int | None,
    ):
        self.handles = handles
        self.tokenizer = tokenizer
        self.eos_ids = tuple(eos_ids)
        self.pad_id = pad_id
        self.chat = chat
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self.max_model_len = max_model_len
        self._target = target
        self.router = Router(len(handles))
        self.weight_version = 0
        self.failures = 0
        self.replaced = 0  # engines started in place of dead ones
        self._spawn: Callable[[int], EngineHandle] | None = None  # build's: replaces the dead
        self._pushed = False  # a push has happened (else the folder's weights are current)
        self._lock = threading.Lock()  # generation and pushes, one at a time
        self._updating = False
        self._closed = False
        self._executor = ThreadPoolExecutor(len(handles), thread_name_prefix="keel-engine-pool")
        # the engines are killed when the pool is collected or the interpreter exits unclosed
        self._finalizer = weakref.finalize(self, kill_engines, handles)

    @classmethod
    def build(cls, rollout: RolloutConfig, inputs: EngineInputs) -> EnginePool:
        """Start `rollout.vllm.engines` engines (at once: their starts overlap), each a
        `VLLMRolloutEngine` of `rollout` with one engine, in a process of its own."""
        from keel.data.encoding import stop_ids
        from keel.models.eos import eos_token_ids
        from keel.rollout.responses import pad_token_id
        from keel.rollout.vllm_process import (
            SimpleGenerationConfig,
            check_head_size,
            import_vllm,
        )

        check_head_size(inputs.model_path)
        import_vllm()  # a missing vLLM is a ConfigError here, not in every child
        cfg = rollout.vllm
        one = rollout.model_copy(update={"vllm": cfg.model_copy(update={"engines": 1})})
        child_inputs = dataclasses.replace(inputs, actor_module=None, load_copy=_no_copy)
        allowed = sorted(os.sched_getaffinity(0)) if inputs.device.type == "cpu" else None
        context = multiprocessing.get_context("spawn")
        tp = cfg.tensor_parallel_size
        gpus = engine_gpus(cfg.engines, tp) if inputs.device.type == "cuda" else None

        def spawn(i: int) -> EngineHandle:
            """Start engine i's process (its cores or GPUs as at the start)."""
            ranks = None if allowed is None else engine_cores(i, cfg.engines, tp, allowed)
            visible = None if gpus is None else gpus[i]
            mine, theirs = context.Pipe()
            process = context.Process(
                target=engine_main,
                args=(theirs, one, child_inputs, ranks, visible, os.getpid()),
                name=f"keel-vllm-engine-{i}",
                daemon=True,  # ended at this interpreter's exit (engine_main: its own)
            )
            process.start()
            theirs.close()
            return EngineHandle(i, process, mine)

        handles: list[EngineHandle] = []
        try:
            for i in range(cfg.engines):
                handles.append(spawn(i))
            facts = [read_answer(h, START_TIMEOUT_S) for h in handles]
        except BaseException:
            for h in handles:
                kill_engine(h)
            raise
        generation = SimpleGenerationConfig.from_folder(inputs.model_path)
        eos = stop_ids(
            eos_token_ids(generation, inputs.tokenizer),
            inputs.tokenizer,
            inputs.chat if inputs.stop_on_turn_end is None else inputs.stop_on_turn_end,
        )
        pool = cls(
            handles,
            inputs.tokenizer,
            eos_ids=eos,
            pad_id=pad_token_id(inputs.tokenizer, eos),
            chat=inputs.chat,
            max_prompt_length=inputs.max_prompt_length,
            truncation=inputs.truncation,
            target=tuple(facts[0]["target"]),
            max_model_len=facts[0]["max_model_len"],
        )
        pool._spawn = spawn
        return pool

    # -- the RolloutEngine surface ---------------------------------------------------------

    @property
    def interruptible(self) -> bool:
        """No: the engines' step loops are in other processes (rows finish as they began)."""
        return False

    @property
    def live(self) -> list[int]:
        """The indices of the engines still alive."""
        return [h.index for h in self.handles if h.alive and h.routed]

    def pids(self) -> list[int | None]:
        """Each engine's process id (engine i at i)."""
        return [h.process.pid for h in self.handles]

    def generate(
        self, examples: Sequence[Example], sampling: SamplingParams, group_offset: int = 0
    ) -> Batch:
        return generate_examples(self, examples, sampling, group_offset)

    def generate_ids(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> Completions:
        """Each prompt's n rows on the engine the router picks (module docstring); the rows of
        an engine that dies are generated again on the engines left."""
        self._check_open()
        prompts = [list(p) for p in prompt_ids]
        n = sampling.n
        longest = max((len(p) for p in prompts), default=0)
        limit = self.max_model_len
        if limit is not None and longest + sampling.max_new_tokens > limit:
            raise ValueError(
                f"a prompt of {longest} tokens + max_new_tokens {sampling.max_new_tokens} exceed "
                f"the vLLM engines' max_model_len {limit} (rollout.vllm.max_model_len)"
            )
        # the seeds the single engine would draw (VLLMRolloutEngine.generate_ids)
        base = int(torch.randint(0, 2**31 - 1 - len(prompts) * n, ()).item())
        one = dataclasses.replace(sampling, n=1)
        done: dict[int, Completions] = {}  # prompt index → its n rows
        with self._lock:
            if not self._pushed:  # the folder's weights are current: a ready one joins now
                self._admit(wait=False)
            pending = list(range(len(prompts)))
            while pending:
                try:
                    plan = self.router.assign([prompts[i] for i in pending], n,
                                              sampling.max_new_tokens)  # fmt: skip
                except RuntimeError as e:
                    raise EnginesLostError(
                        "every vLLM engine of the pool died (rollout.vllm.engines)"
                    ) from e
                shares = {e: [pending[j] for j in local] for e, local in plan.items()}
                jobs = {
                    e: self._executor.submit(self._generate_share, e, prompts, share, n, one, base)
                    for e, share in shares.items()
                }
                retry: list[int] = []
                for e, job in jobs.items():
                    try:
                        done.update(job.result())
                    except EngineDied:
                        self._lose(e)
                        retry.extend(shares[e])
                    finally:
                        self.router.done(e, [prompts[i] for i in shares[e]], n,
                                         sampling.max_new_tokens)  # fmt: skip
                pending = sorted(retry)
        ordered = [done[i] for i in range(len(prompts))]
        return Completions(
            token_ids=[t for c in ordered for t in c.token_ids],
            logprobs=[lp for c in ordered for lp in (c.logprobs or [])],
            finish_reasons=[f for c in ordered for f in c.finish_reasons],
        )

    def _generate_share(
        self,
        engine: int,
        prompts: list[list[int]],
        share: list[int],
        n: int,
        sampling: SamplingParams,
        base: int,
    ) -> dict[int, Completions]:
        rows = [prompts[i] for i in share for _ in range(n)]
        seeds = [base + i * n + j for i in share for j in range(n)]
        handle = self.handles[engine]
        start = time.perf_counter()
        out: Completions = self._call(handle, "generate_rows", rows, sampling, seeds)
        handle.busy_s += time.perf_counter() - start
        handle.requests += len(rows)
        handle.tokens += sum(len(t) for t in out.token_ids)
        handle.queue_max = max(handle.queue_max, len(rows))
        logps = out.logprobs or [[] for _ in rows]
        return {
            i: Completions(
                out.token_ids[k * n : (k + 1) * n],
                logps[k * n : (k + 1) * n],
                out.finish_reasons[k * n : (k + 1) * n],
            )
            for k, i in enumerate(share)
        }

    def update_weights(self, state: Mapping[str, torch.Tensor], version: int) -> None:
        """The full state, streamed to every engine in buckets of BUCKET_BYTES."""
        self.begin_weight_update()
        try:
            bucket: list[tuple[str, torch.Tensor]] = []
            size = 0
            for name, tensor in state.items():
                bucket.append((name, tensor))
                size += tensor.numel() * tensor.element_size()
                if size >= BUCKET_BYTES:
                    self.load_weight_bucket(bucket)
                    bucket, size = [], 0
            if bucket:
                self.load_weight_bucket(bucket)
        except BaseException:
            self._end_update()
            raise
        self.finish_weight_update(version)

    def begin_weight_update(self) -> None:
        """Open a streamed update on every live engine (generation waits until it is done)."""
        self._check_open()
        self._lock.acquire()
        self._updating = True
        try:
            self._admit(wait=True)  # replacements take this push in full, then requests
            self._broadcast("begin_weight_update")
        except BaseException:
            self._end_update()
            raise

    def load_weight_bucket(self, weights: Sequence[tuple[str, torch.Tensor]]) -> None:
        """One bucket to every live engine: packed once, its bytes sent down each pipe."""
        if not self._updating:
            raise RuntimeError("load_weight_bucket before begin_weight_update")
        header, payload = pack_bucket(weights)
        try:
            self._broadcast("bucket", header, payload=payload)
        except BaseException:
            self._end_update()
            raise

    def finish_weight_update(self, version: int) -> None:
        """Close the update on every live engine; each must report `version`."""
        if not self._updating:
            raise RuntimeError("finish_weight_update before begin_weight_update")
        try:
            self._check_versions(self._broadcast("finish_weight_update", int(version)), version)
            self._pushed = True
            for h in self.handles:
                if h.alive and not h.routed:  # a replacement, now at the pushed version
                    h.routed = True
                    self.router.live.add(h.index)
        finally:
            self._end_update()

    def load_adapter(self, adapter: Any, version: int) -> None:
        """A LoRA actor's adapter (keel.rollout.protocol.AdapterEngine) to every live engine;
        each must then report `version`."""
        self._check_versions(self._forward("load_adapter", adapter, int(version)), version)

    def adapters(self) -> set[int]:
        """The LoRA adapter ids the engines hold (their union)."""
        return set().union(*self._forward("adapters").values())

    def adapter_refusal(self, config: Mapping[str, Any]) -> str | None:
        """Why the engines cannot apply a LoRA adapter of `config` (the first engine's
        reason), None when every one can."""
        refusals = self._forward("adapter_refusal", dict(config))
        return next((r for r in refusals.values() if r is not None), None)

    def engine_versions(self) -> dict[int, int]:
        """{engine: the weight version it holds} over the live engines (asked of each)."""
        return self._forward("weight_version")

    def peak_rss_kib(self, reset: bool = False) -> dict[int, tuple[int, int]]:
        """{engine: (its process's resident memory, its peak since the last reset) in KiB}
        (Linux); `reset` starts a new peak at the current size (bench/engine_pool.py measures
        a streamed push's receiving side with it)."""
        return self._forward("peak_rss_kib", bool(reset))

    def decoder(self) -> Decoder:
        """No step API across processes: a ConfigError naming the key."""
        raise ConfigError(
            "rollout.vllm.engines > 1 (or tensor_parallel_size > 1) runs the engines in other "
            "processes, which have no Decoder (keel serve's continuous batching, the step API): "
            "set rollout.vllm.engines: 1 and tensor_parallel_size: 1 for that"
        )

    def sleep(self) -> None:
        self._forward("sleep")

    def wake(self) -> None:
        self._forward("wake")

    def metrics(self) -> dict[str, float]:
        """Per engine since the last call: rows served (`requests`), tokens generated,
        tokens/s while generating, the most rows it held at once (`queue_max`); then the
        engines lost since the start (`rollout/engine_failures`) and alive now."""
        out: dict[str, float] = {}
        for h in self.handles:
            key = f"rollout/engine{h.index}"
            out[f"{key}/requests"] = float(h.requests)
            out[f"{key}/tokens"] = float(h.tokens)
            out[f"{key}/tokens_per_s"] = h.tokens / h.busy_s if h.busy_s > 0 else 0.0
            out[f"{key}/queue_max"] = float(h.queue_max)
            h.requests, h.tokens, h.busy_s, h.queue_max = 0, 0, 0.0, 0
        out["rollout/engine_failures"] = float(self.failures)
        out["rollout/engines_replaced"] = float(self.replaced)
        out["rollout/engines_live"] = float(len(self.live))
        return out

    def weight_target(self) -> tuple[str, str]:
        """(dtype, device type) of the engines' weights: what a collective push sends."""
        return self._target

    def close(self) -> None:
        """Shut every engine down and join its process (killed past CLOSE_TIMEOUT_S);
        idempotent."""
        if self._closed:
            return
        self._closed = True
        for h in self.handles:
            if h.alive:
                with contextlib.suppress(Exception):
                    h.conn.send(("close", ()))
            else:  # a replacement still starting
                kill_engine(h)
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for h in self.handles:
            h.process.join(max(0.0, deadline - time.monotonic()))
            kill_engine(h)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._finalizer.detach()

    # -- helpers ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this vLLM engine pool is closed")

    def _forward(self, op: str, *args: Any) -> dict[int, Any]:
        """The engines' method `op` called with `args` on every live engine, between
        generations and pushes: {engine: its result} (`_broadcast`)."""
        self._check_open()
        with self._lock:
            return self._broadcast(op, *args)

    def _check_versions(self, held: Mapping[int, Any], version: int) -> None:
        """Every engine that answered holds `version`, which the pool then reports."""
        wrong = {e: v for e, v in held.items() if v != int(version)}
        if wrong:
            raise RuntimeError(
                f"engines of the pool hold other weight versions ({wrong}, engine: version) "
                f"than the pushed {version}"
            )
        self.weight_version = int(version)

    def _end_update(self) -> None:
        if self._updating:
            self._updating = False
            self._lock.release()

    def _call(self, handle: EngineHandle, op: str, *args: Any) -> Any:
        """One request to one engine and its answer (EngineDied when its process is gone)."""
        with handle.lock:
            send_request(handle, op, args)
            return read_answer(handle)

    def _broadcast(
        self, op: str, *args: Any, payload: torch.Tensor | None = None
    ) -> dict[int, Any]:
        """`op(*args)` on every live engine (sent to all, then every answer awaited): {engine:
        result}. An engine that died is lost (`_lose`); EnginesLostError when none is alive;
        an engine's own error is raised once every engine has answered."""
        sent: list[EngineHandle] = []
        for h in [h for h in self.handles if h.alive]:
            h.lock.acquire()
            try:
                send_request(h, op, args, payload)
                sent.append(h)
            except EngineDied:
                h.lock.release()
                self._lose(h.index)
            except BaseException:
                h.lock.release()
                for other in sent:  # their answers are never read: the pipes are out of step
                    self._lose(other.index)
                    other.lock.release()
                raise
        results: dict[int, Any] = {}
        error: BaseException | None = None
        for h in sent:
            try:
                results[h.index] = read_answer(h)
            except EngineDied:
                self._lose(h.index)
            except Exception as e:
                error = error or e
            finally:
                h.lock.release()
        if error is not None:
            raise error
        if not any(h.alive for h in self.handles):
            raise EnginesLostError("every vLLM engine of the pool died (rollout.vllm.engines)")
        return results

    def _lose(self, engine: int) -> None:
        """Engine `engine` died: out of the router, its process reaped, and a fresh one
        started in its place, which takes the next push in full before any request."""
        handle = self.handles[engine]
        if handle.alive:
            handle.alive = False
            self.failures += 1
            self.router.drop(engine)
            kill_engine(handle)
            if self._spawn is not None and not self._closed:
                fresh = self._spawn(engine)
                fresh.alive, fresh.joining, fresh.routed = False, True, False
                self.handles[engine] = fresh  # in place: the finalizer's list
                self.replaced += 1

    def _admit(self, *, wait: bool) -> None:
        """Replacements whose engine has started join the broadcasts (`wait`: each is waited
        for, up to START_TIMEOUT_S; else only those already started); one that failed to
        start is dropped. They take requests once a push has reached them (`finish_weight_
        update`), or at once while no push has happened (the folder's weights are current)."""
        for h in self.handles:
            if not h.joining or (not wait and not h.conn.poll(0)):
                continue
            h.joining = False
            try:
                read_answer(h, START_TIMEOUT_S)
            except Exception:  # it did not start: the pool goes on without it
                kill_engine(h)
                continue
            h.alive = True
            if not self._pushed:
                h.routed = True
                self.router.live.add(h.index)


__all__ = [
    "BUCKET_BYTES",
    "EnginePool",
    "EnginesLostError",
]
