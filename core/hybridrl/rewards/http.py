"""A client for a reward service (``roles.reward.url``): rewards that live in another process or machine.

Each batch of responses is POSTed as JSON in requests of ``http.batch_size`` items, a few at a time::

    {"items": [{"prompt": "...", "response": "...", "data_source": "openai/gsm8k", "ground_truth": "72", ...}]}

and the service answers ``{"scores": [1.0, 0.0, ...]}`` (or the bare list), one number per item in order; a
``null`` marks an item it could not score. A request that fails (connection refused or reset, HTTP 5xx or
429, no answer within ``http.timeout_s``) is retried ``http.retries`` times with a doubling back-off; one that
still fails scores its items 0 as failures (``timeout`` when the last try timed out), counted by the scorer
like any rule-reward failure. A 4xx answer is not retried: the request itself is wrong.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hybridrl.rewards.calling import RewardFailure, checked_score
from hybridrl.rewards.runner import Item, Outcome

log = logging.getLogger(__name__)

#: requests in flight at once.
CONCURRENCY = 4


class _Retryable(Exception):
    def __init__(self, reason: str, timeout: bool = False) -> None:
        super().__init__(reason)
        self.timeout = timeout


class HttpRewardClient:
    def __init__(self, url: str, batch_size: int = 64, retries: int = 2, timeout_s: float = 60.0,
                 backoff_s: float = 0.5, headers: dict[str, str] | None = None) -> None:
        self.url = url
        self.batch_size = batch_size
        self.retries = retries
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.headers = {"Content-Type": "application/json", **(headers or {})}
        self.requests = 0  # POSTs sent, retries included

    @classmethod
    def from_config(cls, reward_cfg: Any) -> HttpRewardClient:
        h = reward_cfg.http
        return cls(reward_cfg.url, h.batch_size, h.retries, h.timeout_s, h.backoff_s, h.headers)

    def run(self, items: Sequence[Item]) -> list[Outcome]:
        """One outcome per item (never raises for a failing service)."""
        chunks = [list(items[i:i + self.batch_size]) for i in range(0, len(items), self.batch_size)]
        if not chunks:
            return []
        with ThreadPoolExecutor(max_workers=min(CONCURRENCY, len(chunks))) as pool:
            results = list(pool.map(self._score_chunk, chunks))
        return [outcome for chunk in results for outcome in chunk]

    def close(self) -> None:
        pass

    # --- one request -----------------------------------------------------------------------------
    @staticmethod
    def payload(items: Sequence[Item]) -> bytes:
        body = {"items": [{**fields, "prompt": prompt, "response": response} for prompt, response, fields in items]}
        return json.dumps(body, default=str).encode()

    def _score_chunk(self, items: list[Item]) -> list[Outcome]:
        body = self.payload(items)
        last: _Retryable | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                return self._parse(self._post(body), len(items))
            except _Retryable as exc:
                last = exc
                log.warning("reward service %s: %s (try %d of %d)", self.url, exc, attempt + 1, self.retries + 1)
            except RewardFailure as exc:  # a 4xx or an answer of the wrong shape: retrying will not help
                return [Outcome(0.0, f"roles.reward.url {exc}")] * len(items)
        assert last is not None
        reason = f"roles.reward.url {last} after {self.retries + 1} tries"
        return [Outcome(0.0, reason, timeout=last.timeout)] * len(items)

    def _post(self, body: bytes) -> bytes:
        self.requests += 1
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as answer:
                return answer.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:200].decode(errors="replace")
            if exc.code >= 500 or exc.code == 429:
                raise _Retryable(f"answered HTTP {exc.code} {detail}") from None
            raise RewardFailure(f"answered HTTP {exc.code} {detail}") from None
        except TimeoutError:
            raise _Retryable(f"did not answer within {self.timeout_s:g}s (roles.reward.http.timeout_s)",
                             timeout=True) from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, (socket.timeout, TimeoutError)):
                raise _Retryable(f"did not answer within {self.timeout_s:g}s (roles.reward.http.timeout_s)",
                                 timeout=True) from None
            raise _Retryable(f"cannot be reached: {exc.reason}") from None
        except (ConnectionError, OSError) as exc:
            raise _Retryable(f"cannot be reached: {exc}") from None

    @staticmethod
    def _parse(raw: bytes, count: int) -> list[Outcome]:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise RewardFailure(f"answered something that is not JSON: {raw[:80]!r}") from None
        scores = data.get("scores") if isinstance(data, dict) else data
        if not isinstance(scores, list) or len(scores) != count:
            got = f"{len(scores)} scores" if isinstance(scores, list) else type(scores).__name__
            raise RewardFailure(f"answered {got} for {count} items (expected {{\"scores\": [...]}}, one per item)")
        out = []
        for value in scores:
            if value is None:
                out.append(Outcome(0.0, "roles.reward.url could not score this response (null)"))
                continue
            try:
                out.append(Outcome(checked_score(value)))
            except RewardFailure as exc:
                out.append(Outcome(0.0, f"roles.reward.url {exc}"))
        return out
