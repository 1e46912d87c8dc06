"""The batching queue on a recording runner: grouping by key, the row cap, the wait, errors,
work between batches, the pending limit and draining on close."""

from __future__ import annotations

import threading
import time

import pytest

from keel.serve.batching import BatchingQueue, QueueClosed, QueueFull


class Recorder:
    """A runner that records each call's key and rows and answers row → row * 10; `gate` holds
    every call until it is set."""

    def __init__(self):
        self.calls: list[tuple[str, list[int]]] = []
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, key, rows):
        self.gate.wait(10)
        self.calls.append((key, list(rows)))
        if key == "boom":
            raise ValueError("engine failed")
        return [r * 10 for r in rows]


def make(runner, **kw):
    opts = {"max_rows": 8, "max_wait_s": 0.05, "max_pending": 100, **kw}
    return BatchingQueue(runner, **opts)


def test_jobs_with_one_key_share_a_call_and_get_their_own_rows_back():
    runner = Recorder()
    runner.gate.clear()  # the first call waits: the others queue behind it
    queue = make(runner)
    first = queue.submit("a", [0])
    time.sleep(0.1)
    futures = [queue.submit("a", [i, i + 1]) for i in (1, 3, 5)]
    other = queue.submit("b", [7])
    late = queue.submit("a", [9])
    runner.gate.set()
    assert first.result(5) == [0]
    assert [f.result(5) for f in futures] == [[10, 20], [30, 40], [50, 60]]
    assert other.result(5) == [70] and late.result(5) == [90]
    # the three "a" jobs and the later one share a call; "b" kept its place after them
    assert runner.calls == [("a", [0]), ("a", [1, 2, 3, 4, 5, 6, 9]), ("b", [7])]
    queue.close()


def test_the_row_cap_splits_batches_and_a_big_job_runs_alone():
    runner = Recorder()
    runner.gate.clear()
    queue = make(runner, max_rows=4)
    queue.submit("a", [0])
    time.sleep(0.1)
    futures = [
        queue.submit("a", [1, 2, 3]),
        queue.submit("a", [4, 5]),
        queue.submit("a", list(range(6))),
    ]
    runner.gate.set()
    for f in futures:
        f.result(5)
    assert [len(rows) for _, rows in runner.calls] == [1, 3, 2, 6]
    queue.close()


def test_a_lone_job_waits_at_most_max_wait():
    queue = make(Recorder(), max_wait_s=0.2)
    start = time.monotonic()
    assert queue.submit("a", [1]).result(5) == [10]
    assert 0.15 < time.monotonic() - start < 2
    queue.close()


def test_a_failed_call_fails_its_jobs_only_and_the_worker_lives_on():
    queue = make(Recorder(), max_wait_s=0)
    with pytest.raises(ValueError, match="engine failed"):
        queue.submit("boom", [1]).result(5)
    assert queue.submit("a", [2]).result(5) == [20]
    queue.close()


def test_work_between_batches_runs_on_the_worker_thread_in_order():
    runner = Recorder()
    runner.gate.clear()
    queue = make(runner, max_wait_s=0)
    before = queue.submit("a", [1])
    time.sleep(0.05)
    swap = queue.between_batches(lambda: (threading.current_thread().name, len(runner.calls)))
    after = queue.submit("a", [2])
    runner.gate.set()
    before.result(5), after.result(5)
    assert swap.result(5) == ("keel-batching", 1)  # after the running batch, before the next
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
    queue.close(timeout=5)  # drains: both queued jobs are answered before the worker stops
    assert [f.result(0) for f in futures] == [[10], [20]]
    assert not queue.accepting and queue.pending == 0
    with pytest.raises(QueueClosed):
        queue.submit("a", [4])


def test_a_cancelled_job_is_not_generated():
    runner = Recorder()
    runner.gate.clear()
    queue = make(runner, max_wait_s=0)
    queue.submit("a", [1])
    time.sleep(0.05)
    gone = queue.submit("a", [2])
    assert gone.cancel()
    runner.gate.set()
    queue.close(timeout=5)
    assert runner.calls == [("a", [1])]
