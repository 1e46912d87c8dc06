"""RolloutWorker: generates responses with its rollout engine (a `keel.rollout.RolloutEngine`),
stamped with a weight version."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from keel.checkpoint.state import capture_rng, restore_rng
from keel.data.examples import Example
from keel.engine.distributed import rank
from keel.envs.agents import AgentRunner
from keel.envs.episodes import EpisodeRunner
from keel.rollout.pool import EnginesLostError
from keel.rollout.protocol import (
    AdapterEngine,
    AdapterWeights,
    InterruptibleEngine,
    RolloutEngine,
    SamplingParams,
    StreamedWeightsEngine,
)
from keel.types import Batch
from keel.workers.group import WorkerLostError
from keel.workers.weight_sync import (
    BucketChannel,
    ChannelSpec,
    WeightTag,
    check_order,
    engine_target,
)

if TYPE_CHECKING:
    from keel.workers.actor import ActorWorker


class RolloutWorker:
    """`weights_from`: the colocated actor worker whose module the engine generates with (its
    weights are always current); None when the engine holds its own copy of the policy (a
    separate rollout worker, a vLLM engine, asynchronous rollout), which receives new weights
    through `load_weights` after each update. `episodes`: with rollout.env, the runner that
    plays multi-turn episodes on the engine (keel.envs.EpisodeRunner, or keel.envs.agents'
    AgentRunner: a user's agent over the training gateway); None: one response per row from
    the engine itself."""

    def __init__(
        self,
        engine: RolloutEngine,
        weights_from: ActorWorker | None = None,
        episodes: EpisodeRunner | AgentRunner | None = None,
    ):
        self.engine = engine
        self.weights_from = weights_from
        self.episodes = episodes
        self._version = 0
        self._lineage = 0
        self.weight_channel: BucketChannel | None = None  # this rank's end of a collective sync
        # an interruptible rollout (rollout.interruptible; see `interruptible`)
        self.interrupt_at: int | None = None
        self._swap = threading.Condition()
        self._target: int | None = None  # the job the next push is for
        self._running: int | None = None  # the job generating on the pipeline's thread
        self._ended = -1  # the newest job that has ended (jobs run in order)
        # a push held for an interruptible job: full weights or a LoRA adapter, and its tag
        self._deferred: tuple[dict[str, torch.Tensor] | AdapterWeights, WeightTag] | None = None
        self._received = WeightTag(0, 0)  # the newest tag received (deferred or loaded)
        self._closed = False  # close() lets a job waiting for a push go

    @property
    def weight_version(self) -> int:
        """How many policy updates the weights this worker generates with have seen."""
        return self.weights_from.weight_version if self.weights_from else self._version

    def generate(
        self, examples: Sequence[Example], *, sampling: SamplingParams, group_offset: int = 0
    ) -> Batch:
        """A rollout batch whose every token records the weight version that sampled it
        (`token_weight_versions`: the engine's record in an interruptible rollout, else the
        version held when generation began) and meta["weight_version"], the oldest of them."""
        source = self.engine if self.episodes is None else self.episodes
        start = self.weight_version
        with engines_lost():
            batch = source.generate(examples, sampling, group_offset=group_offset)
        mask = batch.response_mask
        if mask is None:  # nothing generated to record
            batch.meta["weight_version"] = start
            return batch
        if batch.token_weight_versions is None:
            batch.token_weight_versions = torch.full(mask.shape, start, dtype=torch.long)
        batch.meta["weight_version"] = oldest_version(batch.token_weight_versions, mask, start)
        return batch

    # ------------------------------------------------------ interruptible rollout
    def interruptible(self, at_step: int) -> bool:
        """Turn the interruptible rollout on (rollout.interruptible): a weight push addressed
        to a generation job (`swap_address`) is held until that job's decode reaches step
        `at_step` (the step that samples each row's token `at_step`), where the rows still
        running continue under it; a job that ends before is given it at its end. Returns
        whether the engine's own loop can swap between steps (elsewhere every row finishes
        under the version it started with, and the push is loaded when the job ends)."""
        self.interrupt_at = at_step
        if isinstance(self.engine, InterruptibleEngine) and self.engine.interruptible:
            self.engine.step_hook = self._at_step
            return True
        return False

    def swap_address(self, job: int | None) -> None:
        """The next push is for generation job `job` (None: for none, it loads at once); a job
        waiting for a push that was for it is let go without one."""
        with self._swap:
            self._target = job
            self._swap.notify_all()

    def swap_begin(self, job: int) -> None:
        """Job `job` starts generating (the pipeline's thread)."""
        with self._swap:
            self._running = job

    def swap_end(self, job: int) -> None:
        """Job `job` is done: a push held for it and not yet taken is loaded now."""
        with self._swap:
            self._running, self._ended = None, job
            if self._target == job:
                self._take()

    def _at_step(self, step: int) -> int:
        """The engine's step hook: at step `interrupt_at` of the job the next push is for,
        wait for that push (or for the job to be let go) and load it; returns the version
        the step samples under."""
        if step == self.interrupt_at:
            with self._swap:
                mine = self._running is not None and self._running == self._target
                while mine and self._deferred is None and not self._closed:
                    self._swap.wait()
                    mine = self._running == self._target
                if mine:
                    self._take()
        return self._version

    def _take(self) -> None:
        """Load the push held for the target job, if any (under the lock); the target is
        served either way."""
        if self._deferred is not None:
            weights, tag = self._deferred
            self._deferred = None
            self._apply(weights, tag)
        self._target = None

    def _apply(self, weights: dict[str, torch.Tensor] | AdapterWeights, tag: WeightTag) -> None:
        """Load full weights or a LoRA adapter into the engine; the worker then holds `tag`."""
        with engines_lost():
            if isinstance(weights, AdapterWeights):
                self._adapter_engine().load_adapter(weights, tag.version)
            else:
                self.engine.update_weights(weights, tag.version)
        self._version, self._lineage = tag.version, tag.lineage

    def load_weights(
        self, state: dict[str, torch.Tensor] | None, version: int, lineage: int = 0
    ) -> None:
        """New policy weights (a full state dict) with their version and lineage
        (keel.workers.weight_sync.WeightTag); StaleWeightsError when they are older than the
        ones held."""
        if state is None:
            raise ValueError("load_weights got no weights (the actor's rank 0 exports them)")
        self._receive(state, WeightTag(int(lineage), int(version)))

    def load_adapter(self, adapter: AdapterWeights | None, version: int, lineage: int = 0) -> None:
        """A LoRA actor's new adapter (the engine keeps its base weights: an `AdapterEngine`),
        with the same version, lineage and interruptible-rollout rules as `load_weights`."""
        if adapter is None:
            raise ValueError("load_adapter got no adapter (the actor's rank 0 exports it)")
        self._adapter_engine()
        self._receive(adapter, WeightTag(int(lineage), int(version)))

    def _receive(self, weights: dict[str, torch.Tensor] | AdapterWeights, tag: WeightTag) -> None:
        """A push's weights: StaleWeightsError when older than what is held or received, held
        for the addressed job of an interruptible rollout, else loaded now."""
        check_order(max(self.weight_tag, self._received), tag, f"rollout rank {rank()}")
        self._received = tag
        with self._swap:
            if self._target is not None and self._target > self._ended:
                # interruptible: the addressed job takes it at its swap step or at its end
                self._deferred = (weights, tag)
                self._swap.notify_all()
                return
        self._apply(weights, tag)

    def adapter_refusal(self, config: dict[str, Any]) -> str | None:
        """Why this worker's engine cannot take a LoRA adapter of `config` (its
        adapter_config.json) as a push, None when it can (an `AdapterEngine` that accepts
        it): the weight sync then pushes adapters (keel.workers.weight_sync)."""
        if not isinstance(self.engine, AdapterEngine):
            return f"the rollout engine ({type(self.engine).__name__}) takes full weights only"
        return self.engine.adapter_refusal(config)

    def _adapter_engine(self) -> AdapterEngine:
        engine = self.engine
        if not isinstance(engine, AdapterEngine):
            raise TypeError(f"the rollout engine {type(engine).__name__} takes no LoRA adapter")
        return engine

    @property
    def weight_tag(self) -> WeightTag:
        """(lineage, version) of the weights held (older pushes are refused)."""
        return WeightTag(self._lineage, self._version)

    def weight_target(self) -> tuple[str, str]:
        """(dtype, device type) of the engine's weights: what a collective push sends (an
        engine pool answers for its engines)."""
        pooled: Callable[[], tuple[str, str]] | None = getattr(self.engine, "weight_target", None)
        return pooled() if pooled is not None else engine_target(self.engine)

    def open_weight_sync(self, spec: ChannelSpec) -> None:
        """Join the collective weight sync as sync rank 1 + this rank."""
        self.weight_channel = BucketChannel(spec, 1 + rank())

    def receive_weights(self) -> int:
        """Receive one collective push and load it; returns its version (StaleWeightsError,
        nothing loaded, when it is older than the weights held). An engine that takes weights
        as they arrive (`StreamedWeightsEngine`: vLLM) is given each bucket's complete tensors
        at once; another gets the whole state at the end."""
        if self.weight_channel is None:
            raise RuntimeError("receive_weights before open_weight_sync")
        engine, channel = self.engine, self.weight_channel
        with engines_lost():
            if isinstance(engine, StreamedWeightsEngine):
                # bucket by bucket into the engine as they arrive: no full copy on this side
                tag = channel.receive_stream(
                    self.weight_tag,
                    lambda _: engine.begin_weight_update(),
                    engine.load_weight_bucket,
                )
                engine.finish_weight_update(tag.version)
            else:
                state, tag = channel.receive(self.weight_tag)
                engine.update_weights(state, tag.version)
        self._version, self._lineage = tag.version, tag.lineage
        return tag.version

    def close_weight_sync(self) -> None:
        if self.weight_channel is not None:
            self.weight_channel.close()
            self.weight_channel = None

    def rng_state(self) -> dict[str, Any]:
        """This process's random state (python, numpy, torch): what sampling continues from.
        Checkpointed for rollout workers in processes of their own (Ray), so that a resumed run
        samples what the uninterrupted one sampled."""
        return capture_rng()

    def load_rng_state(self, states: list[dict[str, Any]]) -> None:
        """Restore `rng_state()` output; `states` holds this rank's one (a group call splits
        the list of every rank's state by rank)."""
        (state,) = states
        restore_rng(state)

    def engine_metrics(self) -> dict[str, float]:
        """The engine's own figures since the last call (an engine pool's rollout/engine{i}/...,
        keel.rollout.pool); empty for an engine that has none."""
        metrics: Callable[[], dict[str, float]] | None = getattr(self.engine, "metrics", None)
        return dict(metrics()) if metrics is not None else {}

    def needs_weights(self) -> bool:
        """True when the engine holds its own copy of the policy (pushed after each update)."""
        return self.weights_from is None

    def close(self) -> None:
        """Release the engine's processes and memory; a generation waiting for a push (a run
        that failed before pushing) goes on without it."""
        with self._swap:
            self._closed = True
            self._swap.notify_all()
        self.engine.close()


def oldest_version(versions: torch.Tensor, mask: torch.Tensor, default: int) -> int:
    """The oldest weight version among a batch's response tokens: versions [B, R] long,
    mask [B, R] (the response tokens); `default` when no token is masked in."""
    kept = versions[mask != 0]
    return int(kept.min()) if kept.numel() else default


@contextlib.contextmanager
def engines_lost() -> Iterator[None]:
    """Every engine of an engine pool died (keel.rollout.pool.EnginesLostError): a lost worker,
    which the run answers with its group restart (resources.max_restarts)."""
    try:
        yield
    except EnginesLostError as e:
        raise WorkerLostError(f"the rollout worker lost its engines: {e}") from e
