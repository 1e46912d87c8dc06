"""The distillation teacher: a frozen model that scores the student's own tokens.

One method, `compute_teacher_logprobs(batch)`, fills `teacher_logprobs` [B, R] with
τ_bt = log π_T(y_t | x, y_<t) for every response token, and for the top-k forward KL
`teacher_topk_ids` / `teacher_topk_logprobs` [B, R, K] (the teacher's K most likely next tokens
at each response position and their log-probs, rank-ordered). The teacher runs at temperature 1
whatever the rollout's temperature (its distribution is the target, not a sampler).

Both teachers go through one path: each row is compacted to its real tokens (the attention
mask's), the teacher gives the log-prob of every token after the first given its prefix
(`sequence_logprobs`, what `keel serve`'s /v1/prompt_logprobs returns), and
`response_values` reads those at the response tokens' positions back into the batch's columns:
`TeacherWorker` holds the model in this process; `RemoteTeacher` asks a `keel serve` over HTTP.
"""

from __future__ import annotations

import json
import math
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import torch

from keel.engine.devices import autocast, model_device
from keel.engine.forward import position_ids_from_mask
from keel.models.tokenizer_match import TokenizerFingerprint, check_fingerprint
from keel.rewards.remote import RETRIED_STATUS
from keel.types import Batch, TokenBatch


@dataclass
class SequenceLogprobs:
    """One sequence's log-probs: logprobs [L] float with logprobs[i] = log π(x_i | x_<i) for
    i ≥ 1 (logprobs[0] = NaN: the first token has no prefix); with top-k, top_ids [L, K] long
    and top_logprobs [L, K] float, row i the K most likely tokens at position i given x_<i
    (row 0: ids −1, log-probs NaN)."""

    logprobs: torch.Tensor
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


@torch.no_grad()
def sequence_logprobs(
    model: Any,
    sequences: list[list[int]],
    *,
    topk: int = 0,
    batch_size: int = 8,
    dtype: torch.dtype | None = None,
) -> list[SequenceLogprobs]:
    """The log-probs of every token of each sequence given its prefix, at temperature 1.

    sequences: token ids (no padding), each of length L_i ≥ 1. Runs `batch_size` sequences per
    forward pass, right-padded; logits in float32. topk > 0 also returns each position's top-k.
    """
    out: list[SequenceLogprobs] = []
    device = model_device(model)
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start : start + batch_size]
        width = max(len(s) for s in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        attention = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, seq in enumerate(chunk):
            ids[i, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            attention[i, : len(seq)] = 1
        ids, attention = ids.to(device), attention.to(device)
        with autocast(device, dtype):
            logits = model(
                input_ids=ids,
                attention_mask=attention,
                position_ids=position_ids_from_mask(attention),
                use_cache=False,
            ).logits
        logp = torch.log_softmax(logits.float(), dim=-1)[:, :-1]  # row t predicts token t+1
        chosen = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
        nan = torch.full((len(chunk), 1), math.nan, device=device)
        chosen = torch.cat([nan, chosen], dim=1).cpu()
        top_lp = top_ids = None
        if topk:
            values, indices = logp.topk(topk, dim=-1)
            top_lp = torch.cat([torch.full((len(chunk), 1, topk), math.nan, device=device),
                                values], dim=1).cpu()  # fmt: skip
            top_ids = torch.cat([torch.full((len(chunk), 1, topk), -1, device=device,
                                            dtype=torch.long), indices], dim=1).cpu()  # fmt: skip
        for i, seq in enumerate(chunk):
            n = len(seq)
            out.append(
                SequenceLogprobs(
                    chosen[i, :n],
                    None if top_ids is None else top_ids[i, :n],
                    None if top_lp is None else top_lp[i, :n],
                )
            )
    return out


def compact_rows(batch: Batch) -> list[list[int]]:
    """Each row's real tokens (prompt and response, where the attention mask is 1), in order."""
    tokens = batch.view(TokenBatch)
    return [
        row[mask.bool()].tolist()
        for row, mask in zip(tokens.input_ids, tokens.attention_mask, strict=True)
    ]


def response_values(
    batch: Batch, rows: list[SequenceLogprobs]
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(teacher_logprobs [B, R], teacher_topk_ids [B, R, K] or None, teacher_topk_logprobs
    [B, R, K] or None) of the batch's response columns, read from the compacted rows'
    `sequence_logprobs`: the response token in column P + c of row b is real token j of the row
    (j = the number of real tokens before it), and its teacher value is rows[b].logprobs[j] =
    log π_T(y | everything before it). Columns without a real token get 0 (ids 0)."""
    real = batch.view(TokenBatch).attention_mask.bool()
    p, r = batch.prompt_length, batch.response_length
    index = real.long().cumsum(dim=1) - 1  # [B, T]: a real token's place in its compacted row
    b = len(batch)
    values = torch.zeros(b, r)
    k = rows[0].top_ids.shape[1] if rows and rows[0].top_ids is not None else 0
    ids = torch.zeros(b, r, k, dtype=torch.long) if k else None
    lps = torch.zeros(b, r, k) if k else None
    for i, row in enumerate(rows):
        cols = torch.nonzero(real[i, p:], as_tuple=False).squeeze(1)  # response columns c
        at = index[i, p + cols]  # their compacted positions j
        values[i, cols] = row.logprobs[at].float()
        if ids is not None and lps is not None:
            assert row.top_ids is not None and row.top_logprobs is not None
            ids[i, cols] = row.top_ids[at]
            lps[i, cols] = row.top_logprobs[at].float()
    return values, ids, lps


class TeacherWorker:
    """A frozen teacher model in this process (eval mode, no gradients).

    topk: K of the top-k forward KL (0: only the sampled tokens' log-probs); micro_batch_size:
    rows per forward pass; dtype: autocast dtype of its forwards (None: as the weights are)."""

    def __init__(
        self, model: Any, *, micro_batch_size: int, topk: int = 0, dtype: torch.dtype | None = None
    ):
        self.model = model
        self.model.eval()
        self.model.requires_grad_(False)
        self.micro_batch_size = micro_batch_size
        self.topk = topk
        self.dtype = dtype

    def compute_teacher_logprobs(self, batch: Batch) -> Batch:
        """Fills teacher_logprobs [B, R] (and with top-k, teacher_topk_ids/_logprobs)."""
        rows = sequence_logprobs(
            self.model,
            compact_rows(batch),
            topk=self.topk,
            batch_size=self.micro_batch_size,
            dtype=self.dtype,
        )
        return _filled(batch, rows)


def _filled(batch: Batch, rows: list[SequenceLogprobs]) -> Batch:
    values, ids, lps = response_values(batch, rows)
    return batch.replace(teacher_logprobs=values, teacher_topk_ids=ids, teacher_topk_logprobs=lps)


class TeacherServiceError(RuntimeError):
    """The teacher's server refused or failed a request; the message has its status and reply."""


class RemoteTeacher:
    """A teacher behind `keel serve`'s POST /v1/prompt_logprobs (docs/serving.md): rows sent
    `batch_size` at a time, each attempt within `timeout_s`, retried `retries` times on a
    connection error or a 429/5xx. The server's tokenizer fingerprint is checked against the
    student's at construction and on every reply (a TokenizerMismatchError naming both)."""

    def __init__(
        self,
        url: str,
        student_tokenizer: Any,
        *,
        student_name: str,
        topk: int = 0,
        batch_size: int = 16,
        timeout_s: float = 300.0,
        retries: int = 2,
        api_key: str | None = None,
    ):
        self.url = url.rstrip("/")
        self.endpoint = self.url + "/v1/prompt_logprobs"
        self.topk = topk
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self.retries = retries
        self.api_key = api_key
        reply = self._post({"token_ids": [[0]], "top_k": 0})  # the probe: its tokenizer
        self.fingerprint = _fingerprint(reply, self.endpoint)
        check_fingerprint(
            student_tokenizer, self.fingerprint, student_name, f"the teacher at {url}"
        )

    def compute_teacher_logprobs(self, batch: Batch) -> Batch:
        sequences = compact_rows(batch)
        rows: list[SequenceLogprobs] = []
        for start in range(0, len(sequences), self.batch_size):
            chunk = sequences[start : start + self.batch_size]
            reply = self._post({"token_ids": chunk, "top_k": self.topk})
            if _fingerprint(reply, self.endpoint) != self.fingerprint:
                raise TeacherServiceError(f"{self.endpoint}: the server's tokenizer changed")
            rows.extend(_parse_rows(reply, chunk, self.topk, self.endpoint))
        return _filled(batch, rows)

    def _post(self, body: dict[str, Any]) -> Any:
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(self.endpoint, data=data, headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return json.loads(response.read())
            except urllib.error.HTTPError as exc:
                text = exc.read().decode("utf-8", "replace")[:300]
                if exc.code not in RETRIED_STATUS or attempt == self.retries:
                    raise TeacherServiceError(f"{self.endpoint}: HTTP {exc.code}: {text}") from None
            except OSError as exc:
                if attempt == self.retries:
                    raise TeacherServiceError(
                        f"{self.endpoint}: {attempt + 1} attempts failed, the last with {exc}"
                    ) from exc
            time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")


def _fingerprint(reply: Any, where: str) -> TokenizerFingerprint:
    tok = reply.get("tokenizer") if isinstance(reply, dict) else None
    if not isinstance(tok, dict) or "vocab_size" not in tok or "sha256" not in tok:
        raise TeacherServiceError(f"{where} answered without its tokenizer: {str(reply)[:200]}")
    return TokenizerFingerprint(int(tok["vocab_size"]), str(tok["sha256"]))


def _parse_rows(
    reply: dict[str, Any], sequences: list[list[int]], topk: int, where: str
) -> list[SequenceLogprobs]:
    data = reply.get("data")
    if not isinstance(data, list) or len(data) != len(sequences):
        raise TeacherServiceError(f"{where} answered {str(reply)[:200]} for {len(sequences)} rows")
    rows = []
    for item, seq in zip(data, sequences, strict=True):
        lps = item.get("logprobs")
        if not isinstance(lps, list) or len(lps) != len(seq):
            raise TeacherServiceError(f"{where}: a row of {len(seq)} tokens got {str(lps)[:100]}")
        values = torch.tensor([math.nan if v is None else float(v) for v in lps])
        top_ids = top_lps = None
        if topk:
            top = item.get("top_logprobs")
            if not isinstance(top, list) or len(top) != len(seq):
                raise TeacherServiceError(f"{where}: no top_logprobs for a row of {len(seq)}")
            top_ids = torch.full((len(seq), topk), -1, dtype=torch.long)
            top_lps = torch.full((len(seq), topk), math.nan)
            for i, entries in enumerate(top):
                if entries:
                    top_ids[i] = torch.tensor([int(e[0]) for e in entries[:topk]])
                    top_lps[i] = torch.tensor([float(e[1]) for e in entries[:topk]])
        rows.append(SequenceLogprobs(values, top_ids, top_lps))
    return rows


TEACHER_API_KEY_ENV = "KEEL_TEACHER_API_KEY"


def teacher_api_key() -> str | None:
    """The bearer token of a remote teacher: the environment variable KEEL_TEACHER_API_KEY."""
    return os.environ.get(TEACHER_API_KEY_ENV) or None
