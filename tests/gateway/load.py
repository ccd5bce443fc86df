"""A small client load for end-to-end tests: a few threads with the official `openai` client,
sending streamed chat and plain completions back to back, recording every outcome and the
gateway's decision record (`x-pdgate-route`). Bounded in count and in time."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import openai


@dataclass
class Outcome:
    started: float  # time.monotonic() before the request was sent
    ended: float
    stream: bool
    route: dict[str, str] = field(default_factory=dict)  # parsed x-pdgate-route
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def parse_route(header: str | None) -> dict[str, str]:
    """`protocol=bootstrap; prefill=URL; decode=URL; ...` → a dict."""
    pairs = (part.split("=", 1) for part in (header or "").split("; ") if "=" in part)
    return {k: v for k, v in pairs}


class Load:
    """`threads` clients, each sending requests one after the other until `stop()` or until
    `limit` requests were sent in all; odd requests are streamed chat completions."""

    def __init__(self, base_url: str, model: str, *, threads: int = 3, limit: int = 2000,
                 max_tokens: int = 16, api_key: str = "unused", timeout: float = 20.0) -> None:
        self.base_url, self.model, self.max_tokens = base_url, model, max_tokens
        self.api_key, self.timeout, self.limit = api_key, timeout, limit
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sent = 0
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self._threads if t.is_alive()]
        assert not alive, f"load threads still running after {timeout}s: {alive}"

    def snapshot(self) -> list[Outcome]:
        with self._lock:
            return list(self.outcomes)

    def failures(self) -> list[Outcome]:
        return [o for o in self.snapshot() if not o.ok]

    def wait_for(self, what: str, predicate: Callable[[Outcome], bool], count: int = 1,
                 timeout: float = 15.0) -> None:
        """Wait until `count` recorded outcomes satisfy `predicate`; fail with a summary."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(1 for o in self.snapshot() if predicate(o)) >= count:
                return
            time.sleep(0.02)
        outcomes = self.snapshot()
        raise AssertionError(f"no {count} outcome(s) {what} within {timeout}s; {len(outcomes)} recorded, "
                             f"failures: {[o.error for o in outcomes if not o.ok][:5]}")

    def _claim(self) -> bool:
        with self._lock:
            if self._stop.is_set() or self._sent >= self.limit:
                return False
            self._sent += 1
            return True

    def _run(self, index: int) -> None:
        client = openai.OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key, max_retries=0,
                               timeout=self.timeout)
        n = index
        while self._claim():
            stream = n % 2 == 1
            n += 1
            outcome = Outcome(started=time.monotonic(), ended=0.0, stream=stream)
            try:
                outcome.route = self._one(client, stream, n)
            except Exception as exc:  # every failure is a finding: record it, keep going
                outcome.error = f"{type(exc).__name__}: {exc}"
            outcome.ended = time.monotonic()
            with self._lock:
                self.outcomes.append(outcome)

    def _one(self, client: openai.OpenAI, stream: bool, n: int) -> dict[str, str]:
        prompt = f"request {n}: the quick brown fox jumps over the lazy dog"
        if stream:
            raw = client.chat.completions.with_raw_response.create(
                model=self.model, messages=[{"role": "user", "content": prompt}],
                max_tokens=self.max_tokens, stream=True)
            chunks = list(raw.parse())
            if not any(c.choices and c.choices[0].finish_reason for c in chunks):
                raise AssertionError(f"stream ended without a finish_reason ({len(chunks)} chunks)")
        else:
            raw = client.completions.with_raw_response.create(model=self.model, prompt=prompt,
                                                               max_tokens=self.max_tokens)
            if not raw.parse().choices[0].finish_reason:
                raise AssertionError("completion without a finish_reason")
        return parse_route(raw.headers.get("x-pdgate-route"))
