"""EPD on the reference engine: an encode worker (`--encoder-only`) ships image embeddings to a
prefill, which computes the prompt with them and hands its KV to a decode.

The invariant is the PD one with images: greedy output of an image + text prompt through
encode -> prefill -> decode equals the same request on one colocated multimodal worker, token for
token, while the prefill's counters show the embeddings received and none computed, the decode
reports the whole prompt cached, and the encode worker ran its tower once per distinct image.
The legs are driven the way SMG's EPD router drives them (`engine_router.epd`); the same
through pdgate's gateway is tests/gateway/test_epd_gateway.py.
"""

from __future__ import annotations

import asyncio
import base64
import io
import random

import httpx
import pytest
from PIL import Image

import engine_router as router
from conftest import assert_clean, loads, start_all
from pdgate.workers import ReferenceWorker

MODEL = "tiny-mm"


def data_url(img: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, fmt)
    mime = "jpeg" if fmt == "JPEG" else fmt.lower()
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def noise_image(seed: int, size=(48, 40)) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3)))


RED = data_url(Image.new("RGB", (32, 32), (220, 20, 30)))
NOISE = data_url(noise_image(1))
JPEG = data_url(noise_image(2, (64, 64)), "JPEG")


def chat(*parts, max_tokens: int = 12) -> dict:
    content = [{"type": "image_url", "image_url": {"url": p[4:]}} if p.startswith("img:")
               else {"type": "text", "text": p} for p in parts]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True}


def mm(w: ReferenceWorker) -> dict:
    return loads(w)["multimodal"]["embeddings"]


@pytest.fixture(scope="module")
def epd_workers():
    colo = ReferenceWorker(mode="null", model=MODEL)
    enc = ReferenceWorker(mode="encode", model=MODEL)
    p = ReferenceWorker(mode="prefill", model=MODEL)
    d = ReferenceWorker(mode="decode", model=MODEL)
    ws = start_all(colo, enc, p, d)
    try:
        yield colo, enc, p, d
    finally:
        for w in ws:
            w.stop()


async def _epd(enc, p, d, body: dict, seed: int):
    async with httpx.AsyncClient(timeout=60) as c:
        return await router.epd(c, enc, p, d, "/v1/chat/completions", body, random.Random(seed))


def run_epd(enc, p, d, body: dict, seed: int = 0):
    re, rp, rd = asyncio.run(_epd(enc, p, d, body, seed))
    for r in (*re, rp, rd):
        assert r.status_code == 200, r.text
    return [r.json() for r in re], rp.json(), rd.json()


def colocated(colo, body: dict) -> dict:
    r = httpx.post(colo.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


PROMPTS = [
    ("describe: ", f"img:{RED}"),
    (f"img:{NOISE}", " and what colour is it?"),
    ("first ", f"img:{JPEG}", " then ", f"img:{RED}", " compare them"),
]


def test_epd_equals_colocated(epd_workers):
    colo, enc, p, d = epd_workers
    before = {w: mm(w) for w in (enc, p, d)}
    n_images = 0
    for i, parts in enumerate(PROMPTS):
        body = chat(*parts)
        want = colocated(colo, body)
        encodes, rp, rd = run_epd(enc, p, d, body, seed=i)
        n_images += len(encodes)
        got = rd["choices"][0]["token_ids"]
        assert got == want["choices"][0]["token_ids"], (parts, got, want)
        assert rd["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        # the decode received the prompt's KV: all of it cached, nothing recomputed
        usage = rd["usage"]
        assert usage["prompt_tokens"] == want["usage"]["prompt_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]
        for e in encodes:
            assert e["accepted"] and e["items"][0]["embedding_len"] == 16 and e["items"][0]["embedding_dim"] == 64
    after = {w: mm(w) for w in (enc, p, d)}
    assert after[p]["received"] - before[p]["received"] == n_images
    assert after[p]["computed"] == before[p]["computed"] and after[p]["cached"] == before[p]["cached"]
    assert after[d] == before[d]  # the decode never touched an image
    assert after[enc]["sent"] - before[enc]["sent"] == n_images
    # every image was encoded or found in the cache; RED, sent twice, was encoded at most once
    computed = after[enc]["computed"] - before[enc]["computed"]
    cached = after[enc]["cached"] - before[enc]["cached"]
    assert computed + cached == n_images and cached >= 1
    metrics = httpx.get(p.url + "/metrics", timeout=10).text
    assert f'pdgate_engine_mm_embeddings_total{{source="received"}} {float(after[p]["received"])}' in metrics
    assert_clean(enc, p, d)
    assert loads(enc)["multimodal"]["embeddings_waiting_for_prefill"] == 0


def test_the_image_changes_the_answer(epd_workers):
    """The embeddings really enter the model: two images, the same text, different answers."""
    colo = epd_workers[0]
    a = colocated(colo, chat("look: ", f"img:{RED}", max_tokens=16))["choices"][0]["token_ids"]
    b = colocated(colo, chat("look: ", f"img:{NOISE}", max_tokens=16))["choices"][0]["token_ids"]
    assert a != b


def test_repeated_image_is_encoded_once(epd_workers):
    colo, enc, p, d = epd_workers
    img = data_url(noise_image(77))
    body = chat("again: ", f"img:{img}")
    before = mm(enc)
    e1, _, d1 = run_epd(enc, p, d, body, seed=101)
    e2, _, d2 = run_epd(enc, p, d, body, seed=102)
    after = mm(enc)
    assert after["computed"] - before["computed"] == 1
    assert after["cached"] - before["cached"] == 1
    assert (e1[0]["items"][0]["cached"], e2[0]["items"][0]["cached"]) == (False, True)
    assert e1[0]["items"][0]["content_hash"] == e2[0]["items"][0]["content_hash"]
    assert d1["choices"][0]["token_ids"] == d2["choices"][0]["token_ids"]
    # the colocated worker's own cache: the second request hits it
    c0 = mm(colo)
    colocated(colo, body)
    colocated(colo, body)
    c1 = mm(colo)
    assert (c1["computed"] - c0["computed"], c1["cached"] - c0["cached"]) == (1, 1)


def test_text_only_on_the_multimodal_preset(epd_workers):
    colo, enc, p, d = epd_workers
    body = chat("no picture here, just words")
    want = colocated(colo, body)
    assert want["choices"][0]["token_ids"]
    before = mm(enc)
    encodes, _, rd = run_epd(enc, p, d, body, seed=7)
    assert encodes == []  # text-only skips the encode leg
    assert rd["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert mm(enc) == before
    # a plain string content renders the same prompt as a text part
    s = dict(body, messages=[{"role": "user", "content": "no picture here, just words"}])
    assert colocated(colo, s)["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]


BAD = [
    ("data:image/png;base64,@@not-base64@@", "invalid_image"),
    ("data:image/png;base64," + base64.b64encode(b"hello, not a picture").decode(), "invalid_image"),
    ("data:text/plain;base64,aGk=", "invalid_image"),
    ("https://example.com/cat.png", "image_url_not_supported"),
]


@pytest.mark.parametrize("url,code", BAD)
def test_bad_image_is_a_clear_400(epd_workers, url, code):
    colo, enc, p, _ = epd_workers
    for w in (colo, p):
        r = httpx.post(w.url + "/v1/chat/completions", json=chat("x", f"img:{url}"), timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == code and err["type"] == "invalid_request_error" and err["message"]
    before = loads(enc)["multimodal"]
    r = httpx.post(enc.url + "/encode", json={"req_id": "bad", "mm_items": [RED, url],
                                               "items": [{"bootstrap_room": 5}, {"bootstrap_room": 6}]},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == code
    after = loads(enc)["multimodal"]
    # nothing encoded, nothing offered: the good image of a bad call is not encoded either
    assert after["embeddings"] == before["embeddings"] and after["embeddings_waiting_for_prefill"] == 0


def test_encode_worker_refuses_generation(epd_workers):
    enc = epd_workers[1]
    r = httpx.post(enc.url + "/v1/chat/completions", json=chat("hi"), timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "encoder_only"
    assert httpx.get(enc.url + "/health_generate", timeout=30).status_code == 200
