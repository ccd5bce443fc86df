"""EPD over the Mooncake Transfer Engine on real worker processes (skipped where `mooncake` is not
installed): with `--disaggregation-transfer-backend mooncake` on the encode worker and the
prefill, every embedding's rows are written by the encode worker into a staging slot the prefill
registered at startup, and only a control frame crosses the side channel.

The invariant is test_epd's (encode -> prefill -> decode equals the colocated worker token for
token) plus the data plane's books: the mooncake byte counters grow by exactly the embeddings'
bytes and the TCP ones not at all; a pair with one side on TCP moves them as TCP frames; no free
slot falls back to TCP frames, counted, still correct; and after every fault (an encode call
aborted mid-wait, no encode within the bootstrap timeout, a wrong image, the encode worker
killed) the prefill's staging slots all come back (at once when the encode worker answered,
after the transfer timeout's quarantine when it could not).
"""

from __future__ import annotations

import asyncio
import importlib.util
import random
import uuid

import httpx
import pytest

import engine_router as router
from conftest import assert_clean, loads, start_all, wait_until
from pdgate.workers import ReferenceWorker
from test_epd import JPEG, MODEL, NOISE, PROMPTS, RED, chat, colocated, data_url, noise_image

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                                 reason="mooncake-transfer-engine is not installed")]

EMB_BYTES = 16 * 64 * 4  # one tiny-mm image: 16 rows of 64 float32
# The prefill: 2 staging slots (so a test can hold them all); a short bootstrap timeout for the
# no-encode test, still long enough for a whole request beside a held one on a loaded machine;
# the transfer timeout is the quarantine of a slot given up without an answer.
P_ARGS = ["--mm-embedding-staging-slots", "2", "--bootstrap-timeout", "6", "--transfer-timeout", "3"]


@pytest.fixture(scope="module")
def mc():
    mk = lambda mode, backend="tcp", args=(): ReferenceWorker(mode, model=MODEL, transfer_backend=backend,  # noqa: E731
                                                              extra_args=list(args))
    ws = {"colo": mk("null"),
          "enc_mc": mk("encode", "mooncake"), "enc_tcp": mk("encode"),
          "enc_hang": mk("encode", "mooncake", ["--fault-encode", "hang"]),
          "p_mc": mk("prefill", "mooncake", P_ARGS), "p_tcp": mk("prefill"),
          "d": mk("decode", "mooncake")}
    start_all(*ws.values())
    try:
        yield ws
    finally:
        for w in ws.values():
            w.stop()


def mmstats(w) -> dict:
    return loads(w)["multimodal"]


def by_backend(w) -> dict:
    return mmstats(w)["embedding_bytes_by_backend"]


def staging(w) -> dict:
    return mmstats(w)["embedding_staging"]


def slots_free(w, timeout: float = 10) -> dict:
    """Wait until no staging slot of `w` is in use or quarantined."""
    return wait_until(lambda: (lambda s: s["in_use"] == 0 and s["quarantined"] == 0 and s)(staging(w)),
                      timeout, f"{w}'s staging slots to be free: {staging(w)}")


def delta(after: dict, before: dict) -> dict:
    return {b: {d: after[b][d] - before[b][d] for d in after[b]} for b in after}


def leg_body(body: dict, p, enc, rooms: list[int], rng: random.Random) -> dict:
    """The prefill / decode body: bootstrap fields plus where each image's embedding waits."""
    b = router.bootstrap_body(body, p, rng.randrange(2**63))
    b["encode_bootstrap_info"] = {"items": [
        {"item_index": i, "bootstrap_host": "127.0.0.1", "bootstrap_port": enc.bootstrap_port,
         "bootstrap_room": r} for i, r in enumerate(rooms)]}
    return b


def encode_call(c: httpx.AsyncClient, enc, url: str, room: int, req_id: str | None = None):
    return c.post(enc.url + "/encode", json={"req_id": req_id or f"encode-{uuid.uuid4().hex}",
                                              "mm_items": [url], "items": [{"bootstrap_room": room}]})


async def _epd(enc, p, d, body: dict, seed: int):
    async with httpx.AsyncClient(timeout=60) as c:
        return await router.epd(c, enc, p, d, "/v1/chat/completions", body, random.Random(seed))


def run_epd(enc, p, d, body: dict, seed: int = 0) -> dict:
    re, rp, rd = asyncio.run(_epd(enc, p, d, body, seed))
    for r in (*re, rp, rd):
        assert r.status_code == 200, r.text
    return rd.json()


def assert_equal_to_colocated(colo, body: dict, rd: dict) -> None:
    want = colocated(colo, body)
    assert rd["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    usage = rd["usage"]
    assert usage["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]


def n_images(body: dict) -> int:
    return len(router.image_urls(body))


def test_both_on_mooncake_equal_colocated_and_every_byte_is_written_by_te(mc):
    enc, p, d = mc["enc_mc"], mc["p_mc"], mc["d"]
    slots_free(p)
    before = {w: by_backend(w) for w in (enc, p)}
    received0 = mmstats(p)["embeddings"]["received"]
    fallbacks0 = (staging(p)["fallbacks"], staging(enc)["fallbacks"])
    images = 0
    for i, parts in enumerate(PROMPTS):
        body = chat(*parts)
        assert_equal_to_colocated(mc["colo"], body, run_epd(enc, p, d, body, seed=i))
        images += n_images(body)
    want = {"tcp": {"sent": 0, "received": 0}, "mooncake": {"sent": 0, "received": images * EMB_BYTES}}
    assert delta(by_backend(p), before[p]) == want
    # the encode worker counts a delivery once the prefill's ack is in
    want_enc = {"tcp": {"sent": 0, "received": 0}, "mooncake": {"sent": images * EMB_BYTES, "received": 0}}
    wait_until(lambda: delta(by_backend(enc), before[enc]) == want_enc, 10, "the encode worker's books")
    assert mmstats(p)["embeddings"]["received"] - received0 == images
    assert (staging(p)["fallbacks"], staging(enc)["fallbacks"]) == fallbacks0  # none fell back
    assert slots_free(p)["slots"] == 2 and slots_free(enc)["slots"] == 64
    metrics = httpx.get(p.url + "/metrics", timeout=10).text
    got = by_backend(p)["mooncake"]["received"]
    assert f'pdgate_engine_mm_embedding_bytes_total{{backend="mooncake",direction="received"}} {float(got)}' in metrics
    assert 'pdgate_engine_mm_embedding_staging_slots{state="in_use"} 0.0' in metrics
    assert_clean(enc, p, d)


@pytest.mark.parametrize("enc_name,p_name", [("enc_mc", "p_tcp"), ("enc_tcp", "p_mc")])
def test_a_pair_with_one_side_on_tcp_moves_tcp_frames(mc, enc_name, p_name):
    enc, p, d = mc[enc_name], mc[p_name], mc["d"]
    body = chat("first ", f"img:{JPEG}", " then ", f"img:{NOISE}", " compare them")
    before = by_backend(p)
    assert_equal_to_colocated(mc["colo"], body, run_epd(enc, p, d, body, seed=11))
    assert delta(by_backend(p), before) == {"tcp": {"sent": 0, "received": 2 * EMB_BYTES},
                                            "mooncake": {"sent": 0, "received": 0}}
    for w in (enc, p):
        st = staging(w)
        if st is not None:  # the Mooncake side: nothing counted as a fallback, nothing held
            assert st["fallbacks"] == {"no_slot": 0, "write_failed": 0}
            slots_free(w)
    assert staging(mc["p_tcp"]) is None and staging(mc["enc_tcp"]) is None and staging(mc["d"]) is None
    assert_clean(enc, p, d)


def test_no_free_slot_falls_back_to_tcp_frames_counted(mc):
    """Request A's prefill holds both staging slots while its encode calls are held back; B runs
    whole meanwhile: its image goes as TCP frames (counted no_slot), then A's over Mooncake. Both
    equal colocated."""
    enc, p, d, colo = mc["enc_mc"], mc["p_mc"], mc["d"], mc["colo"]
    slots_free(p)
    body_a = chat("held: ", f"img:{RED}", " and ", f"img:{data_url(noise_image(31))}")
    body_b = chat("meanwhile ", f"img:{data_url(noise_image(32))}")
    before, no_slot0 = by_backend(p), staging(p)["fallbacks"]["no_slot"]
    rng = random.Random(5)
    rooms = [rng.randrange(2**63) for _ in range(2)]

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            b = leg_body(body_a, p, enc, rooms, rng)
            legs_a = asyncio.gather(c.post(p.url + "/v1/chat/completions", json=b),
                                    c.post(d.url + "/v1/chat/completions", json=b))
            await asyncio.to_thread(wait_until, lambda: staging(p)["in_use"] == 2, 10, "A to hold both slots")
            re_b, rp_b, rd_b = await router.epd(c, enc, p, d, "/v1/chat/completions", body_b, rng)
            held = staging(p)["in_use"]
            re_a = await asyncio.gather(*(encode_call(c, enc, u, r)
                                          for u, r in zip(router.image_urls(body_a), rooms)))
            rp_a, rd_a = await legs_a
            return held, [*re_b, rp_b, rd_b, *re_a, rp_a, rd_a], rd_a.json(), rd_b.json()

    held, responses, rd_a, rd_b = asyncio.run(run())
    for r in responses:
        assert r.status_code == 200, r.text
    assert held == 2
    assert_equal_to_colocated(colo, body_a, rd_a)
    assert_equal_to_colocated(colo, body_b, rd_b)
    assert staging(p)["fallbacks"]["no_slot"] - no_slot0 == 1
    assert delta(by_backend(p), before) == {"tcp": {"sent": 0, "received": EMB_BYTES},
                                            "mooncake": {"sent": 0, "received": 2 * EMB_BYTES}}
    slots_free(p)
    assert_clean(enc, p, d)


async def _failing_request(p, d, enc, body: dict, room: int, encode=None, during=None):
    """P and D legs of `body` whose one image waits under `room` at `enc`; `encode` (a callable
    taking the client) is sent with them, `during` (a callable, in a thread) runs once the
    prefill holds a slot. Returns (P response, D response, encode response or None)."""
    async with httpx.AsyncClient(timeout=60) as c:
        b = leg_body(body, p, enc, [room], random.Random(room))
        enc_task = asyncio.ensure_future(encode(c)) if encode else None
        legs = asyncio.gather(c.post(p.url + "/v1/chat/completions", json=b),
                              c.post(d.url + "/v1/chat/completions", json=b))
        if during is not None:
            await asyncio.to_thread(wait_until, lambda: staging(p)["in_use"] == 1, 10, "the prefill to hold a slot")
            await asyncio.to_thread(during)
        rp, rd = await legs
        return rp, rd, (await enc_task if enc_task else None)


def _assert_failed_on_the_image(rp, rd) -> None:
    assert rp.status_code == 500, rp.text
    err = rp.json()["error"]
    assert err["code"] in ("embedding_transfer_failed", "kv_transfer_timeout")
    assert err["param"] == "encode_bootstrap_info.items[0]"
    assert rd.status_code >= 500


def test_abort_on_the_encode_worker_mid_wait_frees_the_slot_at_once(mc):
    enc, p, d = mc["enc_hang"], mc["p_mc"], mc["d"]
    slots_free(p)
    req_id = f"encode-abort-{uuid.uuid4().hex}"
    room = 4242

    def abort():
        wait_until(lambda: mmstats(enc)["embeddings_waiting_for_prefill"] == 1, 10, "the registration")
        r = httpx.post(enc.url + "/abort_request", json={"rid": req_id}, timeout=10)
        assert r.status_code == 200 and r.json()["count"] >= 1

    rp, rd, re = asyncio.run(_failing_request(
        p, d, enc, chat("abort me ", f"img:{RED}"), room,
        encode=lambda c: encode_call(c, enc, RED, room, req_id), during=abort))
    _assert_failed_on_the_image(rp, rd)
    assert "aborted" in rp.json()["error"]["message"] and re.status_code == 499
    st = staging(p)  # the encode worker answered: no quarantine
    assert (st["in_use"], st["quarantined"]) == (0, 0)
    assert_clean(enc, p, d)
    assert mmstats(enc)["embeddings_waiting_for_prefill"] == 0


def test_no_encode_within_the_bootstrap_timeout_frees_the_slot(mc):
    enc, p, d = mc["enc_mc"], mc["p_mc"], mc["d"]
    slots_free(p)
    rp, rd, _ = asyncio.run(_failing_request(p, d, enc, chat("nobody encodes ", f"img:{RED}"), 777))
    _assert_failed_on_the_image(rp, rd)
    assert staging(p)["in_use"] == 0
    slots_free(p, timeout=10)  # any quarantine ends with the transfer timeout (3 s)
    assert_clean(enc, p, d)
    wait_until(lambda: mmstats(enc)["embeddings_waiting_for_prefill"] == 0, 10, "the encoder to drop the room")


def test_a_wrong_image_frees_the_slot_at_once(mc):
    """The room holds another image than the prefill's: the encode worker refuses, nothing
    written, the slot is free at once and the offered embedding dropped."""
    enc, p, d = mc["enc_mc"], mc["p_mc"], mc["d"]
    slots_free(p)
    before = by_backend(p)
    rp, rd, re = asyncio.run(_failing_request(
        p, d, enc, chat("mine ", f"img:{NOISE}"), 888, encode=lambda c: encode_call(c, enc, RED, 888)))
    assert re.status_code == 200
    _assert_failed_on_the_image(rp, rd)
    assert "holds image" in rp.json()["error"]["message"]
    st = staging(p)
    assert (st["in_use"], st["quarantined"]) == (0, 0)
    assert by_backend(p) == before
    assert_clean(enc, p, d)
    wait_until(lambda: mmstats(enc)["embeddings_waiting_for_prefill"] == 0, 10, "the encoder to drop the room")


def test_an_encode_worker_killed_mid_wait_frees_the_slot_after_the_quarantine(mc):
    """No answer ever comes: the slot rests for the transfer timeout, then is free."""
    p, d = mc["p_mc"], mc["d"]
    enc = ReferenceWorker("encode", model=MODEL, transfer_backend="mooncake", extra_args=["--fault-encode", "hang"])
    start_all(enc)
    try:
        slots_free(p)

        def kill():
            wait_until(lambda: mmstats(enc)["embeddings_waiting_for_prefill"] == 1, 10, "the registration")
            enc.kill()

        rp, rd, re = asyncio.run(_failing_request(
            p, d, enc, chat("killed ", f"img:{RED}"), 999,
            encode=lambda c: _swallow(encode_call(c, enc, RED, 999)), during=kill))
        _assert_failed_on_the_image(rp, rd)
        st = staging(p)
        assert st["in_use"] == 0 and st["quarantined"] == 1
        slots_free(p, timeout=10)
        assert_clean(p, d)
    finally:
        enc.stop()


async def _swallow(aw):
    try:
        return await aw
    except httpx.HTTPError as e:  # the encode worker died under its call
        return e
