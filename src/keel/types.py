"""The Batch: the one data type that flows between the controller and the roles.

Shapes: B rows (sequences), P prompt tokens (left-padded), R response tokens (right-padded),
T = P + R. Every tensor field is optional; a role fills the fields it computes. A batch splits and
concatenates by rows, which is how worker groups dispatch work.

A stage that reads fields asks for them with a view: `batch.view(ScoredBatch)` is the batch
itself, typed with those fields present (not Optional), or a ValueError naming the missing one.
The views (`BatchView` subclasses, below `Batch`) are types only: never built, never sent.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeAlias, TypedDict, TypeVar, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A prompt as a batch row holds it: text, or chat messages ({"role", "content", …}).
Prompt = str | list[dict[str, Any]]
# The tokenizer Keel's code holds: an HF tokenizer (keel.models.load_tokenizer's; the built-in
# character tokenizer is one too). Named by its string, so that importing it imports nothing.
Tokenizer: TypeAlias = "PreTrainedTokenizerBase"
# a view of a Batch (Batch.view)
View = TypeVar("View", bound="BatchView")


class BatchMeta(TypedDict, total=False):
    """What a batch carries besides its rows (`Batch.meta`), by the role that writes it:

      eos_token_ids       rollout engine: every token id that ends a response
      eos_token_id        one EOS id, from producers older than eos_token_ids (only read)
      weight_version      rollout worker: the policy updates its generating weights had seen
                          (the oldest version of any of its tokens: token_weight_versions)
      weight_version_lag  RL controller: its own weight version minus weight_version
      reward_errors       reward worker: rows whose score fell back (a failed or timed-out call)
      reward_metrics      reward worker: batch means such as reward/<name>, reward/model_mean
      reward_warnings     reward worker: (rule, message) warnings for the run's events.jsonl

    Merging: the rows of one batch share its meta, so `Batch.select`, `split` and `chunk` copy
    it and `Batch.concat` keeps the first batch's. The shards of one data-parallel call are
    combined by `merge_meta` (the reward keys summed, row-weighted or joined).
    """

    eos_token_ids: list[int]
    eos_token_id: int
    weight_version: int
    weight_version_lag: int
    reward_errors: int
    reward_metrics: dict[str, float]
    reward_warnings: list[tuple[str, str]]


@dataclass
class Batch:
    """Rows of prompt + response sequences and everything computed about them.

    Tensors (all optional):
      input_ids        [B, T] long   prompt (left-padded) followed by response (right-padded)
      attention_mask   [B, T] long   1 for real tokens of prompt and response, 0 for padding
      response_mask    [B, R] float  1 for generated tokens up to and including the first EOS
      old_logprobs     [B, R] float  log π_old (the policy that produced the rollout), no grad
      ref_logprobs     [B, R] float  log π_ref (frozen reference policy)
      teacher_logprobs [B, R] float  log π_T(y_t | x, y_<t): the distillation teacher's log-prob
                                     of each response token (keel.workers.teacher)
      teacher_topk_ids [B, R, K] long  the teacher's top-K token ids at each response position
      teacher_topk_logprobs [B, R, K] float  their log-probs (rank-ordered)
      rollout_logprobs [B, R] float  log-probs reported by the rollout engine
      rollout_is_weights [B, R] float  rollout correction's importance weights (decoupled mode;
                                     detached, fixed for the step's epochs)
      token_weight_versions [B, R] long  the weight version that sampled each response token
                                     (rollout worker; an interruptible rollout's rows mix two)
      values           [B, R] float  critic values
      advantages       [B, R] float  per-token advantages
      returns          [B, R] float  per-token returns
      scores           [B]    float  one scalar score (reward) per sequence
      group_ids        [B]    long   rows with the same id were sampled from the same prompt
    Per-row metadata (lists of length B): prompts, responses (decoded text), answers,
    finish_reasons ("stop": the response ended with an EOS; "length": cut at the budget);
    episodes (multi-turn rollouts, keel.envs: per row a dict of turns, termination, return,
    tool_calls, tool_errors, model_tokens, observation_tokens and the messages).
    With episodes, response_mask has holes: 0 on the observation tokens between turns.
    meta: the batch's `BatchMeta` (EOS ids, weight version, the reward worker's counts).
    """

    input_ids: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    response_mask: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    teacher_logprobs: torch.Tensor | None = None
    teacher_topk_ids: torch.Tensor | None = None
    teacher_topk_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    rollout_is_weights: torch.Tensor | None = None
    token_weight_versions: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    group_ids: torch.Tensor | None = None
    prompts: list[Prompt] | None = None
    responses: list[str] | None = None
    answers: list[Any] | None = None
    finish_reasons: list[str] | None = None
    episodes: list[dict[str, Any]] | None = None
    meta: BatchMeta = field(default_factory=BatchMeta)

    # ------------------------------------------------------------------ shape
    def __len__(self) -> int:
        for f in _row_fields():
            v = getattr(self, f)
            if v is not None:
                return len(v)
        return 0

    @property
    def response_length(self) -> int:
        """R, the padded number of response tokens."""
        return self._present("response_mask", self.response_mask, "response_length").shape[1]

    @property
    def prompt_length(self) -> int:
        """P, the padded number of prompt tokens."""
        ids = self._present("input_ids", self.input_ids, "prompt_length")
        return ids.shape[1] - self.response_length

    # ------------------------------------------------------------------ views
    def view(self, kind: type[View]) -> View:
        """This batch typed as `kind`, whose fields are present (not None) here; a ValueError
        names the first missing one. The same object: nothing is copied or checked again."""
        for name in kind.fields:
            if getattr(self, name) is None:
                raise ValueError(
                    f"the batch has no {name} ({kind.__name__} needs {', '.join(kind.fields)})"
                )
        return cast(View, self)

    @staticmethod
    def _present(name: str, value: torch.Tensor | None, reader: str) -> torch.Tensor:
        if value is None:
            raise ValueError(f"the batch has no {name} (Batch.{reader} reads it)")
        return value

    # ------------------------------------------------------------ row algebra
    def select(self, index: Sequence[int] | torch.Tensor) -> Batch:
        """The rows at `index`, in that order (tensors are indexed, lists picked)."""
        idx = torch.as_tensor(index, dtype=torch.long)
        out = {}
        for f in _row_fields():
            v = getattr(self, f)
            if v is None:
                out[f] = None
            elif isinstance(v, torch.Tensor):
                out[f] = v[idx]
            else:
                out[f] = [v[int(i)] for i in idx]
        return Batch(**out, meta=self.meta.copy())

    def split(self, chunk_rows: int) -> list[Batch]:
        """Consecutive chunks of `chunk_rows` rows (the last may be shorter)."""
        n = len(self)
        if chunk_rows <= 0:
            raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
        return [self.select(range(s, min(s + chunk_rows, n))) for s in range(0, n, chunk_rows)]

    def chunk(self, parts: int) -> list[Batch]:
        """`parts` nearly equal consecutive pieces (for data-parallel dispatch)."""
        n = len(self)
        bounds = [round(i * n / parts) for i in range(parts + 1)]
        return [self.select(range(bounds[i], bounds[i + 1])) for i in range(parts)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """Rows of all `batches` in order. Tensors are right-padded with 0 to a common width."""
        if not batches:
            raise ValueError("cannot concatenate zero batches")
        out: dict[str, Any] = {}
        for f in _row_fields():
            vals = [getattr(b, f) for b in batches]
            if all(v is None for v in vals):
                out[f] = None
            elif any(v is None for v in vals):
                raise ValueError(f"field {f!r} is set in some batches and not in others")
            elif isinstance(vals[0], torch.Tensor):
                out[f] = _cat_padded(vals)
            else:
                out[f] = [x for v in vals for x in v]
        return Batch(**out, meta=batches[0].meta.copy())

    def real_lengths(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt, response) lengths [B] of each row without its padding: the prompt from its
        first real token to column P, the response up to its last real token (real: attention
        or response mask set)."""
        attention = self.view(TokenBatch).attention_mask
        p, r = self.prompt_length, self.response_length
        prompt = attention[:, :p] != 0
        response = attention[:, p:] != 0
        if self.response_mask is not None:
            response = response | (self.response_mask != 0)
        # prompt column j is p - j columns from the prompt's end; response column j is j + 1
        return _extent(prompt, torch.arange(p, 0, -1)), _extent(response, torch.arange(1, r + 1))

    def trim_padding(self) -> Batch:
        """The same rows without the columns that are padding in every row: leading prompt
        columns and trailing response columns (at least one column of each is kept). Every
        [B, T] tensor loses the same columns, every [B, R] tensor the same trailing ones, so the
        layout (prompt left-padded to P' ≤ P, response right-padded to R' ≤ R) still holds;
        with positions counted from the attention mask, no real token's output changes."""
        if len(self) == 0:
            return self
        prompt_len, response_len = self.real_lengths()
        p, r = self.prompt_length, self.response_length
        keep_p = max(int(prompt_len.max()), 1)
        keep_r = max(int(response_len.max()), 1)
        if keep_p == p and keep_r == r:
            return self
        changes: dict[str, torch.Tensor] = {}
        for f in _row_fields():
            v = getattr(self, f)
            if not isinstance(v, torch.Tensor) or v.dim() < 2:
                continue
            if v.shape[1] == p + r:
                changes[f] = v[:, p - keep_p : p + keep_r].contiguous()
            elif v.shape[1] == r:
                changes[f] = v[:, :keep_r].contiguous()
            else:
                raise ValueError(f"field {f!r} has width {v.shape[1]}, neither T={p + r} nor R={r}")
        return self.replace(**changes)

    def to_state(self) -> dict[str, Any]:
        """Plain containers of tensors, lists and numbers (a checkpoint's `weights_only` load
        reads them back); `Batch.from_state` restores the batch."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(Batch)}

    @staticmethod
    def from_state(state: dict[str, Any]) -> Batch:
        """The batch `to_state` wrote. States written before the field `logprobs` was removed
        carry it as None (nothing ever set it); it is dropped."""
        return Batch(**{k: v for k, v in state.items() if k != "logprobs"})

    def replace(self, **changes: Any) -> Batch:
        return dataclasses.replace(self, **changes)

    def to(self, device: torch.device | str) -> Batch:
        changes = {
            f: getattr(self, f).to(device)
            for f in _row_fields()
            if isinstance(getattr(self, f), torch.Tensor)
        }
        return self.replace(**changes)


class BatchView(Batch):
    """A `Batch` with some fields present, the type `Batch.view` returns. A subclass declares
    those fields with their non-Optional types (its bases' count too); it is never built, and
    the batch it types stays a `Batch` (the wire format, `replace`, `select` and `concat`)."""

    fields: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        names = {
            name
            for c in cls.__mro__
            if issubclass(c, BatchView) and c is not BatchView
            for name in inspect.get_annotations(c)
        }
        order = [f.name for f in dataclasses.fields(Batch)]
        if unknown := names - set(order):
            raise TypeError(f"{cls.__name__} declares {sorted(unknown)}, no field of Batch")
        cls.fields = tuple(name for name in order if name in names)  # in Batch's order

    def __new__(cls, *args: Any, **kwargs: Any) -> BatchView:
        raise TypeError(f"{cls.__name__} is a view, never built: use batch.view({cls.__name__})")


# The views, by the stage that fills their fields (docs/architecture.md#batch-keeltypesbatch).
class TokenBatch(BatchView):
    """Tokens a forward pass reads: the encoders', the rollout engine's."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor


class SequenceBatch(TokenBatch):
    """The prompt + response layout with the policy's tokens marked: what the log-prob
    passes and the updates read (encode_sft, encode_pairs, the rollout engine)."""

    response_mask: torch.Tensor


class TextBatch(BatchView):
    """The rows as text: what a reward function reads."""

    prompts: list[Prompt]
    responses: list[str]


class GroupedBatch(BatchView):
    """Rows of one prompt share a group id (the rollout engine)."""

    group_ids: torch.Tensor


class RolloutBatch(SequenceBatch, TextBatch, GroupedBatch):
    """What `RolloutEngine.generate` returns."""

    finish_reasons: list[str]


class ScoredBatch(BatchView):
    """After the reward worker: each row's score and the tokens it was given for."""

    response_mask: torch.Tensor
    scores: torch.Tensor


class LogprobBatch(BatchView):
    """After the actor's `compute_logprobs`: log π_old."""

    old_logprobs: torch.Tensor


class ReferenceBatch(SequenceBatch):
    """After the reference: log π_ref (the KL terms, the preference losses)."""

    ref_logprobs: torch.Tensor


class VersionedBatch(BatchView):
    """An interruptible rollout's: the weight version of each sampled token."""

    response_mask: torch.Tensor
    token_weight_versions: torch.Tensor


class AdvantageBatch(SequenceBatch):
    """After the advantages: what the actor's update reads."""

    advantages: torch.Tensor


class ValueBatch(SequenceBatch):
    """After the advantages with a critic: what the critic's update reads."""

    values: torch.Tensor
    returns: torch.Tensor


def concat_rollouts(batches: list[Batch]) -> Batch:
    """Rows of several rollout batches in one batch, keeping the layout: prompts left-padded to
    the widest prompt, responses right-padded to the longest response."""
    p = max(b.prompt_length for b in batches)
    r = max(b.response_length for b in batches)
    relaid = []
    for b in batches:
        pad = (p - b.prompt_length, r - b.response_length)
        tokens = b.view(TokenBatch)
        relaid.append(
            b.replace(
                input_ids=torch.nn.functional.pad(tokens.input_ids, pad),
                attention_mask=torch.nn.functional.pad(tokens.attention_mask, pad),
            )
        )
    return Batch.concat(relaid)


def merge_meta(shards: Sequence[Batch]) -> BatchMeta:
    """The meta of the shards of one data-parallel call taken together (their rows
    concatenated in order): the first shard's, with the reward worker's keys combined —
    reward_errors summed when every shard has it, reward_metrics (with several shards) as means
    over all rows (each shard's value weighted by its rows), reward_warnings joined in order.
    Any other key, and reward_errors where a shard lacks it, is the first shard's."""
    out = shards[0].meta.copy()
    if all("reward_errors" in s.meta for s in shards):
        out["reward_errors"] = sum(s.meta.get("reward_errors", 0) for s in shards)
    if len(shards) > 1 and any("reward_metrics" in s.meta for s in shards):
        out["reward_metrics"] = _row_weighted_means(shards)
    if any("reward_warnings" in s.meta for s in shards):
        out["reward_warnings"] = [w for s in shards for w in s.meta.get("reward_warnings", ())]
    return out


def _row_weighted_means(shards: Sequence[Batch]) -> dict[str, float]:
    """The shards' meta["reward_metrics"] (batch means such as reward/<name>) as means over
    all their rows: each shard's value weighted by its number of rows."""
    sums: dict[str, float] = {}
    rows: dict[str, int] = {}
    for s in shards:
        for key, value in s.meta.get("reward_metrics", {}).items():
            sums[key] = sums.get(key, 0.0) + float(value) * len(s)
            rows[key] = rows.get(key, 0) + len(s)
    return {key: sums[key] / rows[key] for key in sums if rows[key]}


def _row_fields() -> list[str]:
    return [f.name for f in dataclasses.fields(Batch) if f.name != "meta"]


def _extent(mask: torch.Tensor, reach: torch.Tensor) -> torch.Tensor:
    """Per row, the largest `reach` of a set column of mask [B, C] (0 for a row with none)."""
    if mask.shape[1] == 0:
        return torch.zeros(mask.shape[0], dtype=torch.long)
    return (mask.long() * reach).amax(dim=1)


def _cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    if tensors[0].dim() == 1:
        return torch.cat(tensors)
    width = max(t.shape[1] for t in tensors)
    # pad dimension 1 (a [B, R, K] tensor keeps its last dimension)
    tail = [0, 0] * (tensors[0].dim() - 2)
    padded = [torch.nn.functional.pad(t, (*tail, 0, width - t.shape[1])) for t in tensors]
    return torch.cat(padded)
