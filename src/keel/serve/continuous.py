"""Continuous batching: one scheduler thread owns one `Decoder` of the served engine
(`keel.rollout.protocol`) and runs it step by step; requests join and leave its running decode
batch at token granularity.

Each turn of the loop: the waiting jobs join (oldest first, while their rows fit in
serve.max_batch_size live rows; a job bigger than that joins alone once none is live; while
PACED_ROWS or more rows are live, every JOIN_EVERY steps or once the waiting rows are a
quarter of them), one
`step` decodes a token for every live row, and each token goes to its row: it is detokenised
incrementally (`TextStream`), the row's text so far is searched for the request's stop strings
(a match ends the row there: it leaves the decoder, its text is cut before the stop and its
finish reason is "stop"), and the text that can no longer become part of a stop is handed to
the request's `on_delta` (streams) as `Delta`s. A finished row frees its slot at once; a job's
future resolves, with one `Generation` per row, when its last row is done. Rows of any
sampling settings share the batch (each row carries its own).

The surface is the batching queue's (`keel.serve.batching.BatchingQueue`), which `Served`
uses: `submit` (QueueFull, QueueClosed), `between_batches` (weight swaps: run on the scheduler
thread with admissions paused, once no row is live; the decoder is reopened on the new weights
after), `depth`, `pending`, `accepting`, `pause`/`resume` (no admissions meanwhile: live rows
decode on), `close` (drains). `on_batch` hears of every join (its rows, jobs, the seconds of
the prefill, the longest wait) as the queue's hook hears of a batch; `on_first_token` hears,
per job, the seconds from its submission to its first decoded token (TTFT).

A job whose caller is gone (its future cancelled while it decodes: the HTTP stream closed, the
gRPC call cancelled) leaves the decoder at the next step and fails with CancelledError.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any

from keel.chatapi.responses import first_stop, kept_pieces
from keel.data.examples import Example
from keel.rollout.protocol import Decoder, DecodingEngine, RowRequest, RowToken, SamplingParams
from keel.serve.batching import BatchReport, WorkQueue, _run_task
from keel.serve.generation import Generation, GenerationRunner

# `Any` here: the tokenizer (transformers types its decode() wider than it is).

# While PACED_ROWS or more rows are live, waiting jobs join every JOIN_EVERY steps (or sooner
# once their rows are a quarter of the live ones): a join costs a prefill forward and a rebuild
# of the batch's cache, as much as a decode step, so joining at every step halves the tokens
# per second (8.8 against 4.2 ms per step at 60 live rows on the tiny model), for a time to
# first token at most JOIN_EVERY − 1 steps longer. Below PACED_ROWS (a light load) they join
# at the next step.
JOIN_EVERY = 4
PACED_ROWS = 16


@dataclass(frozen=True)
class Delta:
    """What one row of a job adds to its stream at one step: `index`, the row's place in its
    job; `pieces`, the text each newly released token adds (in order; "" for a token that adds
    none, e.g. the first half of a character) and `logprobs`, theirs; `finish`, None while the
    row goes on, else its finish reason ("stop": an EOS or a stop string; "length")."""

    index: int
    pieces: tuple[str, ...]
    logprobs: tuple[float, ...]
    finish: str | None = None


OnDelta = Callable[[Delta], None]


class JobFuture(Future):
    """A job's future: `cancel()` of a job already decoding marks it abandoned (its rows then
    leave the decoder and the future fails with CancelledError) where a plain future could
    not be cancelled any more."""

    abandoned = False

    def cancel(self) -> bool:
        if super().cancel():
            return True
        if not self.done():
            self.abandoned = True
        return False


class TextStream:
    """Incremental detokenisation of one row: `push(token)` gives the text the token adds.

    The text is decoded from a window that starts a few tokens back (`prefix`), and a token
    adds the part of the window's text past what the window showed without it, so tokenizers
    that drop a word's leading space at the start of a text, or merge bytes into characters,
    come out as a whole-text decode does; a token that ends in half a character adds "" until
    the rest comes (or `flush()` at the end gives what is left)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # the window's first token
        self.read = 0  # tokens whose text is already given out

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        self.ids.append(token)
        shown = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        if len(text) <= len(shown) or text.endswith("\ufffd"):
            return ""  # nothing new yet (half a character, or a token without text)
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(shown) :]

    def flush(self) -> str:
        """What the tokens not given out yet add (at a row's end)."""
        if self.read == len(self.ids):
            return ""
        shown = self._decode(self.ids[self.prefix : self.read])
        text = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return text[len(shown) :]


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` may yet begin a stop string (the longest end
    of `text` that is a proper beginning of one): a stream holds them until it knows."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


@dataclass
class _Job:
    requests: list[RowRequest]  # keys are assigned when the job joins
    stops: tuple[str, ...]
    on_delta: OnDelta | None
    future: JobFuture = field(default_factory=JobFuture)
    enqueued: float = field(default_factory=time.monotonic)
    results: list[Generation | None] = field(default_factory=list)
    remaining: int = 0
    started: bool = False  # its first token came


@dataclass
class _Row:
    job: _Job
    index: int
    text: TextStream
    step: int | None
    ids: list[int] = field(default_factory=list)  # generated tokens but a closing EOS
    logprobs: list[float] = field(default_factory=list)
    pieces: list[str] = field(default_factory=list)
    joined: str = ""  # "".join(pieces)
    tokens: int = 0  # every generated token, a closing EOS included
    released: int = 0  # tokens handed to the stream
    released_chars: int = 0
    finish: str | None = None

    def add(self, token: RowToken) -> Delta | None:
        """Take one decoded token; what the stream may show now (None: nothing new)."""
        self.tokens += 1
        if token.finish != "stop":  # an EOS closes the row and adds no text
            self.ids.append(token.token)
            self.logprobs.append(token.logprob)
            piece = self.text.push(token.token)
            self.pieces.append(piece)
            self.joined += piece
        if token.finish is not None:
            rest = self.text.flush()
            if rest and self.pieces:
                self.pieces[-1] += rest
                self.joined += rest
            self.finish = token.finish
        stops = self.job.stops
        cut = first_stop(self.joined, stops) if stops else None
        if cut is not None:
            self.finish = "stop"
            kept = kept_pieces(self.pieces, cut)
        elif self.finish is not None:
            kept = self.pieces
        else:  # hold the tail that may begin a stop, and a last token waiting for its rest
            limit = len(self.joined) - held_back(self.joined, stops)
            kept, chars = self.pieces[: self.released], self.released_chars
            for i in range(self.released, len(self.pieces)):
                piece = self.pieces[i]
                if chars + len(piece) > limit or (i == len(self.pieces) - 1 and not piece):
                    break
                kept.append(piece)
                chars += len(piece)
        new = kept[self.released :]
        start = self.released
        self.released = len(kept)
        self.released_chars = sum(len(p) for p in kept)
        if not new and self.finish is None:
            return None
        logprobs = tuple(self.logprobs[start : start + len(new)])
        return Delta(self.index, tuple(new), logprobs, self.finish)

    def generation(self) -> Generation:
        """The finished row (the text whole: `answer` cuts it at the stop as the stream did)."""
        assert self.finish is not None
        return Generation(
            token_ids=self.ids,
            text=self.joined,
            logprobs=self.logprobs,
            tokens=self.tokens,
            finish_reason=self.finish,
            step=self.step,
            pieces=self.pieces,
        )


class ContinuousScheduler(WorkQueue[_Job]):
    """Jobs in, one decoder stepped on one thread, rows joining and leaving per token (see
    the module doc).

    runner: the served engine (a `DecodingEngine`) with the step of its weights and how it
    encodes prompts. max_rows: most live rows (serve.max_batch_size). max_pending: most jobs
    submitted and not yet finished. on_batch: hears every join; on_first_token: each job's
    seconds to its first token (both on the scheduler thread)."""

    def __init__(
        self,
        runner: GenerationRunner,
        *,
        max_rows: int,
        max_pending: int,
        on_batch: Callable[[BatchReport], None] = lambda report: None,
        on_first_token: Callable[[float], None] = lambda seconds: None,
        name: str = "keel-continuous",
    ):
        if not isinstance(runner.engine, DecodingEngine):
            raise TypeError(f"{type(runner.engine).__name__} has no decoder() (no step API)")
        super().__init__(max_pending, name)
        self.runner = runner
        self.max_rows = max_rows
        self.on_batch = on_batch
        self.on_first_token = on_first_token
        self._decoder: Decoder | None = None  # opened on the scheduler thread
        self._jobs: deque[_Job] = deque()
        self._rows: dict[Hashable, _Row] = {}  # the live rows by key (the scheduler thread's)
        self._live_jobs: list[_Job] = []
        self._keys = itertools.count()
        self._since_join = 0  # decode steps since the last join
        self._thread.start()

    # ------------------------------------------------------------------ the submitting side
    def submit(
        self,
        key: SamplingParams,
        rows: list[Example],
        stops: Sequence[str] = (),
        on_delta: OnDelta | None = None,
    ) -> Future[list[Generation]]:
        """Queue a job of rows sampled with `key` (n is ignored: a row is one response),
        ended early by `stops`; `on_delta` (called on the scheduler thread) gets the stream.
        The future gives one Generation per row. Raises QueueFull, QueueClosed."""
        prompt_ids = self.runner.encode(rows)  # on the caller's thread, not the scheduler's
        requests = [RowRequest(None, ids, key) for ids in prompt_ids]
        job = _Job(requests, tuple(s for s in stops if s), on_delta)
        self._enqueue(job)
        return job.future

    @property
    def live(self) -> int:
        """Rows decoding now."""
        return len(self._rows)

    def _row_count(self, job: _Job) -> int:
        return len(job.requests)

    # ------------------------------------------------------------------ the scheduler thread
    def _work(self) -> None:
        try:
            while True:
                task = None
                with self._cond:
                    while self._idle():
                        self._cond.wait()
                    if self._closed and not (self._jobs or self._tasks or self._rows):
                        return  # closed and drained
                    if self._tasks and not self._rows and not self._paused:
                        task, done = self._tasks.popleft()
                        joining = []
                    elif self._tasks or self._paused:
                        joining = []  # a task waits for the live rows to finish
                    else:
                        joining = self._admit()
                if task is not None:
                    _run_task(task, done)
                    self._reopen()  # the decoder opens again on the new weights
                    continue
                self._drop_abandoned()
                if joining:
                    self._join(joining)
                if self._rows:
                    self._step()
        finally:
            self._reopen()

    def _idle(self) -> bool:
        """Nothing to do (lock held): no live row, not closing, and nothing queued or paused."""
        if self._rows or self._closed:
            return False
        return self._paused or not (self._jobs or self._tasks)

    def _admit(self) -> list[_Job]:
        """The oldest waiting jobs whose rows fit beside the live ones (lock held); while
        PACED_ROWS or more are live, only every JOIN_EVERY steps or once the waiting rows are a
        quarter of them."""
        chosen: list[_Job] = []
        if len(self._rows) >= PACED_ROWS and self._since_join < JOIN_EVERY:
            waiting = sum(len(job.requests) for job in self._jobs)
            if 4 * waiting < len(self._rows):
                return chosen
        free = self.max_rows - len(self._rows)
        while self._jobs:
            job = self._jobs[0]
            size = len(job.requests)
            alone = size > self.max_rows and not self._rows and not chosen
            if size > free and not alone:
                break
            self._jobs.popleft()
            if job.future.set_running_or_notify_cancel():  # else cancelled while it waited
                chosen.append(job)
                free -= size
        return chosen

    def _open(self) -> Decoder:
        if self._decoder is None:
            engine = self.runner.engine
            assert isinstance(engine, DecodingEngine)
            self._decoder = engine.decoder()
        return self._decoder

    def _reopen(self) -> None:
        if self._decoder is not None:
            with contextlib.suppress(Exception):
                self._decoder.close()
            self._decoder = None

    def _join(self, jobs: list[_Job]) -> None:
        """The jobs' rows join the decoder in one call (one prefill); if it refuses them (a
        prompt too long for the engine), each job joins alone, and only those it refuses fail."""
        self._since_join = 0
        start = time.monotonic()
        waited = start - min(job.enqueued for job in jobs)
        every = [req for job in jobs for req in self._rows_of(job)]
        error: BaseException | None = None
        joined: list[_Job] = []
        try:
            self._open().join(every)
            joined = jobs
        except Exception as exc:
            self._forget(every)
            error = exc
            if len(jobs) == 1:
                jobs[0].future.set_exception(exc)
            else:
                for job in jobs:
                    mine = self._rows_of(job)
                    try:
                        self._open().join(mine)
                        joined.append(job)
                    except Exception as alone:
                        self._forget(mine)
                        job.future.set_exception(alone)
        with contextlib.suppress(Exception):  # a metrics hook must never stop the scheduler
            seconds = time.monotonic() - start
            size = sum(len(job.requests) for job in joined or jobs)
            failed = error if not joined else None
            self.on_batch(BatchReport(size, len(joined or jobs), seconds, waited, failed))
        self._live_jobs.extend(joined)

    def _rows_of(self, job: _Job) -> list[RowRequest]:
        """The job's rows under fresh keys, live from now on (its results reset)."""
        job.results = [None] * len(job.requests)
        job.remaining = len(job.requests)
        out = []
        for i, req in enumerate(job.requests):
            key = next(self._keys)
            self._rows[key] = _Row(job, i, TextStream(self.runner.tokenizer), self.runner.step)
            out.append(RowRequest(key, req.prompt_ids, req.sampling))
        return out

    def _forget(self, requests: list[RowRequest]) -> None:
        """Rows a join refused: no longer live here, nor in the decoder if any got in."""
        for req in requests:
            self._rows.pop(req.key, None)
        with contextlib.suppress(Exception):
            self._open().leave([req.key for req in requests])

    def _step(self) -> None:
        self._since_join += 1
        try:
            tokens = self._open().step()
        except Exception as exc:  # every live request fails; a fresh decoder for the next
            self._fail_live(exc)
            return
        now = time.monotonic()
        leaving = []
        for token in tokens:
            row = self._rows.get(token.key)
            if row is None:
                continue
            job = row.job
            if not job.started:
                job.started = True
                with contextlib.suppress(Exception):
                    self.on_first_token(now - job.enqueued)
            delta = row.add(token)
            if delta is not None and job.on_delta is not None:
                with contextlib.suppress(Exception):  # a broken stream must not stop us
                    job.on_delta(delta)
            if row.finish is not None:
                del self._rows[token.key]
                if token.finish is None:
                    leaving.append(token.key)  # a stop string: the decoder still holds it
                self._done(row)
        if leaving:
            try:
                self._open().leave(leaving)
            except Exception as exc:
                self._fail_live(exc)

    def _done(self, row: _Row) -> None:
        job = row.job
        job.results[row.index] = row.generation()
        job.remaining -= 1
        if job.remaining == 0:
            self._live_jobs.remove(job)
            results = [g for g in job.results if g is not None]
            job.future.set_result(results)

    def _drop_abandoned(self) -> None:
        """Rows of jobs whose callers are gone leave the decoder; the jobs fail."""
        gone = [job for job in self._live_jobs if job.future.abandoned]
        if not gone:
            return
        keys = [key for key, row in self._rows.items() if row.job in gone]
        for key in keys:
            del self._rows[key]
        for job in gone:
            self._live_jobs.remove(job)
            job.future.set_exception(CancelledError("the caller is gone"))
        try:
            self._open().leave(keys)
        except Exception as exc:
            self._fail_live(exc)

    def _fail_live(self, exc: BaseException) -> None:
        self._rows.clear()
        for job in self._live_jobs:
            job.future.set_exception(exc)
        self._live_jobs.clear()
        self._reopen()
