"""A seeded, endless stream of batches over a list of examples, with a resumable position."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

T = TypeVar("T")


@dataclass
class StreamPosition:
    """Where the stream is: epoch number and index into that epoch's order."""

    epoch: int = 0
    index: int = 0


class BatchStream(Generic[T]):
    """Batches of `batch_size` items; each epoch is a fresh permutation from (seed, epoch).

    A batch that runs past the end of an epoch continues into the next one, so every batch is
    full and no item is skipped.
    """

    def __init__(self, items: list[T], batch_size: int, *, shuffle: bool = True, seed: int = 0):
        if not items:
            raise ValueError("cannot stream an empty dataset")
        self.items = items
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.position = StreamPosition()

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.items))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.items))

    def next_batch(self) -> list[T]:
        out: list[T] = []
        pos = self.position
        while len(out) < self.batch_size:
            order = self._order(pos.epoch)
            take = order[pos.index : pos.index + self.batch_size - len(out)]
            out.extend(self.items[i] for i in take)
            pos.index += len(take)
            if pos.index >= len(order):
                pos.epoch, pos.index = pos.epoch + 1, 0
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.position.epoch, "index": self.position.index, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seed = state["seed"]
        self.position = StreamPosition(state["epoch"], state["index"])
