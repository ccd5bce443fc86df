"""Runs mock workers on a background asyncio loop, so blocking test code can drive them."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable, TypeVar

from .core import MockWorker

T = TypeVar("T")
W = TypeVar("W", bound=MockWorker)


class MockHost:
    """One event-loop thread hosting any number of mock workers; `close()` stops them all."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="mock-workers", daemon=True)
        self._thread.start()
        self.workers: list[MockWorker] = []

    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run `fn` (a coroutine factory or a plain function) on the loop; wait for its result."""

        async def run() -> Any:
            result = fn()
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout)

    def start(self, worker: W) -> W:
        self.call(worker.start)
        self.workers.append(worker)
        return worker

    def state(self, worker: MockWorker) -> dict[str, Any]:
        """A consistent copy of the worker's records (taken on the loop)."""
        import copy

        return self.call(lambda: copy.deepcopy(worker.state()))

    def set_knobs(self, worker: MockWorker, **knobs: Any) -> None:
        self.call(lambda: worker.knobs.update(knobs))

    def wait_pending(self, worker: MockWorker, count: int, timeout: float = 5.0) -> bool:
        """Wait until exactly `count` requests are in flight on `worker`; False on deadline."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.call(lambda: worker.pending) == count:
                return True
            time.sleep(0.02)
        return False

    def wait_idle(self, worker: MockWorker, timeout: float = 5.0) -> bool:
        """Wait until no request is in flight on `worker`; False when the deadline passes first."""
        return self.wait_pending(worker, 0, timeout)

    def close(self) -> None:
        for worker in reversed(self.workers):
            try:
                self.call(worker.stop, timeout=5)
            except Exception:  # a stuck worker must not keep the others alive
                pass
        self.workers.clear()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self.loop.is_running():
            self.loop.close()
