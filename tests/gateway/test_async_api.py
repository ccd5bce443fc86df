"""`pdgate.AsyncGateway` under a running event loop: it serves, manages its fleet, and never
blocks the loop, neither in a slow fleet call nor while stopping drains a slow request.

The loop check: a watchdog task ticks every few ms and records the largest gap between ticks.
Each slow operation here takes >= SLOW_S (a mock worker sleeps that long), so a blocking
implementation shows a gap of >= SLOW_S; the bound MAX_LAG_S is far below that and far above a
busy box's scheduling noise. `test_the_watchdog_catches_a_blocking_call` runs the same check on
the blocking `Gateway` to show that it fails there.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any, Awaitable, Callable, TypeVar

import httpx
import pytest
from aiohttp import web

import pdgate
from pdgate.workers import free_port
from tests.mock_workers import BootstrapDecode, BootstrapPrefill, MockHost, MockWorker
from tests.mock_workers.model import expected_text

T = TypeVar("T")

SLOW_S = 1.5  # how long the mock makes a fleet call or a request take
MAX_LAG_S = 0.3  # the most the loop may stall; a blocking call stalls it for >= SLOW_S
TICK_S = 0.005
FAST = {"health_check_interval_secs": 1, "health_success_threshold": 1, "health_failure_threshold": 1,
        "health_check_timeout_secs": 10}


class SlowServerInfo(MockWorker):
    """Answers `/server_info` (read by the gateway before it adds a worker) after SLOW_S."""

    async def server_info(self, request: web.Request) -> web.Response:
        await asyncio.sleep(SLOW_S)
        return await super().server_info(request)


class Watchdog:
    """Measures the event loop's largest stall while an operation runs."""

    def __init__(self) -> None:
        self.max_gap = 0.0  # of the last measure()

    async def _tick(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while not stop.is_set():
            await asyncio.sleep(TICK_S)
            now = loop.time()
            self.max_gap = max(self.max_gap, now - last - TICK_S)
            last = now

    async def measure(self, operation: Callable[[], Awaitable[T]]) -> tuple[T, float]:
        """Run `operation` with the watchdog ticking; returns its result and its duration."""
        self.max_gap = 0.0
        stop = asyncio.Event()
        ticker = asyncio.create_task(self._tick(stop))
        await asyncio.sleep(TICK_S * 2)  # the watchdog is ticking before the operation starts
        began = time.monotonic()
        try:
            result = await operation()
        finally:
            took = time.monotonic() - began
            stop.set()
            await ticker
        return result, took


def test_async_gateway_serves_and_manages_its_fleet(mocks: MockHost) -> None:
    prefill = mocks.start(BootstrapPrefill())
    decode = mocks.start(BootstrapDecode())

    async def scenario() -> None:
        gateway = pdgate.AsyncGateway(pd_disaggregation=True, port=0, request_timeout_secs=10, **FAST)
        assert not gateway.running and gateway.url is None and gateway.port is None
        with pytest.raises(pdgate.GatewayStateError):
            await gateway.list_workers()
        async with gateway as gw:
            assert gw.running and gw.url == f"http://127.0.0.1:{gw.port}"
            added = await gw.add_worker(prefill.url, "prefill", bootstrap_port=prefill.bootstrap_port,
                                        labels={"zone": "a"})
            assert (added["worker_type"], added["bootstrap_port"]) == ("prefill", prefill.bootstrap_port)
            await gw.add_worker(decode.url, "decode")
            assert sorted(w["url"] for w in await gw.list_workers()) == sorted([prefill.url, decode.url])
            assert (await gw.get_worker(decode.url))["url"] == decode.url
            with pytest.raises(pdgate.WorkerError) as conflict:
                await gw.add_worker(decode.url, "decode")
            assert (conflict.value.status, conflict.value.code) == (409, "conflict")
            assert (await gw.set_worker_enabled(decode.url, False))["enabled"] is False
            assert (await gw.set_worker_enabled(decode.url, True))["enabled"] is True
            body = {"text": "hello async world", "sampling_params": {"max_new_tokens": 4}}
            async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
                resp = await wait_ok(client, "/generate", body)
            assert resp.json()["text"] == expected_text("generate", body)[0]
            gone = await gw.remove_worker(prefill.url, wait=True, timeout=15)
            assert gone["status"] == "draining"
            with pytest.raises(pdgate.WorkerError) as missing:
                await gw.get_worker(prefill.url)
            assert missing.value.status == 404
            assert [w["url"] for w in await gw.list_workers()] == [decode.url]
        assert not gateway.running and gateway.url is None
        with pytest.raises(pdgate.GatewayStateError):
            await gateway.add_worker(decode.url, "decode")
        await gateway.stop()  # idempotent

    asyncio.run(scenario())
    assert mocks.state(prefill)["violations"] == [] and mocks.state(decode)["violations"] == []


async def wait_ok(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST until 200: a worker just added is routable once its first health check passed."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while True:
        resp = await client.post(path, json=body)
        if resp.status_code == 200 or loop.time() > deadline:
            assert resp.status_code == 200, resp.text
            return resp
        await asyncio.sleep(0.05)


def test_fleet_calls_and_stop_never_block_the_loop(mocks: MockHost) -> None:
    slow_to_add = mocks.start(SlowServerInfo())
    slow_to_answer = mocks.start(MockWorker(delay_s=SLOW_S))
    body = {"model": "mock-model", "prompt": "a b", "max_tokens": 3}

    async def scenario() -> None:
        watchdog = Watchdog()
        gw = pdgate.AsyncGateway(worker_urls=[slow_to_answer.url], port=0, **FAST)
        await watchdog.measure(gw.start)
        assert watchdog.max_gap < MAX_LAG_S, f"start stalled the loop for {watchdog.max_gap:.3f}s"
        print(f"start: the loop's largest stall: {watchdog.max_gap * 1000:.1f} ms")
        try:
            added, took = await watchdog.measure(lambda: gw.add_worker(slow_to_add.url))
            assert added["url"] == slow_to_add.url
            assert took >= SLOW_S * 0.9, "the fleet call was not slow: the check proves nothing"
            assert watchdog.max_gap < MAX_LAG_S, f"add_worker stalled the loop for {watchdog.max_gap:.3f}s"
            print(f"add_worker took {took:.2f}s; the loop's largest stall: {watchdog.max_gap * 1000:.1f} ms")

            # Stop while a request is in flight on a slow worker: the stop drains it.
            await gw.remove_worker(slow_to_add.url, wait=True, timeout=15)
            async with httpx.AsyncClient(timeout=30) as client:
                request = asyncio.create_task(client.post(f"{gw.url}/v1/completions", json=body))
                await asyncio.to_thread(mocks.wait_pending, slow_to_answer, 1)
                _, took = await watchdog.measure(gw.stop)
                resp = await request
            assert resp.status_code == 200, "stop did not let the in-flight request finish"
            assert took >= SLOW_S * 0.5, "the stop did not wait for the request: the check proves nothing"
            assert watchdog.max_gap < MAX_LAG_S, f"stop stalled the loop for {watchdog.max_gap:.3f}s"
            print(f"stop took {took:.2f}s; the loop's largest stall: {watchdog.max_gap * 1000:.1f} ms")
        finally:
            await gw.stop()

    asyncio.run(scenario())


def test_the_watchdog_catches_a_blocking_call(mocks: MockHost) -> None:
    """The control: the blocking `Gateway.add_worker` called on the loop stalls it for SLOW_S."""
    slow_to_add = mocks.start(SlowServerInfo())
    with pdgate.Gateway(port=0, **FAST) as gw:

        async def blocking_add() -> dict[str, Any]:
            return gw.add_worker(slow_to_add.url)

        async def scenario() -> float:
            watchdog = Watchdog()
            await watchdog.measure(blocking_add)
            return watchdog.max_gap

        stall = asyncio.run(scenario())
        print(f"the blocking Gateway.add_worker stalled the loop for {stall:.2f}s")
        assert stall >= SLOW_S * 0.9


def test_start_errors_and_restart(mocks: MockHost) -> None:
    worker = mocks.start(MockWorker())

    async def scenario() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen(1)
            gw = pdgate.AsyncGateway(port=taken.getsockname()[1])
            with pytest.raises(pdgate.GatewayStartError):
                await gw.start()
            assert not gw.running
        gw = pdgate.AsyncGateway(worker_urls=[worker.url], port=0)
        for _ in range(2):  # a stopped gateway starts again
            async with gw:
                async with httpx.AsyncClient(timeout=5) as client:
                    assert (await client.get(f"{gw.url}/liveness")).status_code == 200
                with pytest.raises(pdgate.GatewayStateError):
                    await gw.start()

    asyncio.run(scenario())


def test_a_cancelled_start_leaves_no_gateway_serving() -> None:
    port = free_port()

    async def scenario() -> None:
        gw = pdgate.AsyncGateway(port=port)
        starting = asyncio.create_task(gw.start())
        await asyncio.sleep(0)  # the start is under way in its thread
        starting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await starting
        assert not gw.running
        # The start finishes in its thread; the gateway is then stopped, not left serving.
        assert gw._native_start is not None
        await asyncio.wait([gw._native_start])
        assert gw._native_start.exception() is None, "the start itself failed: the check proves nothing"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while await port_open(port):
            assert loop.time() < deadline, "the cancelled start left a gateway serving"
            await asyncio.sleep(0.05)

    asyncio.run(scenario())


async def port_open(port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 2)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True
