"""The continuous batching scheduler (keel.serve.continuous) on a scripted decoder whose steps
the test lets through one at a time: rows join a running batch without waiting for it, a
finished row frees its slot at once, stop strings end a row in the loop (it leaves the
decoder), streams see only text that cannot become a stop, weight swaps wait for the live rows,
a caller gone leaves the decoder, the queue's limits and drain; and the incremental
detokeniser against the whole-text one."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from keel.chatapi.responses import answer, token_pieces
from keel.data.examples import Example
from keel.models.tokenizer import build_char_tokenizer
from keel.rollout.protocol import RowRequest, RowToken, SamplingParams
from keel.serve.batching import QueueClosed, QueueFull
from keel.serve.continuous import ContinuousScheduler, Delta, TextStream, held_back
from keel.serve.generation import GenerationRunner
from tests.serve.live_server import wait_until

TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id


class ScriptedDecoder:
    """A Decoder whose row answers its prompt's script (SCRIPTS) one character per step, then
    an EOS; `max_new_tokens` cuts it ("length"). Each `step` waits for a permit (`allow`), so
    the test decides when the batch moves; it records the live keys of every step and the keys
    that left."""

    def __init__(self, engine: ScriptedEngine):
        self.engine = engine
        self.rows: dict[object, tuple[list[int], int, int]] = {}  # key → script, done, budget
        self.order: list[object] = []
        self.steps: list[list[object]] = []
        self.left: list[object] = []

    @property
    def live(self) -> int:
        return len(self.rows)

    def join(self, rows) -> None:
        for row in rows:
            assert isinstance(row, RowRequest)
            prompt = TOKENIZER.decode(list(row.prompt_ids))
            script = [*TOKENIZER.encode(SCRIPTS[prompt], add_special_tokens=False), EOS]
            self.rows[row.key] = (script, 0, row.sampling.max_new_tokens)
            self.order.append(row.key)

    def step(self) -> list[RowToken]:
        self.engine.enter()
        out = []
        self.steps.append(list(self.order))
        for key in list(self.order):
            script, done, budget = self.rows[key]
            token = script[done]
            finish = "stop" if token == EOS else "length" if done + 1 == budget else None
            out.append(RowToken(key, token, -0.5, finish))
            self.rows[key] = (script, done + 1, budget)
            if finish:
                self.leave([key])
                self.left.pop()  # finished, not left
        return out

    def leave(self, keys) -> None:
        for key in keys:
            if key in self.rows:
                del self.rows[key]
                self.order.remove(key)
                self.left.append(key)

    def close(self) -> None:
        self.rows.clear()
        self.order.clear()


SCRIPTS = {
    "long": "abcdefghijklmnopqrstuvwxyz" * 10,
    "short": "xy",
    "stop": "one two. three four",
    "held": "ab<cd",
}


class ScriptedEngine:
    """What the scheduler asks of an engine: prompt encoding, and decoder() (each one kept)."""

    tokenizer = TOKENIZER
    chat = False
    max_prompt_length = 32
    truncation = "error"

    def __init__(self):
        self.decoders: list[ScriptedDecoder] = []
        self.permits = threading.Semaphore(0)
        self.entered = 0  # steps begun, over every decoder
        self.cond = threading.Condition()

    def decoder(self) -> ScriptedDecoder:
        self.decoders.append(ScriptedDecoder(self))
        return self.decoders[-1]

    def close(self) -> None:
        pass

    def enter(self) -> None:
        with self.cond:
            self.entered += 1
            self.cond.notify_all()
        assert self.permits.acquire(timeout=30), "the test let no step through"

    def release(self, steps: int) -> None:
        """Let `steps` more steps through."""
        for _ in range(steps):
            self.permits.release()

    def blocked(self, step: int) -> None:
        """Wait until the scheduler is inside its `step`-th step (waiting for its permit):
        what is submitted now joins after that step."""
        with self.cond:
            assert self.cond.wait_for(lambda: self.entered >= step, 30), f"no step {step}"


@pytest.fixture
def engine():
    return ScriptedEngine()


def scheduler(engine, **kw) -> ContinuousScheduler:
    opts = {"max_rows": 4, "max_pending": 8, **kw}
    return ContinuousScheduler(GenerationRunner(engine, step=3), **opts)  # type: ignore[arg-type]


def submit(s: ContinuousScheduler, prompt: str, max_tokens: int = 200, n: int = 1, **kw):
    sampling = SamplingParams(temperature=0, max_new_tokens=max_tokens)
    return s.submit(sampling, [Example(prompt=prompt, source="t")] * n, **kw)


def test_a_row_joins_the_running_batch_and_a_finished_row_frees_its_slot(engine):
    reports = []
    s = scheduler(engine, on_batch=reports.append)
    long = submit(s, "long")
    engine.release(2)
    engine.blocked(3)  # the long row alone for two steps, the third waiting
    short = submit(s, "short", n=2)
    engine.release(4)  # the third step, then x, y, EOS for the short rows beside the long one
    shorts = short.result(30)
    assert [g.text for g in shorts] == ["xy", "xy"] and shorts[0].finish_reason == "stop"
    assert shorts[0].tokens == 3 and shorts[0].token_ids == TOKENIZER.encode("xy")
    assert shorts[0].step == 3 and shorts[0].logprobs == [-0.5, -0.5]
    engine.blocked(7)
    assert not long.done()  # the short rows did not wait for the long one
    decoder = engine.decoders[0]
    assert [len(keys) for keys in decoder.steps] == [1, 1, 1, 3, 3, 3]
    assert s.live == 1  # the finished rows freed their slots at once
    assert [(r.rows, r.jobs) for r in reports] == [(1, 1), (2, 1)]
    engine.release(200 - 6)
    (gen,) = long.result(30)
    assert gen.finish_reason == "length" and gen.tokens == 200 and len(gen.logprobs) == 200
    assert [len(keys) for keys in decoder.steps[6:]] == [1] * (200 - 6)
    s.close()


def test_a_job_too_big_for_the_free_slots_waits_for_them_oldest_first(engine):
    s = scheduler(engine)
    first = submit(s, "short", n=3)
    engine.blocked(1)
    wide = submit(s, "short", n=2)  # 2 rows, 1 slot free: it waits
    later = submit(s, "short")  # it would fit, but joins after the older job
    engine.release(1)
    engine.blocked(2)
    assert s.live == 3 and s.depth == 3
    engine.release(2)  # y, EOS: the first job's slots free up
    first.result(30)
    engine.release(3)
    wide.result(30), later.result(30)
    assert [len(k) for k in engine.decoders[0].steps] == [3, 3, 3, 3, 3, 3]
    s.close()


def test_under_load_waiting_rows_join_every_few_steps_or_once_they_are_many(engine):
    """With PACED_ROWS live rows a new row joins at the JOIN_EVERY-th step after the last join
    (not the next one); a quarter of the live rows waiting join at the next step."""
    from keel.serve.continuous import JOIN_EVERY, PACED_ROWS

    s = scheduler(engine, max_rows=64, max_pending=64)
    long = submit(s, "long", n=PACED_ROWS)  # joins at once: nothing was live
    engine.blocked(1)
    one = submit(s, "short")  # 1 row waiting beside 16 live: it waits for the paced join
    engine.release(JOIN_EVERY)
    engine.blocked(JOIN_EVERY + 1)
    decoder = engine.decoders[0]
    assert [len(k) for k in decoder.steps] == [PACED_ROWS] * JOIN_EVERY  # no join before
    many = submit(s, "short", n=PACED_ROWS // 4 + 1)  # a quarter of the live rows: at once
    engine.release(1)
    engine.blocked(JOIN_EVERY + 2)
    assert len(decoder.steps[JOIN_EVERY]) == PACED_ROWS + 1  # the one row joined at step 5
    engine.release(1)
    engine.blocked(JOIN_EVERY + 3)
    assert len(decoder.steps[JOIN_EVERY + 1]) == PACED_ROWS + 1 + PACED_ROWS // 4 + 1
    long.cancel(), engine.release(400)
    one.result(30), many.result(30)
    s.close()


def test_a_stop_string_ends_the_row_in_the_loop_and_the_stream_never_shows_it(engine):
    deltas: list[Delta] = []
    s = scheduler(engine)
    future = submit(s, "stop", stops=[". th", "zz"], on_delta=deltas.append)
    engine.release(len("one two. th"))
    (gen,) = future.result(30)
    decoder = engine.decoders[0]
    assert decoder.left and decoder.live == 0  # it left: no more steps for it
    assert len(decoder.steps) == len("one two. th")
    streamed = "".join(p for d in deltas for p in d.pieces)
    assert streamed == "one two" and deltas[-1].finish == "stop"
    assert all(d.finish is None for d in deltas[:-1])
    a = answer(gen, [". th", "zz"], TOKENIZER, per_token=True)
    assert a.text == "one two" and a.finish_reason == "stop" and a.pieces == list("one two")
    assert a.tokens == 7 and a.logprobs == [-0.5] * 7 and gen.tokens == len("one two. th")
    s.close()


def test_text_that_may_begin_a_stop_is_held_until_it_cannot(engine):
    deltas: list[Delta] = []
    s = scheduler(engine)
    future = submit(s, "held", stops=["<x"], on_delta=deltas.append)
    engine.release(3)  # "ab<": "<" may begin "<x"
    engine.blocked(4)
    assert "".join(p for d in deltas for p in d.pieces) == "ab" and len(deltas) == 2
    engine.release(1)  # "c": it cannot
    engine.blocked(5)
    assert deltas[-1].pieces == ("<", "c")
    engine.release(2)
    (gen,) = future.result(30)
    assert gen.text == "ab<cd" and gen.finish_reason == "stop"  # the EOS
    assert "".join(p for d in deltas for p in d.pieces) == "ab<cd"
    s.close()


def test_weights_swap_once_no_row_is_live_and_the_decoder_reopens(engine):
    s = scheduler(engine)
    first = submit(s, "short")
    engine.blocked(1)
    swapped = s.between_batches(lambda: "loaded")
    second = submit(s, "short")  # waits for the swap, which waits for the live row
    engine.release(3)
    first.result(30)
    assert swapped.result(30) == "loaded"
    assert [len(k) for k in engine.decoders[0].steps] == [1, 1, 1]
    engine.release(3)
    assert second.result(30)[0].text == "xy"
    assert len(engine.decoders) == 2  # a fresh decoder on the new weights
    s.close()


def test_a_caller_gone_leaves_the_decoder_and_its_job_fails(engine):
    s = scheduler(engine)
    gone = submit(s, "long")
    stays = submit(s, "short")
    engine.blocked(1)
    assert not gone.cancel()  # decoding: not cancellable, but abandoned
    engine.release(5)
    assert stays.result(30)[0].text == "xy"
    with pytest.raises(CancelledError):
        gone.result(30)
    assert engine.decoders[0].left  # it left the decoder
    wait_until(lambda: s.pending == 0, "no job pending")
    assert s.live == 0
    s.close()


def test_limits_pause_and_a_draining_close(engine):
    s = scheduler(engine, max_pending=2)
    s.pause()
    a, b = submit(s, "short"), submit(s, "short")
    with pytest.raises(QueueFull):
        submit(s, "short")
    assert s.pending == 2 and s.depth == 2 and s.live == 0
    s.resume()
    engine.blocked(1)
    assert s.live == 2  # joined together
    closing = threading.Thread(target=s.close)
    closing.start()
    engine.release(3)
    closing.join(30)
    assert [g.text for g in a.result(0) + b.result(0)] == ["xy", "xy"]
    assert not s.accepting
    with pytest.raises(QueueClosed):
        submit(s, "short")


def test_a_row_the_decoder_refuses_fails_its_job_only(engine):
    reports = []
    s = scheduler(engine, on_batch=reports.append)
    s.pause()
    good, bad = submit(s, "short"), submit(s, "no script")  # the decoder's join raises
    s.resume()
    engine.release(3)
    assert good.result(30)[0].text == "xy"
    with pytest.raises(KeyError):
        bad.result(30)
    assert [len(k) for k in engine.decoders[0].steps] == [1, 1, 1]
    assert [(r.rows, r.jobs, r.error) for r in reports] == [(1, 1, None)]
    s.close()


def test_serve_batching_continuous_needs_an_engine_with_a_step_api(engine):
    from keel.config.loading import ConfigError
    from keel.serve.config import load_serve_config
    from keel.serve.policy import continuous_batching

    default = load_serve_config(None, [])
    assert continuous_batching(default, engine)  # the default where the engine can
    assert not continuous_batching(default, object())
    batch = load_serve_config(None, ["serve.batching=batch"])
    assert not continuous_batching(batch, engine)
    asked = load_serve_config(None, ["serve.batching=continuous"])
    with pytest.raises(ConfigError, match=r"serve\.batching"):
        continuous_batching(asked, object())
    with pytest.raises(ConfigError, match=r"serve\.batching"):
        load_serve_config(None, ["serve.batching=eager"])


def test_the_incremental_detokeniser_gives_the_whole_text_pieces():
    text = "12+30= forty-two, é!"
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    stream = TextStream(TOKENIZER)
    pieces = [stream.push(i) for i in ids]
    pieces[-1] += stream.flush()
    assert pieces == token_pieces(TOKENIZER, ids)
    assert "".join(pieces) == TOKENIZER.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    ("text", "stops", "held"),
    [("abc", ["cd"], 1), ("abc", ["bcd", "c"], 2), ("abc", ["x"], 0), ("a", ["abc"], 1),
     ("abc", [], 0)],
)  # fmt: skip
def test_held_back_is_the_longest_end_that_begins_a_stop(text, stops, held):
    assert held_back(text, stops) == held
