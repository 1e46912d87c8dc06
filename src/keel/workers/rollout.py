"""RolloutWorker: generates responses with its rollout engine (a `keel.rollout.RolloutEngine`),
stamped with a weight version."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from keel.checkpoint.state import capture_rng, restore_rng
from keel.data.examples import Example
from keel.envs.episodes import EpisodeRunner
from keel.rollout.protocol import RolloutEngine, SamplingParams
from keel.types import Batch

if TYPE_CHECKING:
    from keel.workers.actor import ActorWorker


class RolloutWorker:
    """`weights_from`: the colocated actor worker whose module the engine generates with (its
    weights are always current); None when the engine holds its own copy of the policy (a
    separate rollout worker, a vLLM engine, asynchronous rollout), which receives new weights
    through `load_weights` after each update. `episodes`: with rollout.env, the runner that
    plays multi-turn episodes on the engine (keel.envs.EpisodeRunner); None: one response per
    row from the engine itself."""

    def __init__(
        self,
        engine: RolloutEngine,
        weights_from: ActorWorker | None = None,
        episodes: EpisodeRunner | None = None,
    ):
        self.engine = engine
        self.weights_from = weights_from
        self.episodes = episodes
        self._version = 0

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

    def load_weights(self, state: dict[str, torch.Tensor] | None, version: int) -> None:
        """New policy weights (a full state dict) and their version."""
        if state is None:
            raise ValueError("load_weights got no weights (the actor's rank 0 exports them)")
        self.engine.update_weights(state, int(version))
        self._version = int(version)

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
