"""EPD through the gateway (issue 31, the gateway's first slice): `tiny-mm` reference workers,
two encode workers (`--encoder-only`), one prefill and one decode behind
`pdgate.Gateway(epd_disaggregation=True, ...)`.

The invariant is the PD one with images: greedy output of an image + text prompt through the
gateway's E/P/D equals the same request on one colocated `tiny-mm` worker, token for token,
while the prefill's counters show every image's embedding received from an encode worker and
none computed. Also: consistent hashing sends a repeated image to the same encode worker,
text-only requests skip the encode leg, a remote image URL is a 400 before any worker sees the
request, and an encode worker that is down fails the request with a clear error within its
deadline, leaving the prefill and the decode clean.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import random
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import anthropic
import httpx
import openai
import pytest
from PIL import Image

import pdgate
from pdgate.workers import ReferenceWorker
from tests.gateway.harness import wait_status
from tests.gateway.test_aborts_free_memory import wait_idle

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-mm"
IDLE_WITHIN_S = 10


def data_url(img: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, fmt)
    mime = "jpeg" if fmt == "JPEG" else fmt.lower()
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def noise_image(seed: int, size: tuple[int, int] = (48, 40)) -> Image.Image:
    rng = random.Random(seed)
    return Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3)))


RED = data_url(Image.new("RGB", (32, 32), (220, 20, 30)))
NOISE = data_url(noise_image(1))
JPEG = data_url(noise_image(2, (64, 64)), "JPEG")


def chat(*parts: str, max_tokens: int = 12) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": p[4:]}} if p.startswith("img:") else {"type": "text", "text": p}
               for p in parts]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True}


def loads(w: ReferenceWorker) -> dict[str, Any]:
    return httpx.get(w.url + "/v1/loads", timeout=10).json()["loads"][0]


def requests_served(w: ReferenceWorker) -> float:
    """The engine's `pdgate_engine_requests_total` (generation items it accepted)."""
    for row in httpx.get(w.url + "/metrics", timeout=10).text.splitlines():
        if row.startswith("pdgate_engine_requests_total "):
            return float(row.split()[-1])
    raise AssertionError(f"{w.url} reports no pdgate_engine_requests_total")


def mm(w: ReferenceWorker) -> dict[str, int]:
    return loads(w)["multimodal"]["embeddings"]


def encode_field(route: str) -> list[str]:
    """The encode workers of a decision record (`...; encode=URL,URL; images=N; ...`)."""
    fields = dict(f.split("=", 1) for f in route.split("; ") if "=" in f)
    return fields["encode"].split(",") if "encode" in fields else []


def start(workers: list[ReferenceWorker]) -> None:
    with ThreadPoolExecutor(len(workers)) as pool:
        list(pool.map(lambda w: w.start(timeout=90), workers))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Epd:
    """The workers, and a gateway in front of them."""

    def __init__(self) -> None:
        self.colo = ReferenceWorker(mode="null", model=MODEL)
        self.encoders = [ReferenceWorker(mode="encode", model=MODEL) for _ in range(2)]
        self.prefill = ReferenceWorker(mode="prefill", model=MODEL)
        self.decode = ReferenceWorker(mode="decode", model=MODEL)
        self.all = [self.colo, *self.encoders, self.prefill, self.decode]

    def gateway(self, encode: list[list[Any]] | None = None, **extra: Any) -> pdgate.Gateway:
        options: dict[str, Any] = dict(
            epd_disaggregation=True, port=0, request_timeout_secs=60,
            encode=encode if encode is not None else [[e.url, e.bootstrap_port] for e in self.encoders],
            prefill=[[self.prefill.url, self.prefill.bootstrap_port]], decode=[self.decode.url],
            health_check_interval_secs=1, health_success_threshold=1, admin_api_open=True)
        options.update(extra)
        return pdgate.Gateway(**options)

    def encoder_of(self, route: str) -> ReferenceWorker:
        """The one encode worker an `x-pdgate-route` header names."""
        named = encode_field(route)
        assert len(named) == 1, route
        return next(e for e in self.encoders if e.url == named[0])

    def clean(self) -> None:
        wait_idle([self.prefill, self.decode], IDLE_WITHIN_S)
        for e in self.encoders:
            assert loads(e)["multimodal"]["embeddings_waiting_for_prefill"] == 0


@pytest.fixture(scope="module")
def epd() -> Iterator[tuple[Epd, pdgate.Gateway]]:
    fleet = Epd()
    start(fleet.all)
    try:
        with fleet.gateway() as gw:
            assert wait_status(gw.url + "/readiness", 200) == 200
            yield fleet, gw
    finally:
        for w in fleet.all:
            w.stop()


def colocated(fleet: Epd, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(fleet.colo.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


PROMPTS = [
    ("describe: ", f"img:{RED}"),
    (f"img:{NOISE}", " and what colour is it?"),
    ("first ", f"img:{JPEG}", " then ", f"img:{NOISE}", " compare them"),
]


def test_epd_equals_colocated_through_the_gateway(epd: tuple[Epd, pdgate.Gateway]) -> None:
    fleet, gw = epd
    before = {w.url: mm(w) for w in (fleet.prefill, fleet.decode)}
    images = 0
    for parts in PROMPTS:
        body = chat(*parts)
        want = colocated(fleet, body)
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()
        n = sum(p.startswith("img:") for p in parts)
        images += n
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"], parts
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        usage = got["usage"]
        assert usage["prompt_tokens"] == want["usage"]["prompt_tokens"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]  # the KV moved
        route = r.headers["x-pdgate-route"]
        assert f"images={n}" in route and encode_field(route), route
        assert set(encode_field(route)) <= {e.url for e in fleet.encoders}
        assert f"prefill={fleet.prefill.url}" in route and f"decode={fleet.decode.url}" in route
    after = {w.url: mm(w) for w in (fleet.prefill, fleet.decode)}
    p0, p1 = before[fleet.prefill.url], after[fleet.prefill.url]
    assert p1["received"] - p0["received"] == images  # every image came from an encode worker
    assert (p1["computed"], p1["cached"]) == (p0["computed"], p0["cached"])  # none ran on the prefill
    assert after[fleet.decode.url] == before[fleet.decode.url]  # the decode never touched an image
    fleet.clean()


def test_stream_with_the_openai_client(epd: tuple[Epd, pdgate.Gateway]) -> None:
    fleet, gw = epd
    body = chat("stream this: ", f"img:{NOISE}", max_tokens=10)
    want = colocated(fleet, body)["choices"][0]["message"]["content"]
    received = mm(fleet.prefill)["received"]
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=10, temperature=0,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == want
    assert mm(fleet.prefill)["received"] == received + 1
    # and the same request whole, through the client's own types
    out = client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=10, temperature=0)
    assert out.choices[0].message.content == want
    fleet.clean()


def test_a_repeated_image_goes_to_the_same_encode_worker(epd: tuple[Epd, pdgate.Gateway]) -> None:
    """consistent_hashing (the default) by the image's SHA-256: the second request meets the
    first's encode worker and its embedding cache."""
    fleet, gw = epd
    img = data_url(noise_image(77))
    routes = []
    for text in ("again: ", "and again: "):
        r = httpx.post(gw.url + "/v1/chat/completions", json=chat(text, f"img:{img}"), timeout=60)
        assert r.status_code == 200, r.text
        routes.append(r.headers["x-pdgate-route"])
    first, second = (fleet.encoder_of(r) for r in routes)
    assert first is second, routes
    # the image was encoded once, there: the second request was a cache hit on that worker
    assert mm(first)["cached"] >= 1
    # different images spread over both encode workers
    used = set()
    for seed in range(100, 120):
        r = httpx.post(gw.url + "/v1/chat/completions", json=chat("x", f"img:{data_url(noise_image(seed, (8, 8)))}",
                                                                  max_tokens=2), timeout=60)
        assert r.status_code == 200, r.text
        used.add(fleet.encoder_of(r.headers["x-pdgate-route"]).url)
    assert used == {e.url for e in fleet.encoders}
    fleet.clean()


def test_text_only_skips_the_encode_leg(epd: tuple[Epd, pdgate.Gateway]) -> None:
    fleet, gw = epd
    body = chat("no picture here, just words")
    want = colocated(fleet, body)
    before = [mm(e) for e in fleet.encoders]
    received = mm(fleet.prefill)["received"]
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert "encode=" not in r.headers["x-pdgate-route"]
    assert [mm(e) for e in fleet.encoders] == before
    assert mm(fleet.prefill)["received"] == received


def test_a_remote_image_url_is_a_400_before_any_worker(epd: tuple[Epd, pdgate.Gateway]) -> None:
    fleet, gw = epd
    served = [requests_served(w) for w in (fleet.prefill, fleet.decode)]
    before = [mm(e) for e in fleet.encoders]
    for url in ("https://example.com/cat.png", "data:text/plain;base64,aGk=", "data:image/png;base64,@@@"):
        r = httpx.post(gw.url + "/v1/chat/completions", json=chat("look: ", f"img:{url}"), timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == "messages" and err["message"], err
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat("look: ", "img:https://example.com/cat.png"), timeout=30)
    assert "--allowed-media-domains" in r.json()["error"]["message"]
    assert [mm(e) for e in fleet.encoders] == before
    assert [requests_served(w) for w in (fleet.prefill, fleet.decode)] == served


def test_an_encode_worker_that_is_down_fails_within_the_deadline(epd: tuple[Epd, pdgate.Gateway]) -> None:
    """Its only encode worker refuses connections (health checks off, so the gateway tries it):
    the request ends with 503 `encode_unavailable`, well before the client's own timeout (the
    request's deadline plus a margin), and the prefill and decode hold nothing afterwards."""
    fleet, _ = epd
    down = f"http://127.0.0.1:{free_port()}"
    with fleet.gateway(encode=[[down, free_port()]], disable_health_check=True, request_timeout_secs=20,
                       retry_max_retries=2) as gw:
        assert wait_status(gw.url + "/readiness", 200) == 200
        r = httpx.post(gw.url + "/v1/chat/completions", json=chat("look: ", f"img:{RED}"), timeout=40)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["code"] == "encode_unavailable" and "encode" in err["message"], err
        route = r.headers["x-pdgate-route"]
        assert encode_field(route) == [down] and "attempts=2" in route, route
        # a text-only request still works: it needs no encode worker
        ok = httpx.post(gw.url + "/v1/chat/completions", json=chat("just text", max_tokens=3), timeout=40)
        assert ok.status_code == 200, ok.text
        metrics = httpx.get(gw.url + "/metrics", timeout=10).text
        assert 'leg="encode"' in metrics
    fleet.clean()


def test_encode_workers_are_listed_with_their_role(epd: tuple[Epd, pdgate.Gateway]) -> None:
    fleet, gw = epd
    listed = httpx.get(gw.url + "/workers", timeout=10).json()
    workers = listed["workers"] if isinstance(listed, dict) else listed
    roles = {w["url"]: w["worker_type"] for w in workers}
    assert all(roles[e.url] == "encode" for e in fleet.encoders), roles
    metrics = httpx.get(gw.url + "/metrics", timeout=10).text
    assert any('role="encode"' in line and fleet.encoders[0].url in line for line in metrics.splitlines())


def test_anthropic_image_blocks_run_epd(epd: tuple[Epd, pdgate.Gateway]) -> None:
    """The Messages API through the official SDK: base64 `image` blocks become the chat body's
    `image_url` data-URL parts in place, so the request runs E/P/D and answers the colocated
    worker's greedy text for the equivalent chat request; a `url` source is Anthropic's 400."""
    fleet, gw = epd
    png = NOISE.split(",", 1)[1]
    blocks = [{"type": "text", "text": "what is in "},
              {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
              {"type": "text", "text": " and in "},
              {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": RED.split(",", 1)[1]}}]
    want = colocated(fleet, chat("what is in ", f"img:{NOISE}", " and in ", f"img:{RED}", max_tokens=10))
    received = mm(fleet.prefill)["received"]
    client = anthropic.Anthropic(base_url=gw.url, api_key="unused", timeout=60, max_retries=0)
    got = client.messages.create(model=MODEL, max_tokens=10, extra_body={"temperature": 0},
                                 messages=[{"role": "user", "content": blocks}])
    assert got.content[0].text == want["choices"][0]["message"]["content"]
    # Anthropic counts cache reads apart: the decode had the whole prompt's KV from the prefill
    assert (got.usage.input_tokens, got.usage.cache_read_input_tokens) == (0, want["usage"]["prompt_tokens"])
    assert mm(fleet.prefill)["received"] == received + 2  # both images came from encode workers
    # streamed, the same text
    with client.messages.stream(model=MODEL, max_tokens=10, extra_body={"temperature": 0},
                                 messages=[{"role": "user", "content": blocks}]) as s:
        assert "".join(s.text_stream) == want["choices"][0]["message"]["content"]
    served = requests_served(fleet.prefill)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.png"}}]}])
    assert "--allowed-media-domains" in str(e.value), "EPD without the flag: a url source is refused"
    assert requests_served(fleet.prefill) == served
    fleet.clean()


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="mooncake-transfer-engine-non-cuda not installed")
def test_embeddings_over_mooncake_te_through_the_gateway(epd: tuple[Epd, pdgate.Gateway]) -> None:
    """Encode worker and prefill on `--disaggregation-transfer-backend mooncake`: the rows move
    by Mooncake TE writes (the prefill's mooncake byte counter grows by the images' bytes, its
    TCP one does not) and the answer is still the colocated worker's, token for token."""
    fleet, _ = epd
    mooncake = ["--disaggregation-transfer-backend", "mooncake"]
    enc = ReferenceWorker(mode="encode", model=MODEL, extra_args=mooncake)
    prefill = ReferenceWorker(mode="prefill", model=MODEL, extra_args=mooncake)
    start([enc, prefill])
    try:
        with pdgate.Gateway(epd_disaggregation=True, port=0, request_timeout_secs=60, encode=[[enc.url, enc.bootstrap_port]],
                            prefill=[[prefill.url, prefill.bootstrap_port]], decode=[fleet.decode.url],
                            health_check_interval_secs=1, health_success_threshold=1) as gw:
            assert wait_status(gw.url + "/readiness", 200) == 200
            before = loads(prefill)["multimodal"]["embedding_bytes_by_backend"]
            body = chat("first ", f"img:{JPEG}", " then ", f"img:{NOISE}", " compare them")
            r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == colocated(fleet, body)["choices"][0]["token_ids"]
            after = loads(prefill)["multimodal"]["embedding_bytes_by_backend"]
            assert after["mooncake"]["received"] - before["mooncake"]["received"] == 2 * 16 * 64 * 4
            assert after["tcp"]["received"] == before["tcp"]["received"]
    finally:
        enc.stop()
        prefill.stop()
    fleet.clean()
