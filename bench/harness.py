"""What the GRPO benchmarks that put Keel next to TRL share (`bench.compare_trl`,
`bench.gpu_step`): a model folder whose EOS is never sampled, fixed-length prompts, one reward
function, a Keel side and a TRL side that each run one GRPO step per call, and phase clocks.

Equal work on both sides:

- The model folder's `generation_config.json` lists every EOS id in `suppress_tokens`, so HF
  `generate` never samples one (Keel's engine and TRL's both read the folder's generation
  config for what they do not pass themselves) and every response has exactly
  `max_new_tokens` tokens. The mean response length of each side is recorded to show it.
- Every prompt has the same number of tokens (char tokenizer: one token per character), so
  neither side pads.
- `digit_reward` (TRL's batched signature; Keel's `reward.signature: trl`) scores both.
- One optimizer update per step: Keel's mini-batch is the whole step and `ppo_epochs` 1; TRL's
  `per_device_train_batch_size` is the whole step, `gradient_accumulation_steps`,
  `steps_per_generation` and `num_iterations` 1. With `Workload.micro_rows` both cut the
  step into micro-batches of that many rows with gradient accumulation (Keel:
  train.micro_batch_size; TRL: per_device_train_batch_size = micro_rows and
  gradient_accumulation_steps = steps_per_generation = rows / micro_rows, still one
  generation per update). No gradient checkpointing on either side; a constant LR, AdamW,
  gradient clipping at 1.0 on both.

Not equal, by design of the two programs (the phase clocks show the cost): with one update per
generation TRL skips the no-grad "old log-prob" forward (π_old = π_θ.detach()), Keel runs it.

Only torch, transformers and the Keel modules a local run needs are imported here (no Ray,
no FastAPI); TRL, datasets and accelerate only inside `TRLSide`.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import GenerationConfig

PROMPT_LENGTH = 16  # characters = tokens (char tokenizer)
HARNESS_FILE = Path(__file__).resolve()


# ----------------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Workload:
    """One GRPO step's shape: `prompts` × `n` completions of exactly `max_new_tokens` tokens."""

    name: str
    prompts: int
    n: int
    max_new_tokens: int
    kl: float = 0.0  # Keel's algorithm.kl_loss_coef = TRL's beta; > 0 loads a reference model
    lr: float = 1e-5
    micro_rows: int | None = None  # rows per forward/backward; None: the whole step at once

    @property
    def rows(self) -> int:
        return self.prompts * self.n


def digit_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """Fraction of digits in each completion: cheap, and not constant (non-zero advantages)."""
    out = []
    for c in completions:
        text = c if isinstance(c, str) else c[-1]["content"]
        out.append(sum(ch.isdigit() for ch in text) / max(len(text), 1))
    return out


def make_prompts(count: int, length: int = PROMPT_LENGTH) -> list[str]:
    """`count` distinct prompts of exactly `length` characters ("add 012 and 345:" padded; under
    8 characters its tail, "345:", so that the first 1,000 stay distinct down to 4)."""
    prompts = []
    for i in range(count):
        text = f"add {i % 1000:03d} and {(7 * i + 3) % 1000:03d}:"
        if length < 8:
            text = text[-length:]
        prompts.append((text * (length // len(text) + 1))[:length])
    return prompts


def step_prompts(given: list[str] | None, count: int, length: int) -> list[str]:
    """`count` prompts: `given` repeated in order when there are some (a task's own prompts,
    `length` then only their token limit), else `make_prompts(count, length)`."""
    if not given:
        return make_prompts(count, length)
    return [given[i % len(given)] for i in range(count)]


def write_prompts(path: Path, prompts: list[str]) -> Path:
    with path.open("w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    return path


def suppress_eos(folder: Path) -> list[int]:
    """Make HF generate never sample an EOS id from the model at `folder` (suppress_tokens in its
    generation_config.json); returns those ids."""
    from keel.models import eos_token_ids, load_tokenizer

    tokenizer = load_tokenizer(folder)
    gen = GenerationConfig.from_pretrained(folder)

    class _M:  # eos_token_ids reads model.generation_config only
        generation_config = gen

    ids = list(eos_token_ids(_M(), tokenizer))
    gen.suppress_tokens = ids
    gen.save_pretrained(folder)
    return ids


def tiny_llama_folder(path: Path, size: str, *, forced: bool = True) -> tuple[Path, int]:
    """A Llama folder from keel.models.create_tiny_model with its EOS suppressed (`forced`;
    else left as it is); (folder, parameters). size "tiny": the factory's default (hidden 64,
    2 layers); "small": hidden 256, 4 layers, 4 heads, MLP 1024."""
    from keel.models import TinyModelSpec, count_parameters, create_tiny_model, load_causal_lm

    specs = {
        "tiny": TinyModelSpec(),
        "small": TinyModelSpec(
            hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4, intermediate_size=1024
        ),
    }
    folder = create_tiny_model(path, specs[size])
    if forced:
        suppress_eos(folder)
    return folder, count_parameters(load_causal_lm(folder))


# ----------------------------------------------------------------------------- phases
PHASES = (
    "generate",
    "reward",
    "old_logprob_fwd",
    "ref_fwd",
    "train_fwd",
    "backward",
    "optimizer",
)


class PhaseClock:
    """Wall seconds per phase of a step, measured by wrapping the calls both programs make:

    - generate: HF `GenerationMixin.generate`, and Keel's decode loop (`RolloutDecoder.decode`);
    - old_logprob_fwd / ref_fwd / train_fwd: one log-prob pass over the batch, the model's
      forward plus the log-softmax (and entropy) over the response tokens: Keel's
      `response_forward` (as the actor and reference workers call it), TRL's
      `GRPOTrainer._get_per_token_logps_and_entropies` (its fused LM head computes the
      log-probs in tiles inside the model call). train_fwd when grad is enabled, else ref_fwd
      for a registered reference model, else old_logprob_fwd;
    - backward: `Tensor.backward`;
    - optimizer: `clip_grad_norm_` and `AdamW.step`;
    - reward: the reward function.

    With `watch(decoder_class)` it also counts the token positions each phase's model calls
    compute (batch × new positions of every call of that class's forward: the decoder both
    programs call under their causal-LM heads), those of them the call's 2-D attention mask
    leaves out (padding), and the decode calls (one new position per row); and, at each train
    forward, every row's (prompt, response) tokens from its attention and response masks.
    `take_counts()` hands them over per step.

    "other" (computed by the caller) is the rest of the step: tokenising, padding, decoding,
    the loss arithmetic, advantages, metrics, moving data and each program's bookkeeping. Only
    one side runs at a time (see the drivers), so one set of counters serves both; nested
    calls count once, in the outer phase. A wrapper costs ~1 µs a call. With `cuda_sync` every
    phase boundary waits for the GPU, so the GPU's time lands in the phase that queued it.
    """

    def __init__(self) -> None:
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        self.cpu: dict[str, float] = dict.fromkeys(PHASES, 0.0)  # process CPU seconds
        self.ref_models: set[int] = set()
        self.counts: dict[str, float] = {}
        self.rows: list[tuple[int, int]] = []  # (prompt, response) tokens per trained row
        self._local = threading.local()
        self._undo: list[Callable[[], None]] = []
        self.cuda_sync = False

    def reset(self) -> tuple[dict[str, float], dict[str, float]]:
        """(wall, CPU) seconds per phase since the last reset."""
        out = self.totals, self.cpu
        self.totals, self.cpu = dict.fromkeys(PHASES, 0.0), dict.fromkeys(PHASES, 0.0)
        return out

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if getattr(self._local, "inside", None):  # nested: counted by the outer phase
            yield
            return
        self._local.inside = name
        self._sync()
        start, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self._sync()
            self.totals[name] += time.perf_counter() - start
            self.cpu[name] += time.process_time() - cpu
            self._local.inside = None

    def _sync(self) -> None:
        if self.cuda_sync:
            torch.cuda.synchronize()

    def _patch(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> None:
        original = getattr(owner, attr)
        wrapped = functools.wraps(original)(make(original))
        if getattr(original, "hooked", False):  # torch.optim's profile-hook marker
            wrapped.hooked = True
        setattr(owner, attr, wrapped)
        self._undo.append(lambda: setattr(owner, attr, original))

    def _count(self, key: str, value: float) -> None:
        self.counts[key] = self.counts.get(key, 0.0) + value

    def take_counts(self) -> tuple[dict[str, float], list[tuple[int, int]]]:
        """(position counts by kind, (prompt, response) tokens of each trained row) since the
        last call."""
        out = self.counts, self.rows
        self.counts, self.rows = {}, []
        return out

    def watch(self, decoder_class: type) -> None:
        """Count the positions of every `decoder_class.forward` call, by phase (see above)."""
        clock = self

        def make(original: Any) -> Any:
            def wrapper(module: Any, *args: Any, **kwargs: Any) -> Any:
                ids = kwargs.get("input_ids", args[0] if args else None)
                if ids is None:
                    ids = kwargs.get("inputs_embeds")
                phase = getattr(clock._local, "inside", None)
                if ids is not None and phase is not None:
                    kind = "gen" if phase == "generate" else "train"
                    rows, new = ids.shape[0], ids.shape[1]
                    clock._count(f"{kind}_positions", rows * new)
                    if kind == "gen" and new == 1:
                        clock._count("gen_decode_positions", rows)
                    mask = kwargs.get("attention_mask")
                    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                        real = int(mask[:, -new:].sum())
                        clock._count(f"{kind}_masked", rows * new - real)
                return original(module, *args, **kwargs)

            return wrapper

        self._patch(decoder_class, "forward", make)

    def _record_rows(self, attention: torch.Tensor, responses: torch.Tensor) -> None:
        """Each row's real prompt and response tokens: `attention` [rows, P + R] (1 on real
        tokens), `responses` [rows, R] (1 on response tokens)."""
        r = responses.shape[1]
        prompt = attention[:, : attention.shape[1] - r].sum(1)
        response = responses.sum(1)
        self.rows += [(int(p), int(q)) for p, q in zip(prompt, response, strict=True)]

    def _forward_phase(self, model: Any) -> str:
        if torch.is_grad_enabled():
            return "train_fwd"
        return "ref_fwd" if id(model) in self.ref_models else "old_logprob_fwd"

    def install(self) -> PhaseClock:
        """Wrap the calls (until `uninstall`); TRL's only when it is importable."""
        clock = self

        def timed(name: str) -> Callable[[Any], Any]:
            def make(original: Any) -> Any:
                def wrapper(*args: Any, **kwargs: Any) -> Any:
                    with clock.phase(name):
                        return original(*args, **kwargs)

                return wrapper

            return make

        def logprob_pass(model_arg: int, rows: Callable[..., None]) -> Callable[[Any], Any]:
            def make(original: Any) -> Any:
                def wrapper(*args: Any, **kwargs: Any) -> Any:
                    phase = clock._forward_phase(args[model_arg])
                    if phase == "train_fwd" and not getattr(clock._local, "inside", None):
                        rows(*args, **kwargs)
                    with clock.phase(phase):
                        return original(*args, **kwargs)

                return wrapper

            return make

        def keel_rows(model: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
            clock._record_rows(batch.attention_mask, batch.response_mask)

        def trl_rows(trainer: Any, model: Any, input_ids: Any, attention_mask: Any,
                     logits_to_keep: int, *args: Any, **kwargs: Any) -> None:  # fmt: skip
            clock._record_rows(attention_mask, attention_mask[:, -logits_to_keep:])

        import keel.engine.forward
        import keel.rollout.decode
        import keel.workers.actor

        self._patch(transformers.GenerationMixin, "generate", timed("generate"))
        # Keel's own decode loop (rollout.decode keel / keel-static) does not call generate
        self._patch(keel.rollout.decode.RolloutDecoder, "decode", timed("generate"))
        # the training pass (the actor's loss) and the no-grad passes (old and reference
        # log-probs, through keel.engine.forward.micro_batched_logprobs)
        self._patch(keel.workers.actor, "response_forward", logprob_pass(0, keel_rows))
        self._patch(keel.engine.forward, "response_forward", logprob_pass(0, keel_rows))
        if trl_available():
            from trl import GRPOTrainer

            self._patch(
                GRPOTrainer, "_get_per_token_logps_and_entropies", logprob_pass(1, trl_rows)
            )
        self._patch(torch.Tensor, "backward", timed("backward"))
        self._patch(torch.nn.utils, "clip_grad_norm_", timed("optimizer"))
        self._patch(torch.optim.AdamW, "step", timed("optimizer"))
        return self

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def timed_reward(self, fn: Callable[..., list[float]]) -> Callable[..., list[float]]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> list[float]:
            with self.phase("reward"):
                return fn(*args, **kwargs)

        return wrapper


# Keel loads its reward function from this file by path (`reward.fn: .../harness.py:
# timed_digit_reward`), i.e. as a second copy of this module; `KeelSide` sets that copy's clock.
_REWARD_CLOCK: PhaseClock | None = None


def timed_digit_reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    clock = _REWARD_CLOCK
    if clock is None:
        return digit_reward(prompts, completions, **kwargs)
    with clock.phase("reward"):
        return digit_reward(prompts, completions, **kwargs)


# ----------------------------------------------------------------------------- steps
@dataclass
class StepRecord:
    wall_s: float
    cpu_s: float
    phases: dict[str, float]  # wall seconds per phase (PhaseClock)
    phases_cpu: dict[str, float]  # process CPU seconds per phase
    completion_len: float
    extra: dict[str, float] = field(default_factory=dict)
    counts: dict[str, float] = field(default_factory=dict)  # PhaseClock.take_counts()
    rows: list[tuple[int, int]] = field(default_factory=list)  # (prompt, response) tokens


class KeelSide:
    """Keel's RLController built through its Python API as bench/run.py does; `step()` runs and
    times one `RLController.step`."""

    def __init__(
        self,
        model_dir: Path,
        workload: Workload,
        work_dir: Path,
        *,
        total_steps: int,
        clock: PhaseClock,
        device: str = "cpu",
        dtype: str = "float32",
        prompt_length: int = PROMPT_LENGTH,
        extra_config: dict[str, Any] | None = None,
        prompts: list[str] | None = None,
    ):
        from keel.config import validate
        from keel.controller.assembly import build_reward, load_datasets, local_roles
        from keel.controller.rl import RLController
        from keel.plan.run import resolve_run
        from keel.recipes import build_spec

        w = workload
        data = write_prompts(
            work_dir / f"prompts_{w.name}.jsonl",
            step_prompts(prompts, w.prompts * (total_steps + 2), prompt_length),
        )
        raw: dict[str, Any] = {
            "run_dir": str(work_dir / "keel_run"),
            "seed": 0,
            "models": {"actor": str(model_dir), "dtype": dtype},
            "algorithm": {"name": "grpo", "kl_loss_coef": w.kl},
            "data": {"train": str(data), "shuffle": False, "max_prompt_length": prompt_length},
            "reward": {"fn": f"{HARNESS_FILE}:timed_digit_reward", "signature": "trl"},
            "rollout": {"n": w.n, "max_new_tokens": w.max_new_tokens},
            "train": {
                "steps": total_steps,
                "batch_size": w.prompts,
                "lr": w.lr,
                "lr_schedule": "constant",
                "warmup_steps": 0,
                "ppo_epochs": 1,
                "micro_batch_size": w.micro_rows,
                "gradient_checkpointing": False,
            },
            "monitor": {"progress": False},
            "resources": {"device": device},
        }
        for dotted, value in (extra_config or {}).items():
            node = raw
            *parents, leaf = dotted.split(".")
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = value
        self.cfg = validate(raw)
        spec = build_spec(self.cfg)
        scorer = build_reward(self.cfg)
        # Keel loaded the reward from this file by path, as a module of its own: point that
        # module's clock at ours.
        scorer.fn.__globals__["_REWARD_CLOCK"] = clock
        run = resolve_run(self.cfg, spec)
        self.roles = local_roles(run.workers, scorer)
        self.controller = RLController(run, self.roles, load_datasets(self.cfg, spec))
        self.clock = clock
        if self.roles.reference is not None:
            for worker in getattr(self.roles.reference, "workers", []):
                clock.ref_models.add(id(worker.model))
        self.steps_done = 0
        self.profiler: Any = None  # a cProfile.Profile to collect the steps into, when set

    @property
    def actor_model(self) -> torch.nn.Module:
        return self.roles.actor.workers[0].model

    def step(self) -> StepRecord:
        self.steps_done += 1
        self.clock.reset()
        self.clock.take_counts()
        self.clock._sync()
        if self.profiler is not None:
            self.profiler.enable()
        wall, cpu = time.perf_counter(), time.process_time()
        metrics = self.controller.step(self.steps_done)
        self.clock._sync()
        if self.profiler is not None:
            self.profiler.disable()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        timing = {k: float(v) for k, v in metrics.items() if k.startswith("timing/")}
        phases, phases_cpu = self.clock.reset()
        counts, rows = self.clock.take_counts()
        return StepRecord(
            wall_s=wall,
            cpu_s=cpu,
            phases=phases,
            phases_cpu=phases_cpu,
            completion_len=float(metrics["response/length_mean"]),
            extra=timing,
            counts=counts,
            rows=rows,
        )

    def close(self) -> None:
        self.roles.close()


class _StopTraining(Exception):
    pass


class TRLSide:
    """TRL's GRPOTrainer, `trainer.train()` running on a thread of its own that a callback
    holds at every `on_step_begin` until `step()` lets it through: one optimizer step per
    call, and the caller's thread waits meanwhile, so the two programs never overlap.

    A step's time runs from the release at `on_step_begin` to the next `on_step_begin`: the
    generation, scoring, losses, backward, optimizer step and the trainer's own per-step work
    (logging check, fetching the next prompts) — everything TRL does once per step.
    """

    def __init__(
        self,
        model_dir: Path,
        workload: Workload,
        work_dir: Path,
        *,
        total_steps: int,
        clock: PhaseClock,
        device: str = "cpu",
        bf16: bool = False,
        prompt_length: int = PROMPT_LENGTH,
        timeout_s: float = 3600.0,
        prompts: list[str] | None = None,
    ):
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        from keel.models import load_tokenizer

        w = workload
        self.clock, self.timeout_s = clock, timeout_s
        self.records: list[StepRecord] = []
        self._go = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._error: BaseException | None = None
        self._stopping = False
        self._pending: tuple[float, float] | None = None
        self._length = float("nan")
        self.profiler: Any = None  # a cProfile.Profile (enabled on the trainer's thread)
        side = self

        class Gate(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                side._finish_step()
                side._go.acquire()
                if side._stopping:
                    raise _StopTraining
                side.clock.reset()
                side.clock.take_counts()
                side.clock._sync()
                if side.profiler is not None:
                    side.profiler.enable()
                side._pending = (time.perf_counter(), time.process_time())

            def on_step_end(self, args, state, control, **kwargs):
                lengths = side.trainer._metrics["train"].get("completions/mean_length") or [0.0]
                side._length = float(lengths[-1])

            def on_train_end(self, args, state, control, **kwargs):
                side._finish_step()

        cuda = device == "cuda"
        micro = w.micro_rows or w.rows
        if w.rows % micro:
            raise ValueError(f"micro_rows {micro} does not divide the {w.rows} rows of a step")
        args = GRPOConfig(
            output_dir=str(work_dir / f"trl_{w.name}"),
            seed=0,
            max_steps=total_steps + 1,  # the last one is never let through (no train-end work)
            per_device_train_batch_size=micro,
            gradient_accumulation_steps=w.rows // micro,
            steps_per_generation=w.rows // micro,
            num_iterations=1,
            num_generations=w.n,
            max_completion_length=w.max_new_tokens,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            beta=w.kl,
            loss_type="grpo",  # per-sequence token mean, as Keel's seq-mean-token-mean
            scale_rewards="group",
            learning_rate=w.lr,
            lr_scheduler_type="constant",
            warmup_steps=0,
            max_grad_norm=1.0,
            weight_decay=0.0,
            gradient_checkpointing=False,
            bf16=bf16,
            fp16=False,
            use_cpu=not cuda,
            shuffle_dataset=False,
            report_to="none",
            logging_strategy="no",
            save_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            model_init_kwargs={"dtype": "float32"},
        )
        texts = step_prompts(prompts, w.prompts * (total_steps + 3), prompt_length)
        self.trainer = GRPOTrainer(
            model=str(model_dir),
            reward_funcs=[clock.timed_reward(digit_reward)],
            args=args,
            train_dataset=Dataset.from_dict({"prompt": texts}),
            processing_class=load_tokenizer(model_dir),
            callbacks=[Gate()],
        )
        if self.trainer.ref_model is not None:
            clock.ref_models.add(id(self.trainer.ref_model))
        self._thread = threading.Thread(target=self._run, name="trl-train", daemon=True)
        self._started = False

    @property
    def actor_model(self) -> torch.nn.Module:
        return self.trainer.model

    def _finish_step(self) -> None:
        if self._pending is None:
            return
        self.clock._sync()
        wall0, cpu0 = self._pending
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        if self.profiler is not None:
            self.profiler.disable()
        self._pending = None
        phases, phases_cpu = self.clock.reset()
        counts, rows = self.clock.take_counts()
        self.records.append(
            StepRecord(
                wall_s=wall,
                cpu_s=cpu,
                phases=phases,
                phases_cpu=phases_cpu,
                completion_len=self._length,
                counts=counts,
                rows=rows,
            )
        )
        self._done.release()

    def _run(self) -> None:
        try:
            self.trainer.train()
        except _StopTraining:
            pass
        except BaseException as e:  # handed to the caller's thread
            self._error = e
        finally:
            self._done.release()

    def step(self) -> StepRecord:
        if not self._started:
            self._thread.start()
            self._started = True
        before = len(self.records)
        self._go.release()
        deadline = time.monotonic() + self.timeout_s
        while not self._done.acquire(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"TRL step took more than {self.timeout_s} s")
        if self._error is not None:
            raise RuntimeError(f"TRL's trainer failed: {self._error!r}") from self._error
        if len(self.records) == before:
            raise RuntimeError("TRL's trainer stopped before the step ran")
        return self.records[-1]

    def close(self) -> None:
        if self._started and self._thread.is_alive():
            self._stopping = True
            self._go.release()
            self._thread.join(timeout=60)


def trl_available() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return True


def quiet() -> None:
    """Fewer progress bars and warnings from transformers / datasets."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
