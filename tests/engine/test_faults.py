"""Faults end with a clean error within their deadline, and afterwards no page is reserved,
in use or pinned on either engine (checked through /v1/loads).

The workers here run with short deadlines (conftest.FAULT_ARGS: bootstrap 3 s, waiting 4 s,
transfer 3 s, lease 3 s)."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import httpx
import pytest

import engine_router as router
from conftest import FAULT_ARGS, assert_clean, loads, start_all, wait_until
from pdgate.workers import ReferenceWorker, free_port

pytestmark = pytest.mark.timeout(90)


def body(n_tokens: int = 40, max_new: int = 6, seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {"input_ids": [256] + [rng.randrange(256) for _ in range(n_tokens - 1)],
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}


def post(url: str, b: dict, timeout: float = 30) -> httpx.Response:
    return httpx.post(url, json=b, timeout=timeout)


def assert_error(r: httpx.Response, status: int = 500) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["code"]
    return err


@pytest.fixture(scope="module")
def pair():
    p = ReferenceWorker(mode="prefill", extra_args=FAULT_ARGS)
    d = ReferenceWorker(mode="decode", extra_args=FAULT_ARGS)
    start_all(p, d)
    yield p, d
    p.stop()
    d.stop()


@pytest.fixture(scope="module")
def nixl_pair():
    p = ReferenceWorker(mode="prefill", kv_connector="NixlConnector", extra_args=FAULT_ARGS)
    d = ReferenceWorker(mode="decode", kv_connector="NixlConnector", extra_args=FAULT_ARGS)
    start_all(p, d)
    yield p, d
    p.stop()
    d.stop()


def test_decode_never_comes(pair):
    p, d = pair
    r = post(p.url + "/generate", router.bootstrap_body(body(), p, 11))
    assert "waiting for the decode to register" in assert_error(r)["message"]
    assert_clean(p, d)


def test_prefill_request_never_comes(pair):
    p, d = pair
    r = post(d.url + "/generate", router.bootstrap_body(body(), p, 12))
    err = assert_error(r)
    assert "no prefill request" in err["message"] or "timed out" in err["message"]
    assert_clean(p, d)


def test_bootstrap_server_unreachable(pair):
    p, d = pair
    b = dict(body(), bootstrap_host="127.0.0.1", bootstrap_port=free_port(), bootstrap_room=13)
    assert_error(post(d.url + "/generate", b))
    assert_clean(p, d)


def test_fake_bootstrap_host_is_a_no_transfer_path(pair):
    p, d = pair
    b = dict(body(), bootstrap_host="2.2.2.2", bootstrap_port=None, bootstrap_room=0)
    rp, rd = post(p.url + "/generate", b), post(d.url + "/generate", b)
    assert rp.status_code == 200 and rd.status_code == 200
    assert rp.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert len(rd.json()["output_ids"]) == 6
    assert "kv_bytes_received" not in rd.json()["meta_info"]
    assert_clean(p, d)


def test_client_disconnects_while_decode_reserved(pair):
    p, d = pair
    b = router.bootstrap_body(body(), p, 14)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(d.url + "/generate", json=b, timeout=httpx.Timeout(10, read=1.0))
    assert_clean(d)  # the reservation is released
    # the prefill leg that arrives late finds no decode and fails within its deadline
    assert_error(post(p.url + "/generate", b))
    assert_clean(p, d)


def test_room_reuse_after_failure_and_duplicate_registration(pair, colocated):
    p, d = pair
    room = 15
    assert_error(post(d.url + "/generate", router.bootstrap_body(body(seed=1), p, room)))
    want = post(colocated.url + "/generate", body(seed=1)).json()["output_ids"]

    async def run():
        b = router.bootstrap_body(body(seed=1), p, room)
        async with httpx.AsyncClient(timeout=30) as c:
            d1 = asyncio.ensure_future(c.post(d.url + "/generate", json=b))
            for _ in range(300):  # until d1 has registered the room with the prefill
                if (await c.get(p.url + "/v1/loads")).json()["loads"][0]["disaggregation"]["pending_registrations"]:
                    break
                await asyncio.sleep(0.05)
            r2 = await c.post(d.url + "/generate", json=b)  # a duplicate for the live room
            rp = await c.post(p.url + "/generate", json=b)
            return rp, await d1, r2

    rp, r1, r2 = asyncio.run(run())
    assert rp.status_code == 200 and r1.status_code == 200, (rp.text, r1.text)
    assert r1.json()["output_ids"] == want
    assert r1.json()["meta_info"]["cached_tokens"] == 40
    assert "duplicate" in assert_error(r2)["message"]
    assert_clean(p, d)


def test_decode_killed_while_reserved(colocated):
    p = ReferenceWorker(mode="prefill", extra_args=FAULT_ARGS)
    d = ReferenceWorker(mode="decode", extra_args=FAULT_ARGS)
    start_all(p, d)
    try:
        b = router.bootstrap_body(body(), p, 16)
        t = threading.Thread(target=lambda: _swallow(post, d.url + "/generate", b), daemon=True)
        t.start()
        wait_until(lambda: loads(d)["kv_pages"]["reserved"] > 0 and loads(p)["disaggregation"]
                   ["pending_registrations"] == 1, 15, "decode reservation and registration")
        d.kill()
        assert_error(post(p.url + "/generate", b))
        assert_clean(p)
        t.join(10)
    finally:
        p.stop()
        d.stop()


def test_prefill_killed_mid_transfer():
    slow = {"PDGATE_ENGINE_FAULT_SEND_DELAY": "0.3", "PDGATE_ENGINE_FAULT_FRAME_PAGES": "1"}
    p = ReferenceWorker(mode="prefill", extra_args=FAULT_ARGS, env=slow)
    d = ReferenceWorker(mode="decode", extra_args=FAULT_ARGS)
    start_all(p, d)
    try:
        b = router.bootstrap_body(body(n_tokens=320), p, 17)  # 20 pages, 0.3 s each
        res = {}
        t = threading.Thread(target=lambda: res.setdefault("d", post(d.url + "/generate", b)))
        t.start()
        threading.Thread(target=lambda: _swallow(post, p.url + "/generate", b), daemon=True).start()
        wait_until(lambda: loads(d)["disaggregation"]["transfers_in_flight"]["Transferring"] == 1
                   and loads(d)["kv_pages"]["pinned"] > 0, 20, "a transfer in flight")
        p.kill()
        t.join(15)
        assert "kv_transfer" in assert_error(res["d"])["code"]
        assert_clean(d)
    finally:
        p.stop()
        d.stop()


def test_pull_never_comes_lease_expires(nixl_pair):
    p, d = nixl_pair
    b = {"prompt": body()["input_ids"], "max_tokens": 1, "temperature": 0,
         "kv_transfer_params": dict(router.NIXL_PREFILL_PARAMS)}
    rp = httpx.post(p.url + "/v1/completions", json=b, timeout=30)
    params = rp.json()["kv_transfer_params"]
    assert loads(p)["kv_pages"]["pinned"] == len(params["remote_block_ids"]) == 3
    assert_clean(p, timeout=3 + 5)  # lease 3 s
    late = dict(b, max_tokens=5, kv_transfer_params=params)
    assert "not held" in assert_error(httpx.post(d.url + "/v1/completions", json=late, timeout=30))["message"]
    assert_clean(p, d)


def test_duplicate_pull_fails_cleanly(nixl_pair):
    p, d = nixl_pair
    b = {"prompt": body()["input_ids"], "max_tokens": 5, "temperature": 0, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(timeout=30) as c:
            return await router.nixl(c, p, d, "/v1/completions", b)

    rp, rd = asyncio.run(run())
    assert rd.status_code == 200 and rd.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 39
    again = dict(b, kv_transfer_params=rp.json()["kv_transfer_params"])
    assert_error(httpx.post(d.url + "/v1/completions", json=again, timeout=30))
    assert_clean(p, d)


def test_mooncake_prefill_without_decode(nixl_pair):
    p, d = nixl_pair
    b = {"prompt": body()["input_ids"], "max_tokens": 1, "temperature": 0,
         "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                "transfer_id": "xfer-never"}}
    assert_error(httpx.post(p.url + "/v1/completions", json=b, timeout=30))
    assert_clean(p, d)


def _swallow(fn, *a):
    try:
        fn(*a)
    except httpx.HTTPError:
        pass


@pytest.fixture(scope="module")
def mooncake_pair():
    p = ReferenceWorker(mode="prefill", kv_connector="MooncakeConnector", extra_args=FAULT_ARGS)
    d = ReferenceWorker(mode="decode", kv_connector="MooncakeConnector", extra_args=FAULT_ARGS)
    start_all(p, d)
    yield p, d
    p.stop()
    d.stop()


@pytest.mark.parametrize("protocol", ["bootstrap", "mooncake"])
def test_transfer_table_ends_every_row_after_aborts(protocol, pair, mooncake_pair):
    """25 requests whose client hangs up on the decode at a random moment, plus 5 that finish:
    afterwards every transfer row has ended (before the fix, the source left one row per
    request in Bootstrapping, re-keyed and never removed), and no page is held."""
    p, d = pair if protocol == "bootstrap" else mooncake_pair
    rng = random.Random(7)
    path = "/generate" if protocol == "bootstrap" else "/v1/completions"

    def request_body(i: int) -> dict:
        b = body(n_tokens=48, max_new=24, seed=i)
        if protocol == "bootstrap":
            return b
        return {"prompt": b["input_ids"], "max_tokens": 24, "temperature": 0, "ignore_eos": True}

    async def one(c: httpx.AsyncClient, i: int, cut_after: float | None) -> None:
        run = (router.bootstrap(c, p, d, path, request_body(i), rng) if protocol == "bootstrap"
               else router.mooncake(c, p, d, path, request_body(i)))
        task = asyncio.ensure_future(run)
        if cut_after is None:
            rp, rd = await task
            assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
            return
        await asyncio.sleep(cut_after)
        task.cancel()  # both legs' connections close: the client went away
        await asyncio.gather(task, return_exceptions=True)

    async def run_all() -> None:
        async with httpx.AsyncClient(timeout=30) as c:
            plan = [rng.uniform(0.0, 0.3) for _ in range(25)] + [None] * 5
            for start in range(0, len(plan), 5):
                await asyncio.gather(*(one(c, start + k, cut) for k, cut in enumerate(plan[start:start + 5])))

    asyncio.run(run_all())
    assert_clean(p, d, timeout=20)
    finished = loads(p)["disaggregation"]["transfers_finished"]
    assert finished["Success"] >= 5, finished


def test_nixl_hold_refuses_a_second_request_with_the_same_id(nixl_pair):
    """Two prefills under one request id: the second would orphan the first's pinned pages
    (its lease timer would free the newer hold and nothing the older). It is refused with 409,
    the first can still be pulled, and nothing stays pinned."""
    p, d = nixl_pair
    b = {"prompt": body()["input_ids"], "max_tokens": 1, "temperature": 0,
         "kv_transfer_params": dict(router.NIXL_PREFILL_PARAMS)}
    hdr = {"X-Request-Id": "shared-id"}
    first = httpx.post(p.url + "/v1/completions", json=b, headers=hdr, timeout=30)
    assert first.status_code == 200, first.text
    assert assert_error(httpx.post(p.url + "/v1/completions", json=b, headers=hdr, timeout=30), 409)["code"] == "duplicate_request_id"
    late = dict(b, max_tokens=5, kv_transfer_params=first.json()["kv_transfer_params"])
    rd = httpx.post(d.url + "/v1/completions", json=late, headers=hdr, timeout=30)
    assert rd.status_code == 200 and rd.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 39, rd.text
    assert_clean(p, d)


def sse_events(w: ReferenceWorker, path: str, b: dict) -> list[dict]:
    """The JSON events of a stream, read until it ends or the connection breaks."""
    got: list[dict] = []
    try:
        with httpx.stream("POST", w.url + path, json=b, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got.append(json.loads(line[6:]))
    except (httpx.RemoteProtocolError, httpx.ReadError):
        pass  # the drop
    return got


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
def test_fault_drop_streams_exactly_n_tokens_and_never_the_end(route):
    """`--fault-drop-after-tokens N` breaks every stream right after its N-th token and before
    its finish, even where the engine could run ahead of the stream and finish the answer first:
    the scheduler holds a sequence at N (a resume test needs the break mid-answer, always)."""
    w = ReferenceWorker(mode="null", extra_args=["--fault-drop-after-tokens", "3"])
    start_all(w)
    try:
        for k in range(3):  # on every request
            if route == "/generate":
                got = sse_events(w, route, {**body(8, 16, seed=k), "stream": True})
                assert got and got[-1]["output_ids"] and len(got[-1]["output_ids"]) == 3, got
                assert all(e["meta_info"]["finish_reason"] is None for e in got), got
            else:
                got = sse_events(w, route, {"prompt": [256, 1, 2, 3], "max_tokens": 16, "temperature": 0,
                                            "ignore_eos": True, "stream": True, "return_token_ids": True})
                ids = [t for e in got for c in e["choices"] for t in c.get("token_ids") or []]
                assert len(ids) == 3, got
                assert all(c["finish_reason"] is None for e in got for c in e["choices"]), got
            assert w.proc is not None and w.proc.poll() is None, "the engine lives on"
            assert_clean(w)
    finally:
        w.stop()
