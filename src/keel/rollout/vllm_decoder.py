"""The `Decoder` (keel.rollout.protocol) of the vLLM engine (keel.rollout.vllm) on vLLM's own
engine step API (`VLLMDecoder`), and how vLLM's outputs read in Keel's terms (`finish_reason`,
`chosen_logprobs`).
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from keel.rollout.protocol import RowRequest, RowToken
from keel.rollout.vllm_process import eager_helpers, kept_rng

if TYPE_CHECKING:
    from keel.rollout.vllm import VLLMRolloutEngine

# The decoders' vLLM request ids, unique in the process (an id is never reused, even by another
# decoder: a late output of an aborted request cannot reach a newer row).
ROW_REQUEST_IDS = itertools.count(1)


@dataclass
class _Row:
    """A decoder row: its vLLM request id, its tokens not yet handed out ((id, log-prob), in
    order), and vLLM's finish reason once vLLM has ended it (its last tokens may still wait)."""

    request_id: str
    pending: deque[tuple[int, float]] = field(default_factory=deque)
    finish: str | None = None


class VLLMDecoder:
    """A `Decoder` (keel.rollout.protocol) over vLLM's engine step API: `join` adds one vLLM
    request per row (its SamplingParams: temperature, top_p, max_tokens, the EOS ids as stop
    ids, the sampled token's log-prob, a seed drawn from torch's generator), `step` runs vLLM's
    `LLMEngine.step` and hands out one token per live row, `leave` aborts the rows' requests.

    Where vLLM's step differs from the protocol's, tokens are buffered so that the protocol
    holds: vLLM prefills a joined row inside its next step (beside the running rows' decode)
    and schedules by a token budget, so one of its steps may give a row no token (a prompt
    longer than max_num_batched_tokens prefilled in chunks, rows past max_num_seqs waiting,
    a row preempted under KV-cache pressure, the one-step lag of async scheduling) or several
    (speculative decoding). `step` runs vLLM steps until every live row has a token, then gives
    each row its oldest one; a row that ran ahead keeps the rest for the next steps (which run
    no vLLM step while every row has one). Rows of different temperatures share the batch
    (log-probs under each row's own temperature: `install_row_logprobs`).

    vLLM's engine is the engine's: while rows are live, its `generate_ids` and
    `update_weights` refuse (RuntimeError)."""

    def __init__(self, engine: VLLMRolloutEngine):
        self._owner = engine
        self._rows: dict[Hashable, _Row] = {}  # join order
        self._keys: dict[str, Hashable] = {}  # vLLM request id → key
        self._closed = False

    @property
    def live(self) -> int:
        return len(self._rows)

    def join(self, rows: Sequence[RowRequest]) -> None:
        llm_engine = self._llm_engine()
        keys = [row.key for row in rows]
        clash = [k for k in keys if k in self._rows] or [k for k in keys if keys.count(k) > 1]
        if clash:
            raise ValueError(f"Decoder.join: the row key {clash[0]!r} is already live")
        if any(d.live for d in self._owner._decoders if d is not self):
            raise RuntimeError(
                "Decoder.join: another decoder of this vLLM engine has live rows (vLLM's step "
                "serves every request of the engine: one decoder at a time)"
            )
        for row in rows:
            self._owner._check_length([row.prompt_ids], row.sampling.max_new_tokens)
        added: list[str] = []
        try:
            for row in rows:
                greedy = row.sampling.temperature == 0
                params = self._owner._sampling_params(
                    row.sampling, greedy, self._owner._row_seed(), delta=True
                )
                request_id = f"keel-row-{next(ROW_REQUEST_IDS)}"
                prompt = {"prompt_token_ids": list(row.prompt_ids)}
                llm_engine.add_request(
                    request_id, prompt, params, lora_request=self._owner._adapter
                )
                added.append(request_id)
                self._rows[row.key] = _Row(request_id)
                self._keys[request_id] = row.key
        except Exception:
            self._drop([self._keys[r] for r in added], abort=True)
            raise

    def step(self) -> list[RowToken]:
        if self._closed:
            raise RuntimeError("this decoder is closed")
        if not self._rows:
            return []
        llm_engine = self._llm_engine()
        with eager_helpers(self._owner.eager), kept_rng():
            while any(not r.pending for r in self._rows.values()):
                if not llm_engine.has_unfinished_requests():
                    raise RuntimeError("vLLM ended a live row without a token (an engine error)")
                for output in llm_engine.step():
                    self._take(output)
        tokens: list[RowToken] = []
        for key, row in list(self._rows.items()):
            token, logprob = row.pending.popleft()
            finish = row.finish if row.finish is not None and not row.pending else None
            tokens.append(RowToken(key, token, logprob, finish))
            if finish is not None:
                self._drop([key], abort=False)
        return tokens

    def leave(self, keys: Iterable[Hashable]) -> None:
        self._drop([k for k in keys if k in self._rows], abort=True)

    def close(self) -> None:
        """Abort every live row's request (idempotent; the engine stays open)."""
        if not self._closed:
            if self._owner.llm is not None:
                self._drop(list(self._rows), abort=True)
            self._rows.clear()
            self._keys.clear()
            self._closed = True

    # -- helpers ---------------------------------------------------------------------------

    def _llm_engine(self) -> Any:
        if self._closed:
            raise RuntimeError("this decoder is closed")
        return self._owner._engine().llm_engine

    def _take(self, output: Any) -> None:
        """Buffer one vLLM RequestOutput's new tokens (DELTA outputs: only the new ones)."""
        key = self._keys.get(output.request_id)
        if key is None:  # a row that left: its last output may still arrive
            return
        row = self._rows[key]
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        row.pending.extend(zip(tokens, chosen_logprobs(completion.logprobs, tokens), strict=True))
        if output.finished:
            row.finish = finish_reason(completion.finish_reason)
            if not row.pending:
                raise RuntimeError(f"vLLM ended row {key!r} without a token")

    def _drop(self, keys: Sequence[Hashable], *, abort: bool) -> None:
        rows = [self._rows.pop(k) for k in keys]
        for row in rows:
            self._keys.pop(row.request_id, None)
        running = [r.request_id for r in rows if r.finish is None]
        if abort and running and self._owner.llm is not None:
            self._owner.llm.llm_engine.abort_request(running)


def finish_reason(vllm_reason: str | None) -> str:
    """Keel's finish reason for vLLM's: "stop" (a stop token id: one of the EOS ids) or
    "length" (max_tokens); anything else is an engine error."""
    if vllm_reason in ("stop", "length"):
        return vllm_reason
    raise RuntimeError(f"vLLM ended a row with finish reason {vllm_reason!r}")


def chosen_logprobs(step_logprobs: Any, tokens: Sequence[int]) -> list[float]:
    """The log-prob of each generated token, from vLLM's per-step {token id: Logprob} (the
    sampled token is always among them)."""
    if step_logprobs is None:
        raise RuntimeError("vLLM returned no log-probs (SamplingParams.logprobs=0 was asked)")
    return [float(step[tok].logprob) for step, tok in zip(step_logprobs, tokens, strict=True)]
