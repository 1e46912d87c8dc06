"""RolloutWorker: generates responses with its rollout engine (a `keel.rollout.RolloutEngine`),
stamped with a weight version."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from keel.checkpoint.state import capture_rng, restore_rng
from keel.data.examples import Example
from keel.engine.distributed import rank
from keel.envs.agents import AgentRunner
from keel.envs.episodes import EpisodeRunner
from keel.rollout.protocol import RolloutEngine, SamplingParams
from keel.types import Batch
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

    @property
    def weight_version(self) -> int:
        """How many policy updates the weights this worker generates with have seen."""
        return self.weights_from.weight_version if self.weights_from else self._version

    def generate(
        self, examples: Sequence[Example], *, sampling: SamplingParams, group_offset: int = 0
    ) -> Batch:
        source = self.engine if self.episodes is None else self.episodes
        batch = source.generate(examples, sampling, group_offset=group_offset)
        batch.meta["weight_version"] = self.weight_version
        return batch

    def load_weights(
        self, state: dict[str, torch.Tensor] | None, version: int, lineage: int = 0
    ) -> None:
        """New policy weights (a full state dict) with their version and lineage
        (keel.workers.weight_sync.WeightTag); StaleWeightsError when they are older than the
        ones held."""
        if state is None:
            raise ValueError("load_weights got no weights (the actor's rank 0 exports them)")
        tag = WeightTag(int(lineage), int(version))
        check_order(self.weight_tag, tag, f"rollout rank {rank()}")
        self.engine.update_weights(state, tag.version)
        self._version, self._lineage = tag.version, tag.lineage

    @property
    def weight_tag(self) -> WeightTag:
        """(lineage, version) of the weights held (older pushes are refused)."""
        return WeightTag(self._lineage, self._version)

    def weight_target(self) -> tuple[str, str]:
        """(dtype, device type) of the engine's weights: what a collective push sends."""
        return engine_target(self.engine)

    def open_weight_sync(self, spec: ChannelSpec) -> None:
        """Join the collective weight sync as sync rank 1 + this rank."""
        self.weight_channel = BucketChannel(spec, 1 + rank())

    def receive_weights(self) -> int:
        """Receive one collective push and load it; returns its version (StaleWeightsError,
        nothing loaded, when it is older than the weights held)."""
        if self.weight_channel is None:
            raise RuntimeError("receive_weights before open_weight_sync")
        state, tag = self.weight_channel.receive(self.weight_tag)
        self.engine.update_weights(state, tag.version)
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

    def needs_weights(self) -> bool:
        """True when the engine holds its own copy of the policy (pushed after each update)."""
        return self.weights_from is None

    def close(self) -> None:
        """Release the engine's processes and memory."""
        self.engine.close()
