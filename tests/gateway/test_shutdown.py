"""Graceful shutdown of `pdgate launch`: SIGTERM while 20 streams are running. Readiness turns
503 and a new request is refused with 503 at once; every stream runs to its `[DONE]`; then the
process exits 0 (within --shutdown-grace-period-secs)."""

from __future__ import annotations

import signal
import threading
import time
from typing import Iterator

import httpx
import pytest

from pdgate.workers import ReferenceWorker
from tests.conftest import Processes
from tests.gateway.harness import launch, wait_status

pytestmark = pytest.mark.timeout(240)
STREAMS = 20


@pytest.fixture
def engine() -> Iterator[ReferenceWorker]:
    w = ReferenceWorker(mode="null", model="tiny")
    w.start(timeout=90)
    try:
        yield w
    finally:
        w.stop()


class Stream(threading.Thread):
    """One streamed completion read to its end; records its events and when it started."""

    def __init__(self, url: str, i: int):
        super().__init__(daemon=True)
        self.url, self.i = url, i
        self.events: list[str] = []
        self.status: int | None = None
        self.error: Exception | None = None
        self.first_token = threading.Event()

    def run(self) -> None:
        body = {"model": "tiny", "prompt": f"stream number {self.i}", "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line)
                        self.first_token.set()
        except httpx.HTTPError as e:
            self.error = e
        finally:
            self.first_token.set()


def test_sigterm_lets_streams_finish_refuses_new_requests_and_exits_0(engine: ReferenceWorker, processes: Processes) -> None:
    gw = launch(processes, ["--worker-urls", engine.url, "--health-check-interval-secs", "1",
                            "--health-success-threshold", "1", "--shutdown-grace-period-secs", "120"])
    gw.wait_ready()
    streams = [Stream(gw.url, i) for i in range(STREAMS)]
    for s in streams:
        s.start()
    for s in streams:
        assert s.first_token.wait(60), f"stream {s.i} never started"
    # Twenty streams start one after another on a shared machine: the first may end before the
    # last has its first token. What matters is that streams are in flight at SIGTERM.
    assert sum(s.is_alive() for s in streams) >= STREAMS // 2, "most streams ended before SIGTERM: make them longer"

    gw.proc.send_signal(signal.SIGTERM)
    assert wait_status(gw.url + "/readiness", 503, timeout=10) == 503
    refused = httpx.post(gw.url + "/v1/completions", timeout=10,
                         json={"model": "tiny", "prompt": "too late", "max_tokens": 4})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down", refused.text
    still_running = sum(s.is_alive() for s in streams)

    started = time.monotonic()
    code = gw.proc.wait(timeout=150)
    for s in streams:
        s.join(10)
        assert s.error is None and s.status == 200, (s.i, s.status, s.error)
        assert s.events[-1] == "data: [DONE]", (s.i, s.events[-3:])
        assert len(s.events) > 2, (s.i, s.events)
    assert code == 0, "".join(gw.output[-20:])
    assert still_running > 0, "every stream had ended before the refusal was checked: not a drain test"
    assert time.monotonic() - started < 120
    # Stopped: nothing listens any more.
    with pytest.raises(httpx.HTTPError):
        httpx.get(gw.url + "/readiness", timeout=2)
