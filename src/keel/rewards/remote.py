"""Scoring through an HTTP reward service (`reward.url`): a reward model served by
`keel serve RM --reward` (its POST /v1/score), or any server that speaks the same small protocol.

    POST <reward.url>            Content-Type: application/json
                                 Authorization: Bearer <token>   (when one is configured)
    {"items": [{"prompt": str | [messages], "response": str, "answer": any}, ...],
     "kwargs": {...}}            reward.kwargs, for the service to use or ignore
    → 200 {"scores": [float, ...]}   one per item, in order

Rows go in requests of `reward.http.batch_size`, at most `reward.max_concurrency` requests at
once (each on a scorer worker thread, as function calls are). A request that fails with a
connection error, a time-out (`reward.http.timeout_s`), 429 or a 5xx status is retried up to
`reward.http.retries` times, after `backoff_s · 2^attempt` seconds; any other status is not
retried. A request that still fails fails its rows, which then go through the usual error
policy (`reward.on_error`, `fallback_score`, `max_error_rate`); `reward.timeout_s` bounds one
request with all its retries: an attempt gets at most what is left of it, and no retry starts
whose wait would pass it. Each failed attempt that is retried is logged as it fails (logger
`keel.rewards.scoring`, and kept for `pop_warnings`), and requests fail fast as function calls
do (keel.rewards.scoring): a stalled service fails a step under `on_error: raise` after about
one `reward.timeout_s`, with a message naming reward.url and the limit.
"""

from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

from keel.rewards.scoring import RewardScorer, checked_scores

if TYPE_CHECKING:  # keel.types imports torch; scoring needs only the standard library
    from keel.types import Prompt

# `Any` here: a row's answer (the user's value) and the reward service's JSON replies, before
# they are checked.

RETRIED_STATUS = frozenset({429, 500, 502, 503, 504})


class RewardServiceError(RuntimeError):
    """The reward service refused or failed a request; the message has its status and reply."""


class RemoteRewardScorer(RewardScorer):
    """Scores rows by POSTing them to `url` (the protocol in the module docstring)."""

    def __init__(
        self,
        url: str,
        *,
        batch_size: int = 64,
        retries: int = 3,
        backoff_s: float = 0.5,
        request_timeout_s: float = 30.0,
        api_key: str | None = None,
        **options: Any,
    ):
        super().__init__(self._post, name=url, **options)
        self.what = f"the reward service at reward.url={url}"
        self.url = url
        self.batch_size = batch_size
        self.retries = retries
        self.backoff_s = backoff_s
        self.request_timeout_s = request_timeout_s
        self.api_key = api_key

    def score(
        self, prompts: Sequence[Prompt], responses: Sequence[str], answers: Sequence[Any]
    ) -> tuple[list[float], int]:
        rows = list(zip(prompts, responses, answers, strict=True))
        chunks = [rows[i : i + self.batch_size] for i in range(0, len(rows), self.batch_size)]
        calls = [partial(self._request, chunk) for chunk in chunks]
        return self._score_calls(rows, calls, [len(c) for c in chunks], lists=True)

    def _request(self, rows: list[tuple[Prompt, str, Any]]) -> list[float | BaseException]:
        """One request for `rows`, retried on transient failures; a score per row (an
        exception for a row whose value is unusable)."""
        deadline = time.monotonic() + self.timeout_s if self.timeout_s else math.inf
        body = {
            "items": [{"prompt": p, "response": r, "answer": a} for p, r, a in rows],
            "kwargs": self.kwargs,
        }
        reply = self._post_with_retries(json.dumps(body).encode(), deadline)
        scores = reply.get("scores") if isinstance(reply, dict) else None
        if not isinstance(scores, list) or len(scores) != len(rows):
            got = len(scores) if isinstance(scores, list) else repr(reply)[:200]
            raise RewardServiceError(
                f"{self.url} answered {got} instead of {{'scores': [...]}} with {len(rows)} scores"
            )
        return checked_scores(scores, self.max_abs)

    def _post_with_retries(self, data: bytes, deadline: float = math.inf) -> Any:
        """The reply to `data`, retried (with backoff) while the retries and the `deadline`
        (of reward.timeout_s) allow; each attempt gets at most what is left before it."""
        for attempt in range(self.retries + 1):
            timeout = min(self.request_timeout_s, max(deadline - time.monotonic(), 0.01))
            try:
                return self._post(data, timeout)
            except RewardServiceError:
                raise
            except (OSError, _Retry) as exc:  # URLError, timeouts and resets are OSErrors
                reason = self._reason(exc, timeout)
                wait = self.backoff_s * 2**attempt
                tries = f"{attempt + 1} attempt{'s' if attempt else ''}"
                if attempt == self.retries:
                    raise RewardServiceError(
                        f"{self.url}: {tries} failed, the last with {reason}"
                    ) from exc
                if time.monotonic() + wait >= deadline:
                    raise RewardServiceError(
                        f"{self.url}: {tries} failed, the last with {reason}; the next retry "
                        f"(in {wait:g}s) would end past reward.timeout_s={self.timeout_s:g}s"
                    ) from exc
                self._warn(
                    "reward_service_retry",
                    f"reward.url={self.url}: attempt {attempt + 1} of {self.retries + 1} "
                    f"failed ({reason}); retrying in {wait:g}s",
                )
                time.sleep(wait)
        raise AssertionError("unreachable")

    def _reason(self, exc: BaseException, timeout: float) -> str:
        """What went wrong with an attempt, a time-out naming the limit it ran into."""
        cause = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if not isinstance(cause, TimeoutError):
            return str(exc)
        if timeout < self.request_timeout_s:
            return f"no answer within {timeout:.3g}s, what was left of reward.timeout_s"
        return f"no answer within reward.http.timeout_s={self.request_timeout_s:g}s"

    def _post(self, data: bytes, timeout: float | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
        try:
            timeout = self.request_timeout_s if timeout is None else timeout
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            text = exc.read()[:300].decode("utf-8", "replace")
            if exc.code in RETRIED_STATUS:
                raise _Retry(f"HTTP {exc.code}: {text}") from exc
            message = f"{self.url} refused the request: HTTP {exc.code}: {text}"
            raise RewardServiceError(message) from None
        except json.JSONDecodeError as exc:
            raise RewardServiceError(f"{self.url} answered something that is not JSON") from exc

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "fn": None}


class _Retry(Exception):
    """A status worth retrying (429, 5xx)."""
