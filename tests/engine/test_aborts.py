"""Aborts free memory: `POST /abort_request` (SGLang's, matching on `rid` by prefix) ends a
request at any stage, and a NIXL decode that will not pull tells its prefill so.

Each test aborts at a known stage (waited for through `/v1/loads`), then checks that every
page is back: none reserved, in use or pinned, no hold, no registration, no live transfer.
The workers that matter here run with the DEFAULT deadlines (bootstrap 300 s, lease 480 s), so
only an abort, never a timeout, can have freed the pages within the few seconds allowed.
"""

from __future__ import annotations

import asyncio
import random
import threading
import uuid

import httpx
import pytest

import engine_router as router
from conftest import assert_clean, loads, start_all, wait_until
from pdgate.workers import ReferenceWorker, free_port

pytestmark = pytest.mark.timeout(120)
FREED_WITHIN_S = 5  # far below every default deadline of the engine


def body(n_tokens: int = 40, max_new: int = 6, seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {"input_ids": [256] + [rng.randrange(256) for _ in range(n_tokens - 1)],
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}


def completion(n_tokens: int = 40, max_tokens: int = 6, seed: int = 0, **extra) -> dict:
    return {"prompt": body(n_tokens, seed=seed)["input_ids"], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}


def abort(worker: ReferenceWorker, **what) -> dict:
    r = httpx.post(worker.url + "/abort_request", json=what, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


class Background:
    """A request posted on a thread; `.result` holds its response (or the exception)."""

    def __init__(self, url: str, json: dict):
        self.result: object = None
        self.thread = threading.Thread(target=self._run, args=(url, json), daemon=True)
        self.thread.start()

    def _run(self, url: str, json: dict) -> None:
        try:
            self.result = httpx.post(url, json=json, timeout=60)
        except httpx.HTTPError as e:
            self.result = e

    def join(self) -> httpx.Response:
        self.thread.join(30)
        assert isinstance(self.result, httpx.Response), self.result
        return self.result


def assert_aborted(r: httpx.Response) -> None:
    assert r.status_code == 499, r.text
    assert r.json()["error"]["code"] == "aborted"


@pytest.fixture
def slow_bootstrap_pair():
    """Bootstrap pair whose prefill sends one page per frame, 0.3 s apart (a long transfer)."""
    slow = {"PDGATE_ENGINE_FAULT_SEND_DELAY": "0.3", "PDGATE_ENGINE_FAULT_FRAME_PAGES": "1"}
    p = ReferenceWorker(mode="prefill", env=slow)
    d = ReferenceWorker(mode="decode")
    start_all(p, d)
    yield p, d
    p.stop()
    d.stop()


def test_abort_decode_waiting_for_its_prefill(workers):
    """Bootstrap, before any prefill: the decode has reserved pages and registered the room."""
    p, d = workers["sglang"]
    rid = f"abort-{uuid.uuid4().hex}"
    bg = Background(d.url + "/generate", dict(router.bootstrap_body(body(), p, 21), rid=rid))
    wait_until(lambda: loads(d)["kv_pages"]["reserved"] > 0
               and loads(p)["disaggregation"]["pending_registrations"] == 1, 15, "the reservation")
    assert abort(d, rid=rid) == {"aborted": True, "count": 1}
    assert_aborted(bg.join())
    assert_clean(p, d, timeout=FREED_WITHIN_S)


@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_abort_one_leg_mid_transfer(leg, slow_bootstrap_pair):
    """Either leg aborted while pages are in flight: the other leg fails too, and both sides
    free everything (the pinned pages only once the connection has drained)."""
    p, d = slow_bootstrap_pair
    rid = f"abort-{uuid.uuid4().hex}"
    b = dict(router.bootstrap_body(body(n_tokens=320), p, 22), rid=rid)  # 20 pages, 0.3 s each
    bd, bp = Background(d.url + "/generate", b), Background(p.url + "/generate", b)
    wait_until(lambda: loads(d)["disaggregation"]["transfers_in_flight"]["Transferring"] == 1
               and loads(d)["kv_pages"]["pinned"] > 0, 20, "a transfer in flight")
    assert abort(p if leg == "prefill" else d, rid=rid)["aborted"]
    assert_aborted((bp if leg == "prefill" else bd).join())
    assert (bd if leg == "prefill" else bp).join().status_code == 500
    assert_clean(p, d, timeout=FREED_WITHIN_S)


def test_abort_mid_decode_by_prefix_of_a_batch(colocated):
    """A batch with one rid: its items are `{rid}_{i}`, and the rid aborts all of them."""
    rid = f"batch-{uuid.uuid4().hex}"
    b = {"input_ids": [body(seed=1)["input_ids"], body(seed=2)["input_ids"]], "rid": rid,
         "sampling_params": {"max_new_tokens": 100000, "temperature": 0, "ignore_eos": True}}
    bg = Background(colocated.url + "/generate", b)
    wait_until(lambda: loads(colocated)["num_running_reqs"] == 2, 15, "both items decoding")
    assert abort(colocated, rid=rid) == {"aborted": True, "count": 2}
    assert_aborted(bg.join())
    assert_clean(colocated, timeout=FREED_WITHIN_S)


def test_abort_unknown_rid_and_bad_bodies(colocated):
    assert abort(colocated, rid="no-such-request") == {"aborted": False, "count": 0}
    for bad in ({}, {"rid": ""}, {"rid": 7}):
        r = httpx.post(colocated.url + "/abort_request", json=bad, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text


def test_abort_nixl_hold_frees_pinned_pages_at_once(workers):
    """The prefill has answered and pins its pages for a pull that will never come (the decode
    died): `/abort_request` with the prefill leg's rid frees them, long before the 480 s lease."""
    p, d = workers["nixl"]
    rid = f"nixl-{uuid.uuid4().hex}"
    rp = httpx.post(p.url + "/v1/completions", timeout=30, json=completion(
        max_tokens=1, rid=rid, kv_transfer_params=dict(router.NIXL_PREFILL_PARAMS)))
    params = rp.json()["kv_transfer_params"]
    assert params["remote_request_id"] == rid
    assert loads(p)["disaggregation"]["held_for_pull"] == 1
    assert abort(p, rid=rid) == {"aborted": True, "count": 1}
    assert_clean(p, timeout=FREED_WITHIN_S)
    late = httpx.post(d.url + "/v1/completions", json=completion(kv_transfer_params=params), timeout=30)
    assert late.status_code == 500 and "not held" in late.json()["error"]["message"]
    assert_clean(p, d, timeout=FREED_WITHIN_S)


def test_abort_nixl_hold_by_the_x_request_id_the_gateway_sent(workers):
    """vLLM's API has no body rid: the gateway's NIXL prefill leg carries only `X-Request-Id`,
    and the engine names the request `cmpl-{X-Request-Id}-0`. The gateway releases a hold
    nobody will pull with `/abort_request {"rid": X-Request-Id}`, so that must match it."""
    p, _d = workers["nixl"]
    xid = f"gw-{uuid.uuid4().hex}"
    rp = httpx.post(p.url + "/v1/completions", timeout=30, headers={"X-Request-Id": xid}, json=completion(
        max_tokens=1, kv_transfer_params=dict(router.NIXL_PREFILL_PARAMS)))
    assert rp.json()["kv_transfer_params"]["remote_request_id"] == f"cmpl-{xid}-0"
    assert loads(p)["disaggregation"]["held_for_pull"] == 1
    assert abort(p, rid=xid) == {"aborted": True, "count": 1}
    assert_clean(p, timeout=FREED_WITHIN_S)


def test_nixl_decode_that_rejects_the_request_releases_the_prefill_hold():
    """vLLM's NIXL decode notifies its prefill when it will not pull (aborted or rejected before
    admission). Here the decode's pool cannot hold the generation: it answers 400 at once, and
    the prefill's pinned pages are freed by its notice, not by the 480 s lease."""
    p = ReferenceWorker(mode="prefill", kv_connector="NixlConnector")
    d = ReferenceWorker(mode="decode", kv_connector="NixlConnector",
                        extra_args=["--max-total-tokens", "64"])
    start_all(p, d)
    try:
        rp = httpx.post(p.url + "/v1/completions", timeout=30, json=completion(
            max_tokens=1, kv_transfer_params=dict(router.NIXL_PREFILL_PARAMS)))
        params = rp.json()["kv_transfer_params"]
        assert loads(p)["kv_pages"]["pinned"] == len(params["remote_block_ids"]) > 0
        rd = httpx.post(d.url + "/v1/completions", timeout=30,
                        json=completion(max_tokens=100, kv_transfer_params=params))
        assert rd.status_code == 400 and rd.json()["error"]["code"] == "context_length_exceeded"
        assert_clean(p, d, timeout=FREED_WITHIN_S)
    finally:
        p.stop()
        d.stop()


def test_nixl_decode_aborted_while_waiting_for_memory_releases_the_prefill_hold():
    """The decode waits for free pages (its pool is full) when the client gives up: the abort
    reaches the prefill as a release notice."""
    p = ReferenceWorker(mode="prefill", kv_connector="NixlConnector")
    d = ReferenceWorker(mode="decode", kv_connector="NixlConnector",
                        extra_args=["--max-total-tokens", "128"])
    start_all(p, d)
    try:
        # The hog reserves the whole pool (8 pages) and keeps it: it waits for a bootstrap
        # server that does not exist, until it is aborted.
        hog_body = dict(body(max_new=80), rid="hog", bootstrap_host="127.0.0.1",
                        bootstrap_port=free_port(), bootstrap_room=1)
        hog = Background(d.url + "/generate", hog_body)
        wait_until(lambda: loads(d)["kv_pages"]["free"] == 0, 15, "the decode's pool to fill")
        rp = httpx.post(p.url + "/v1/completions", timeout=30, json=completion(
            seed=3, max_tokens=1, kv_transfer_params=dict(router.NIXL_PREFILL_PARAMS)))
        params = rp.json()["kv_transfer_params"]
        waiting = Background(d.url + "/v1/completions",
                             completion(seed=3, max_tokens=6, rid="waiting", kv_transfer_params=params))
        wait_until(lambda: loads(d)["num_live_reqs"] == 2, 15, "the second request to wait")
        assert abort(d, rid="waiting")["aborted"]
        assert_aborted(waiting.join())
        assert_clean(p, timeout=FREED_WITHIN_S)
        assert abort(d, rid="hog")["aborted"]
        assert_aborted(hog.join())
        assert_clean(p, d, timeout=FREED_WITHIN_S)
    finally:
        p.stop()
        d.stop()


def test_abort_mooncake_prefill_waiting_for_its_decode(workers):
    """Mooncake: the prefill computed and keeps its pages until the decode registers (300 s by
    default); the decode died, so the gateway aborts the prefill leg."""
    p, d = workers["mooncake"]
    rid = f"mc-{uuid.uuid4().hex}"
    b = completion(max_tokens=1, rid=rid, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "transfer_id": f"xfer-{rid}"})
    bg = Background(p.url + "/v1/completions", b)
    wait_until(lambda: loads(p)["kv_pages"]["in_use"] > 0, 15, "the prefill to compute")
    assert abort(p, rid=rid)["aborted"]
    assert_aborted(bg.join())
    assert_clean(p, d, timeout=FREED_WITHIN_S)


def test_openai_rid_names_both_legs_and_the_response(workers):
    p, d = workers["nixl"]
    rid = f"both-{uuid.uuid4().hex}"

    async def run():
        async with httpx.AsyncClient(timeout=30) as c:
            return await router.nixl(c, p, d, "/v1/completions", completion(rid=rid))

    rp, rd = asyncio.run(run())
    assert rp.json()["kv_transfer_params"]["remote_request_id"] == rid
    assert rd.status_code == 200 and rd.json()["id"] == rid
    assert_clean(p, d)
