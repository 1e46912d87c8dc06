"""RewardScorer: row-by-row scoring under on_error=raise / fallback."""

import math

import pytest

from keel.rewards import RewardError, RewardScorer, numeric_match


def fails_on_b(prompt, response, answer, **kwargs):
    if response == "b":
        raise KeyError("no b")
    return 1.0


def test_scores_every_row_with_kwargs():
    scorer = RewardScorer(numeric_match, kwargs={"strict": True})
    assert scorer.score(["p"] * 3, ["7", "x 7", "8"], ["7", "7", "7"]) == ([1.0, 0.0, 0.0], 0)


def test_on_error_raise_names_function_and_row():
    scorer = RewardScorer(fails_on_b, on_error="raise", name="my.py:fn")
    with pytest.raises(RewardError, match=r"my\.py:fn failed on row 1") as info:
        scorer.score(["p0", "p1"], ["a", "b"], [None, None])
    assert isinstance(info.value.__cause__, KeyError)


def test_on_error_fallback_scores_and_counts():
    scorer = RewardScorer(fails_on_b, on_error="fallback", fallback_score=-1.0)
    assert scorer.score(["p"] * 3, ["b", "a", "b"], [None] * 3) == ([-1.0, 1.0, -1.0], 2)


@pytest.mark.parametrize("bad", [math.nan, math.inf, "not a number", None])
def test_non_finite_or_non_numeric_return_is_an_error(bad):
    scorer = RewardScorer(lambda *a, **k: bad, on_error="fallback", fallback_score=0.5)
    assert scorer.score(["p"], ["r"], ["a"]) == ([0.5], 1)


def test_nan_return_raises_under_raise_policy():
    scorer = RewardScorer(lambda *a, **k: math.nan)
    with pytest.raises(RewardError, match="non-finite"):
        scorer.score(["p"], ["r"], ["a"])


def sleeps_on_slow(prompt, response, answer, **kwargs):
    import time

    if response == "slow":
        time.sleep(5)
    return 1.0


def test_timeout_falls_back_and_is_counted():
    import time

    scorer = RewardScorer(sleeps_on_slow, on_error="fallback", fallback_score=-1.0, timeout_s=0.2)
    start = time.monotonic()
    scores, errors = scorer.score(["p"] * 3, ["a", "slow", "b"], [None] * 3)
    assert (scores, errors) == ([1.0, -1.0, 1.0], 1)
    assert time.monotonic() - start < 2  # the hung call was abandoned, not awaited


def test_timeout_with_raise_names_the_limit():
    scorer = RewardScorer(sleeps_on_slow, timeout_s=0.1)
    with pytest.raises(RewardError, match=r"timed out after 0\.1s"):
        scorer.score(["p"], ["slow"], [None])


def test_bounded_concurrency_keeps_order_and_limit():
    import threading
    import time

    running, peak, lock = [0], [0], threading.Lock()

    def slow_len(prompt, response, answer, **kwargs):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
        return float(len(response))

    scorer = RewardScorer(slow_len, max_concurrency=3)
    responses = ["x" * i for i in range(10)]
    assert scorer.score(["p"] * 10, responses, [None] * 10) == ([float(i) for i in range(10)], 0)
    assert peak[0] == 3


def test_error_rate_past_the_threshold_stops():
    scorer = RewardScorer(fails_on_b, on_error="fallback", max_error_rate=0.4)
    assert scorer.score(["p"] * 3, ["a", "b", "c"], [None] * 3)[1] == 1  # 1/3 ≤ 0.4
    with pytest.raises(RewardError, match=r"failed on 2 of 3 rows, above reward\.max_error_rate"):
        scorer.score(["p"] * 3, ["b", "b", "c"], [None] * 3)


# ------------------------------------------------ reward.signature: trl (one call per batch)
def trl_len(completions, solution, **kwargs):
    """A TRL-style reward: the batch in, one score per completion out."""
    trl_len.calls.append({"completions": completions, "solution": solution, **kwargs})
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    scale = kwargs.get("scale", 1.0)
    return [float(len(t) == len(s)) * scale for t, s in zip(texts, solution, strict=True)]


def test_trl_scorer_makes_one_call_with_the_batch_as_columns():
    from keel.rewards import BatchRewardScorer

    trl_len.calls = []
    chat = [{"role": "user", "content": "hi"}]
    scorer = BatchRewardScorer(trl_len, answer_key="solution", kwargs={"scale": 2.0})
    scores = scorer.score(["p", chat, "q"], ["12", "7", "1"], ["34", "8", "22"])
    assert scores == ([2.0, 2.0, 0.0], 0)
    (call,) = trl_len.calls
    assert call == {
        "prompts": ["p", chat, "q"],
        "completions": ["12", [{"role": "assistant", "content": "7"}], "1"],
        "solution": ["34", "8", "22"],
        "scale": 2.0,
    }


def trl_values(values):
    return lambda completions, **kwargs: values


@pytest.mark.parametrize("bad", [None, math.nan, "x"])
def test_trl_bad_row_values_fail_their_rows_under_the_same_policy(bad):
    from keel.rewards import BatchRewardScorer

    fallback = BatchRewardScorer(trl_values([1.0, bad]), on_error="fallback", fallback_score=-1)
    assert fallback.score(["p", "q"], ["a", "b"], [None, None]) == ([1.0, -1.0], 1)
    strict = BatchRewardScorer(trl_values([1.0, bad]), name="t.py:f")
    with pytest.raises(RewardError, match=r"t\.py:f failed on row 1 \(prompt 'q'"):
        strict.score(["p", "q"], ["a", "b"], [None, None])
    capped = BatchRewardScorer(trl_values([bad, bad]), on_error="fallback", max_error_rate=0.5)
    with pytest.raises(RewardError, match="failed on 2 of 2 rows"):
        capped.score(["p", "q"], ["a", "b"], [None, None])


@pytest.mark.parametrize("fn", [trl_values([1.0]), trl_values(3.0), fails_on_b])
def test_trl_a_failed_call_fails_every_row(fn):
    from keel.rewards import BatchRewardScorer

    strict = BatchRewardScorer(fn, name="t.py:f")
    with pytest.raises(RewardError, match=r"t\.py:f \(reward.signature: trl\) failed on a batch"):
        strict.score(["p", "q"], ["a", "b"], [None, None])
    fallback = BatchRewardScorer(fn, on_error="fallback", fallback_score=0.5)
    assert fallback.score(["p", "q"], ["a", "b"], [None, None]) == ([0.5, 0.5], 2)


def test_trl_timeout_covers_the_whole_call():
    import time

    from keel.rewards import BatchRewardScorer

    def slow(completions, **kwargs):
        time.sleep(5)
        return [1.0] * len(completions)

    scorer = BatchRewardScorer(slow, timeout_s=0.1, on_error="fallback", fallback_score=-1)
    start = time.monotonic()
    assert scorer.score(["p"] * 2, ["a", "b"], [None] * 2) == ([-1.0, -1.0], 2)
    assert time.monotonic() - start < 2


# --------------------------------------------------- hostile reward code (BaseException)
def raiser(exc: BaseException):
    def fn(prompt, response, answer, **kwargs):
        if response == "b":
            raise exc
        return 1.0

    return fn


HOSTILE = [SystemExit(0), SystemExit(3), KeyboardInterrupt(), GeneratorExit()]


@pytest.mark.parametrize("exc", HOSTILE, ids=repr)
def test_base_exceptions_from_the_reward_fall_back_and_are_counted(exc):
    scorer = RewardScorer(raiser(exc), on_error="fallback", fallback_score=-1.0)
    assert scorer.score(["p"] * 3, ["a", "b", "c"], [None] * 3) == ([1.0, -1.0, 1.0], 1)


@pytest.mark.parametrize("exc", HOSTILE, ids=repr)
@pytest.mark.parametrize("timeout_s", [None, 5.0])
def test_base_exceptions_from_the_reward_are_reward_errors(exc, timeout_s):
    scorer = RewardScorer(raiser(exc), name="my.py:fn", timeout_s=timeout_s)
    with pytest.raises(RewardError, match=rf"my\.py:fn failed on row 1 .*{type(exc).__name__}"):
        scorer.score(["p"] * 2, ["a", "b"], [None] * 2)


def test_reward_calls_never_run_on_the_main_thread():
    import threading

    seen = []
    scorer = RewardScorer(lambda *a, **k: seen.append(threading.current_thread()) or 1.0,
                          timeout_s=None)  # fmt: skip
    scorer.score(["p"] * 2, ["a", "b"], [None] * 2)
    assert seen and threading.main_thread() not in seen


# ------------------------------------------------------------------ out-of-range scores
@pytest.mark.parametrize("bad", [1e39, -1e39, 3.5e38, 10**400], ids=str)
def test_scores_outside_the_float32_range_are_errors(bad):
    scorer = RewardScorer(lambda *a, **k: bad, on_error="fallback", fallback_score=0.5)
    assert scorer.score(["p"], ["r"], ["a"]) == ([0.5], 1)
    with pytest.raises(RewardError, match=r"float32|too large|overflow"):
        RewardScorer(lambda *a, **k: bad).score(["p"], ["r"], ["a"])


def test_the_largest_float32_score_is_accepted_and_stays_finite():
    import torch

    scorer = RewardScorer(lambda *a, **k: 3.4e38)
    scores, errors = scorer.score(["p"], ["r"], ["a"])
    assert errors == 0 and torch.isfinite(torch.tensor(scores, dtype=torch.float32)).all()


def test_max_abs_bounds_the_scores():
    scorer = RewardScorer(lambda p, r, a, **k: float(r), on_error="fallback", max_abs=10.0)
    assert scorer.score(["p"] * 4, ["10", "-10", "10.5", "-11"], [None] * 4) == (
        [10.0, -10.0, 0.0, 0.0],
        2,
    )
    with pytest.raises(RewardError, match=r"outside ±reward\.max_abs \(10\)"):
        RewardScorer(lambda *a, **k: 11.0, max_abs=10.0).score(["p"], ["r"], ["a"])


# ---------------------------------------------------------------------- hung calls
def test_the_default_timeout_is_finite():
    assert RewardScorer(numeric_match).timeout_s == 60.0


def test_hung_calls_are_bounded_and_then_stop_the_scorer():
    """A reward that never returns, scored step after step: the live threads stay bounded and
    the scorer stops with a RewardError instead of starting more."""
    import threading

    release = threading.Event()

    def hangs(prompt, response, answer, **kwargs):
        release.wait()
        return 1.0

    before = threading.active_count()
    scorer = RewardScorer(hangs, on_error="fallback", timeout_s=0.01, max_concurrency=2)
    bound = scorer.max_hung_calls + scorer.max_concurrency
    try:
        with pytest.raises(RewardError, match=r"still running after timing out.*max_hung_calls"):
            for _ in range(30):  # 30 steps of 4 rows: 120 calls, every one hangs
                scorer.score(["p"] * 4, ["r"] * 4, [None] * 4)
                assert threading.active_count() - before <= bound
        assert threading.active_count() - before <= bound
        with pytest.raises(RewardError, match="max_hung_calls"):  # starts no further thread
            scorer.score(["p"] * 4, ["r"] * 4, [None] * 4)
        assert threading.active_count() - before <= bound
    finally:
        release.set()


def test_hung_calls_that_return_late_no_longer_count():
    import threading

    release = threading.Event()
    scorer = RewardScorer(lambda *a, **k: release.wait() and 1.0, on_error="fallback",
                          timeout_s=0.01, max_hung_calls=3)  # fmt: skip
    assert scorer.score(["p"] * 2, ["r"] * 2, [None] * 2) == ([0.0, 0.0], 2)
    assert scorer.hung_calls() == 2
    release.set()
    for _ in range(100):
        if scorer.hung_calls() == 0:
            break
        threading.Event().wait(0.01)
    assert scorer.hung_calls() == 0
    scorer.timeout_s = 5.0  # the calls return at once now; 10 ms is too tight under load
    assert scorer.score(["p"] * 2, ["r"] * 2, [None] * 2) == ([1.0, 1.0], 0)


# -------------------------------------------- a hung reward: prompt failure, overlapping time-outs
def hanging_on(release, hang=lambda response: True):
    """A reward that blocks until `release` is set on the rows `hang` picks, 1.0 otherwise."""

    def fn(prompt, response, answer, **kwargs):
        if hang(response):
            release.wait(60)
        return 1.0

    return fn


def test_a_hung_reward_fails_a_raise_step_after_about_one_timeout():
    """40 rows of a reward that never returns, 0.25 s each: with on_error raise the first
    time-out stops the step (before: every row waited out its own, 40 × 0.25 s)."""
    import threading
    import time

    release = threading.Event()
    scorer = RewardScorer(hanging_on(release), name="hang.py:fn", timeout_s=0.25)
    start = time.monotonic()
    try:
        with pytest.raises(RewardError, match=r"hang\.py:fn failed on row 0 .*timed out after"):
            scorer.score(["p"] * 40, ["r"] * 40, [None] * 40)
        assert time.monotonic() - start < 40 * 0.25 / 2.5  # ≈ 0.25 s; serial would be 10 s
        assert scorer.hung_calls() == 1  # the rows after the first were never started
    finally:
        release.set()


def test_timeouts_of_concurrent_calls_overlap():
    """Every 8th of 160 rows hangs, 8 calls at once: a hung call holds its slot only until its
    own deadline and no call waits behind it, so the 20 time-outs overlap (before: the batch
    waited on each in turn, 20 × 0.25 s)."""
    import threading
    import time

    release = threading.Event()
    responses = [("hang" if i % 8 == 0 else "ok") for i in range(160)]
    scorer = RewardScorer(hanging_on(release, lambda r: r == "hang"), on_error="fallback",
                          fallback_score=-1.0, timeout_s=0.25, max_concurrency=8)  # fmt: skip
    start = time.monotonic()
    try:
        scores, errors = scorer.score(["p"] * 160, responses, [None] * 160)
        assert time.monotonic() - start < 20 * 0.25 / 2  # ≈ 3 waves of 0.25 s; serial: 5 s
        assert errors == 20
        assert scores == [(-1.0 if r == "hang" else 1.0) for r in responses]
        assert len(scorer.pop_warnings()) == 1  # the first time-out; the others are counted
    finally:
        release.set()


def test_a_timeout_is_warned_about_when_it_happens(caplog):
    """A call past reward.timeout_s is logged at once (and kept for pop_warnings), not only
    counted in reward/errors after the step."""
    import logging
    import threading

    release = threading.Event()
    seen = []

    def slow_then_note(prompt, response, answer, **kwargs):
        if response == "slow":
            release.wait(60)
        elif response == "after":  # the row after the hung one: the warning is already out
            seen.append([r.getMessage() for r in caplog.records])
        return 1.0

    scorer = RewardScorer(slow_then_note, name="slow.py:fn", on_error="fallback",
                          timeout_s=0.2)  # fmt: skip
    try:
        with caplog.at_level(logging.WARNING, logger="keel.rewards"):
            assert scorer.score(["p"] * 2, ["slow", "after"], [None] * 2) == ([0.0, 1.0], 1)
        (messages,) = seen
        assert any("slow.py:fn" in m and "reward.timeout_s" in m for m in messages), messages
        ((rule, message),) = scorer.pop_warnings()
        assert rule == "reward_timeout" and "row 0" in message
        assert "reward.max_hung_calls" in message
        assert scorer.pop_warnings() == []
    finally:
        release.set()


def test_a_failure_under_raise_stops_the_running_calls_without_leaking_workers():
    """With 4 calls at once a failure stops the step at once; calls still running are given
    up (hung until they return), and the scorer scores normally afterwards."""
    import threading
    import time

    release = threading.Event()

    def fn(prompt, response, answer, **kwargs):
        if response == "bad":
            raise KeyError("bad row")
        if response == "wait":
            release.wait(60)
        return 1.0

    before = threading.active_count()
    scorer = RewardScorer(fn, max_concurrency=4, timeout_s=30.0)
    start = time.monotonic()
    with pytest.raises(RewardError, match="failed on row 3"):
        scorer.score(["p"] * 8, ["wait", "wait", "wait", "bad", *["ok"] * 4], [None] * 8)
    assert time.monotonic() - start < 10  # not the 30 s deadline of the waiting calls
    assert scorer.hung_calls() == 3
    release.set()
    for _ in range(500):
        if scorer.hung_calls() == 0:
            break
        time.sleep(0.01)
    assert scorer.hung_calls() == 0
    assert scorer.score(["p"] * 8, ["ok"] * 8, [None] * 8) == ([1.0] * 8, 0)
    assert threading.active_count() - before <= 4
