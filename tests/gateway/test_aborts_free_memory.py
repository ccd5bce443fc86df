"""Aborts free engine memory, end to end: clients that hang up on their streams through the
gateway leave no KV page reserved, in use or pinned on any reference engine.

The engines run with their DEFAULT deadlines (bootstrap 300 s, NIXL lease 480 s), so pages that
are back within 5 s were freed by an abort (a dropped connection, a release notice, or
`/abort_request`), never by a timeout.
"""

from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest

import pdgate
from pdgate.workers import ReferenceWorker
from tests.gateway.harness import wait_status

pytestmark = pytest.mark.timeout(300)
STREAMS = 50
IDLE_WITHIN_S = 5.0
CONNECTORS = {"bootstrap": None, "nixl": "NixlConnector", "mooncake": "MooncakeConnector"}


def loads(w: ReferenceWorker) -> dict[str, Any]:
    return httpx.get(w.url + "/v1/loads", timeout=10).json()["loads"][0]


def idle(w: ReferenceWorker) -> bool:
    ld = loads(w)
    kv, dis = ld["kv_pages"], ld["disaggregation"]
    return (kv["free"] + kv.get("cached", 0) == kv["total"] and ld["num_live_reqs"] == 0 and dis["held_for_pull"] == 0
            and dis["pending_registrations"] == 0 and not any(dis["transfers_in_flight"].values()))


def wait_idle(workers: list[ReferenceWorker], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(idle(w) for w in workers):
            return
        time.sleep(0.05)
    raise AssertionError(f"not idle within {timeout}s: " + "; ".join(f"{w.url} {loads(w)['kv_pages']}" for w in workers))


@pytest.fixture(params=sorted(CONNECTORS))
def pd_fleet(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[ReferenceWorker]]]:
    connector = CONNECTORS[request.param]
    workers = [ReferenceWorker(mode=m, model="tiny", kv_connector=connector)
               for m in ("prefill", "prefill", "decode", "decode")]
    with ThreadPoolExecutor(len(workers)) as pool:
        list(pool.map(lambda w: w.start(timeout=90), workers))
    try:
        yield request.param, workers
    finally:
        for w in workers:
            w.stop()


async def cut_streams(url: str, n: int, seed: int) -> int:
    """n streams, each cut by its client after a random number of events (0: right after the
    response head). Returns how many got at least one token before the cut."""
    rng = random.Random(seed)
    got_tokens = 0

    async def one(c: httpx.AsyncClient, i: int) -> None:
        nonlocal got_tokens
        body = {"model": "tiny", "prompt": f"stream {i} " + "x" * rng.randrange(20, 200),
                "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
        cut_after = rng.randrange(0, 6)
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    seen += 1
                if seen >= cut_after:
                    break
            got_tokens += seen > 0
        # leaving the block closes the connection: the client is gone

    async with httpx.AsyncClient(timeout=60) as c:
        for start in range(0, n, 10):
            await asyncio.gather(*(one(c, i) for i in range(start, min(n, start + 10))))
    return got_tokens


def test_streams_cut_by_the_client_leave_every_engine_idle(pd_fleet: tuple[str, list[ReferenceWorker]]) -> None:
    connector, workers = pd_fleet
    p1, p2, d1, d2 = workers
    options = dict(pd_disaggregation=True, kv_connector=connector, port=0, request_timeout_secs=60,
                   prefill=[[p.url, p.bootstrap_port] for p in (p1, p2)], decode=[d1.url, d2.url],
                   health_check_interval_secs=1, health_success_threshold=1)
    with pdgate.Gateway(**options) as gw:
        assert wait_status(gw.url + "/readiness", 200) == 200
        got_tokens = asyncio.run(cut_streams(gw.url, STREAMS, seed=12))
        assert got_tokens > STREAMS // 2, "too few streams were cut mid-decode to mean anything"
        wait_idle(workers, IDLE_WITHIN_S)
        # The engines still serve: nothing is wedged behind a leaked room or hold.
        r = httpx.post(gw.url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "after the cuts", "max_tokens": 4})
        assert r.status_code == 200, r.text
        wait_idle(workers, IDLE_WITHIN_S)


@pytest.mark.parametrize("connector", sorted(CONNECTORS))
def test_a_prefill_killed_mid_request_leaves_the_other_engines_idle(connector: str) -> None:
    """A prefill SIGKILLed right after its first token (`--fault-kill-after-tokens 1`), while its
    decode may be waiting for the KV: the request is retried on the other prefill and answers
    whole, and every surviving engine's pages are back within 5 s (the gateway gave the dead
    pair's decode leg up, and the decode freed its reservation)."""
    kc = CONNECTORS[connector]
    dying = ReferenceWorker(mode="prefill", model="tiny", kv_connector=kc, extra_args=["--fault-kill-after-tokens", "1"])
    survivors = [ReferenceWorker(mode=m, model="tiny", kv_connector=kc) for m in ("prefill", "decode", "decode")]
    workers = [dying, *survivors]
    with ThreadPoolExecutor(len(workers)) as pool:
        list(pool.map(lambda w: w.start(timeout=90), workers))
    try:
        options = dict(pd_disaggregation=True, kv_connector=connector, port=0, request_timeout_secs=60,
                       prefill=[[p.url, p.bootstrap_port] for p in (dying, survivors[0])],
                       decode=[d.url for d in survivors[1:]], prefill_policy="round_robin", retry_max_retries=3,
                       health_check_interval_secs=1, health_success_threshold=1)
        with pdgate.Gateway(**options) as gw:
            assert wait_status(gw.url + "/readiness", 200) == 200
            body = {"model": "tiny", "prompt": "the prefill dies", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            for i in range(4):
                r = httpx.post(gw.url + "/v1/completions", json={**body, "stream": i % 2 == 1}, timeout=60)
                assert r.status_code == 200, r.text
                assert "[DONE]" in r.text if i % 2 else r.json()["usage"]["completion_tokens"] == 8, r.text
                if dying.proc is not None and dying.proc.poll() is not None:
                    break
            assert dying.proc is not None and dying.proc.poll() is not None, "the fault prefill never served a request"
            wait_idle(survivors, IDLE_WITHIN_S)
    finally:
        for w in workers:
            w.stop()
