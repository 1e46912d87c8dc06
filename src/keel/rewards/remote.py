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
request with all its retries.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Sequence
from functools import partial
from typing import Any

from keel.rewards.scoring import RewardScorer, _Call, checked_scores

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
        self.url = url
        self.batch_size = batch_size
        self.retries = retries
        self.backoff_s = backoff_s
        self.request_timeout_s = request_timeout_s
        self.api_key = api_key

    def score(
        self, prompts: Sequence[Any], responses: Sequence[str], answers: Sequence[Any]
    ) -> tuple[list[float], int]:
        rows = list(zip(prompts, responses, answers, strict=True))
        chunks = [rows[i : i + self.batch_size] for i in range(0, len(rows), self.batch_size)]
        outcomes: list[float | BaseException] = []
        running: deque[tuple[_Call, int]] = deque()
        for chunk in chunks:
            if len(running) == self.max_concurrency:
                outcomes.extend(self._chunk_result(*running.popleft()))
            self._check_hung()
            running.append((self._submit(partial(self._request, chunk)), len(chunk)))
        while running:
            outcomes.extend(self._chunk_result(*running.popleft()))
        return self._apply_policy(rows, outcomes)

    def _chunk_result(self, call: _Call, size: int) -> list[float | BaseException]:
        outcome = self._result(call)
        return [outcome] * size if isinstance(outcome, BaseException) else outcome

    def _request(self, rows: list[tuple[Any, str, Any]]) -> list[float | BaseException]:
        """One request for `rows`, retried on transient failures; a score per row (an
        exception for a row whose value is unusable)."""
        body = {
            "items": [{"prompt": p, "response": r, "answer": a} for p, r, a in rows],
            "kwargs": self.kwargs,
        }
        reply = self._post_with_retries(json.dumps(body).encode())
        scores = reply.get("scores") if isinstance(reply, dict) else None
        if not isinstance(scores, list) or len(scores) != len(rows):
            got = len(scores) if isinstance(scores, list) else repr(reply)[:200]
            raise RewardServiceError(
                f"{self.url} answered {got} instead of {{'scores': [...]}} with {len(rows)} scores"
            )
        return checked_scores(scores, self.max_abs)

    def _post_with_retries(self, data: bytes) -> Any:
        for attempt in range(self.retries + 1):
            try:
                return self._post(data)
            except RewardServiceError:
                raise
            except (OSError, _Retry) as exc:  # URLError, timeouts and resets are OSErrors
                if attempt == self.retries:
                    raise RewardServiceError(
                        f"{self.url}: {self.retries + 1} attempts failed, the last with {exc}"
                    ) from exc
                time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def _post(self, data: bytes) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.request_timeout_s) as response:
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
