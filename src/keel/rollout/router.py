"""Which engine of a pool (keel.rollout.pool) serves which prompt: least-loaded first, with
affinity. Pure: no process, no vLLM; the pool asks it, then tells it what finished.

A prompt of a `generate_ids` call is one group (its `sampling.n` rows are sampled on the same
engine: the prompt is prefilled once there, the rows share its KV blocks). A prompt that
extends a prompt routed before (a multi-turn episode's next turn: its prompt is the previous
turn's prompt, the response and the observation; a gateway session's next request) goes to
the engine that served that earlier prompt, where its prefix is cached. Every other prompt goes
to the live engine with the fewest outstanding tokens (prompt + max_new_tokens of each row
assigned and not yet done), the costliest groups of a call placed first.

Affinity is found by prefix hashes: the router remembers a polynomial hash of every prompt it
routed (the newest `memory` of them), and looks a new prompt's prefixes up, longest first. A
collision (2⁻⁶¹ per pair) only sends a prompt to another engine than the least-loaded one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

HASH_MOD = (1 << 61) - 1  # a Mersenne prime
HASH_BASE = 1_000_003


def prefix_hashes(tokens: Sequence[int]) -> list[int]:
    """h[k] for k = 1..len(tokens): the polynomial hash of tokens[:k] (h[0] is the empty
    prefix's, 0), so that equal prefixes hash equally whatever follows them."""
    out = [0]
    h = 0
    for token in tokens:
        h = (h * HASH_BASE + int(token) + 1) % HASH_MOD
        out.append(h)
    return out


@dataclass
class Router:
    """`engines` engines, all live at first. `assign` places prompts, `done` releases their
    cost, `drop` takes a dead engine out (its affinities are forgotten: its prompts go to the
    least-loaded live engine from then on)."""

    engines: int
    memory: int = 65536  # prompts remembered for affinity (oldest forgotten first)
    live: set[int] = field(default_factory=set)
    load: list[int] = field(default_factory=list)  # outstanding tokens per engine
    _seen: OrderedDict[tuple[int, int], int] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ValueError(f"a router needs at least one engine, got {self.engines}")
        self.live = set(range(self.engines))
        self.load = [0] * self.engines

    def assign(
        self, prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int
    ) -> dict[int, list[int]]:
        """{engine: the indices of `prompts` it serves, in order}; each prompt's cost,
        n × (len(prompt) + max_new_tokens), is added to its engine's load until `done`.
        RuntimeError when no engine is live."""
        if not self.live:
            raise RuntimeError("no engine of the pool is live")
        costs = [n * (len(p) + max_new_tokens) for p in prompts]
        chosen: dict[int, int] = {}
        later: list[int] = []
        for i, prompt in enumerate(prompts):
            engine = self.affinity(prompt)
            if engine is None:
                later.append(i)
            else:
                chosen[i] = engine
                self.load[engine] += costs[i]
        for i in sorted(later, key=lambda j: -costs[j]):  # costliest first (stable)
            engine = self.least_loaded()
            chosen[i] = engine
            self.load[engine] += costs[i]
        out: dict[int, list[int]] = {}
        for i in range(len(prompts)):
            out.setdefault(chosen[i], []).append(i)
            self.remember(prompts[i], chosen[i])
        return out

    def least_loaded(self) -> int:
        """The live engine with the fewest outstanding tokens (the lowest index on a tie)."""
        return min(self.live, key=lambda e: (self.load[e], e))

    def affinity(self, prompt: Sequence[int]) -> int | None:
        """The live engine that served the longest earlier prompt that `prompt` starts with
        (`prompt` itself included); None when there is none."""
        hashes = prefix_hashes(prompt)
        for k in range(len(prompt), 0, -1):
            engine = self._seen.get((k, hashes[k]))
            if engine is not None and engine in self.live:
                return engine
        return None

    def remember(self, prompt: Sequence[int], engine: int) -> None:
        if not prompt:
            return
        key = (len(prompt), prefix_hashes(prompt)[-1])
        self._seen[key] = engine
        self._seen.move_to_end(key)
        while len(self._seen) > self.memory:
            self._seen.popitem(last=False)

    def done(self, engine: int, prompts: Iterable[Sequence[int]], n: int, max_new_tokens: int):
        """The prompts `assign` gave `engine` are finished (or given up): release their cost."""
        cost = sum(n * (len(p) + max_new_tokens) for p in prompts)
        self.load[engine] = max(0, self.load[engine] - cost)

    def drop(self, engine: int) -> None:
        """`engine` is gone: no prompt is assigned to it again."""
        self.live.discard(engine)
        self.load[engine] = 0
        for key in [k for k, e in self._seen.items() if e == engine]:
            del self._seen[key]
