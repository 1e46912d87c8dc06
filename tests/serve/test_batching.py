"""The batching queue on a recording runner: grouping by key, the row cap, the wait, errors,
work between batches, the pending limit and draining on close."""

from __future__ import annotations

import threading
import time

import pytest

from keel.serve.batching import BatchingQueue, QueueClosed, QueueFull


class Recorder:
    """A runner that records each call's key and rows and answers row → row * 10; `gate` holds
    every call until it is set; `entered` is set once a call has started."""

    def __init__(self):
        self.calls: list[tuple[str, list[int]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __call__(self, key, rows):
        self.entered.set()
        self.gate.wait(10)
        self.calls.append((key, list(rows)))
        if key == "boom":
            raise ValueError("engine failed")
        return [r * 10 for r in rows]


def in_the_runner(runner: Recorder) -> None:
    """Wait until the worker is inside a runner call (held there by the closed gate): what is
    submitted from now on queues behind it, however slow the machine."""
    assert runner.entered.wait(30), "the worker never started a call"


def make(runner, **kw):
    opts = {"max_rows": 8, "max_wait_s": 0.05, "max_pending": 100, **kw}
    return BatchingQueue(runner, **opts)


def test_jobs_with_one_key_share_a_call_and_get_their_own_rows_back():
    runner = Recorder()
    runner.gate.clear()  # the first call waits: the others queue behind it
    queue = make(runner)
    first = queue.submit("a", [0])
    in_the_runner(runner)
    futures = [queue.submit("a", [i, i + 1]) for i in (1, 3, 5)]
    other = queue.submit("b", [7])
    late = queue.submit("a", [9])
    runner.gate.set()
    assert first.result(30) == [0]
    assert [f.result(30) for f in futures] == [[10, 20], [30, 40], [50, 60]]
    assert other.result(30) == [70] and late.result(30) == [90]
    # the three "a" jobs and the later one share a call; "b" kept its place after them
    assert runner.calls == [("a", [0]), ("a", [1, 2, 3, 4, 5, 6, 9]), ("b", [7])]
    queue.close()


def test_the_row_cap_splits_batches_and_a_big_job_runs_alone():
    runner = Recorder()
    runner.gate.clear()
    queue = make(runner, max_rows=4)
    queue.submit("a", [0])
    in_the_runner(runner)
    futures = [
        queue.submit("a", [1, 2, 3]),
        queue.submit("a", [4, 5]),
        queue.submit("a", list(range(6))),
    ]
    runner.gate.set()
    for f in futures:
        f.result(30)
    assert [len(rows) for _, rows in runner.calls] == [1, 3, 2, 6]
    queue.close()


def test_a_lone_job_waits_at_most_max_wait():
    queue = make(Recorder(), max_wait_s=0.2)
    start = time.monotonic()
    assert queue.submit("a", [1]).result(30) == [10]
    assert 0.15 < time.monotonic() - start < 20  # the upper bound: not forever, even loaded
    queue.close()


def test_a_failed_call_fails_its_jobs_only_and_the_worker_lives_on():
    queue = make(Recorder(), max_wait_s=0)
    with pytest.raises(ValueError, match="engine failed"):
        queue.submit("boom", [1]).result(30)
    assert queue.submit("a", [2]).result(30) == [20]
    queue.close()


def test_work_between_batches_runs_on_the_worker_thread_in_order():
    runner = Recorder()
    runner.gate.clear()
    queue = make(runner, max_wait_s=0)
    before = queue.submit("a", [1])
    in_the_runner(runner)
    swap = queue.between_batches(lambda: (threading.current_thread().name, len(runner.calls)))
    after = queue.submit("a", [2])
    runner.gate.set()
    before.result(30), after.result(30)
    assert swap.result(30) == ("keel-batching", 1)  # after the running batch, before the next
    queue.close()


def test_pending_limit_and_close_drain():
    runner = Recorder()
    runner.gate.clear()
    queue = make(runner, max_pending=2, max_wait_s=0)
    futures = [queue.submit("a", [1]), queue.submit("a", [2])]
    with pytest.raises(QueueFull):
        queue.submit("a", [3])
    assert queue.pending == 2
    threading.Timer(0.1, runner.gate.set).start()
    queue.close(timeout=30)  # drains: both queued jobs are answered before the worker stops
    assert [f.result(0) for f in futures] == [[10], [20]]
    assert not queue.accepting and queue.pending == 0
    with pytest.raises(QueueClosed):
        queue.submit("a", [4])


def test_a_cancelled_job_is_not_generated():
    runner = Recorder()
    runner.gate.clear()
    queue = make(runner, max_wait_s=0)
    queue.submit("a", [1])
    in_the_runner(runner)
    gone = queue.submit("a", [2])
    assert gone.cancel()
    runner.gate.set()
    queue.close(timeout=30)
    assert runner.calls == [("a", [1])]


def test_a_paused_queue_starts_nothing_until_resumed_then_batches_what_waited():
    """pause() holds the worker between batches: jobs queue up (and count as pending) and run
    together once resume() is called."""
    runner = Recorder()
    queue = make(runner, max_wait_s=0)
    queue.pause()
    futures = [queue.submit("a", [i]) for i in range(5)]
    swap = queue.between_batches(lambda: len(runner.calls))
    assert queue.pending == 5 and runner.calls == [] and not swap.done()
    queue.resume()
    assert [f.result(30) for f in futures] == [[0], [10], [20], [30], [40]]
    assert swap.result(30) == 0  # work between batches still goes first
    assert runner.calls == [("a", [0, 1, 2, 3, 4])]
    queue.close()


def test_close_drains_a_paused_queue():
    queue = make(Recorder(), max_wait_s=0)
    queue.pause()
    future = queue.submit("a", [1])
    queue.close(timeout=30)
    assert future.result(0) == [10] and not queue.accepting


def test_a_batch_is_reported_before_its_jobs_are_answered():
    """on_batch (the metrics) runs before the futures resolve: a client that has its answer
    sees its batch counted (before: /metrics could lag the answers)."""
    seen, futures = [], []
    queue = make(Recorder(), max_wait_s=0,
                 on_batch=lambda report: seen.append([f.done() for f in futures]))  # fmt: skip
    queue.pause()  # the three jobs in one batch
    futures.extend(queue.submit("a", [i]) for i in range(3))
    queue.resume()
    for f in futures:
        f.result(30)
    assert seen == [[False, False, False]]
    queue.close()


def test_pausing_while_a_job_waits_for_company_keeps_it_queued():
    runner = Recorder()
    queue = make(runner, max_wait_s=30)  # the lone job would wait 30 s for company
    first = queue.submit("a", [1])
    queue.pause()
    later = queue.submit("a", [2])
    queue.submit("b", [3])
    assert not first.done() and runner.calls == []
    queue.max_wait_s = 0
    queue.resume()
    assert first.result(30) == [10] and later.result(30) == [20]
    assert runner.calls[0] == ("a", [1, 2])
    queue.close(timeout=30)
