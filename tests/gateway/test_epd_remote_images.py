"""Remote images under EPD (`--allowed-media-domains`, issue 31 item 2): the gateway fetches an
`http://` image from a listed host once, and every leg gets it as a `data:` URL, so the answer
equals the same request with the image inline, token for token. Everything else is the
client's 400 before any worker sees the request: a host not listed, a fetch that answers 404,
a redirect, a type that is not an image, an image over `--max-image-bytes`, one slower than
`--media-fetch-timeout-secs`. The image server is a real HTTP server on loopback.
"""

from __future__ import annotations

import base64
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import anthropic
import httpx
import pytest

import pdgate
from pdgate.workers import free_port
from tests.gateway.harness import wait_status
from tests.gateway.test_epd_gateway import MODEL, NOISE, Epd, chat, colocated, encode_field, mm, requests_served, start

pytestmark = pytest.mark.timeout(300)
PNG = base64.b64decode(NOISE.split(",", 1)[1])
LIMIT = 64 * 1024


class Images(BaseHTTPRequestHandler):
    """/noise.png, /big.png (over LIMIT), /page (text/html), /moved (302), /slow.png (3 s),
    anything else 404. Counts the GETs it served."""

    hits: dict[str, int] = {}

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        Images.hits[self.path] = Images.hits.get(self.path, 0) + 1
        routes = {"/noise.png": (200, "image/png", PNG), "/big.png": (200, "image/png", b"\0" * (LIMIT + 1)),
                  "/page": (200, "text/html", b"<html></html>"), "/moved": (302, "text/plain", b"")}
        if self.path == "/slow.png":
            time.sleep(3)
            routes[self.path] = (200, "image/png", PNG)
        status, mime, body = routes.get(self.path, (404, "text/plain", b"no"))
        self.send_response(status)
        self.send_header("Content-Type", mime)
        self.send_header("Content-Length", str(len(body)))
        if status == 302:
            self.send_header("Location", "/noise.png")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def images() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


@pytest.fixture(scope="module")
def epd() -> Iterator[tuple[Epd, pdgate.Gateway]]:
    fleet = Epd()
    start(fleet.all)
    try:
        with fleet.gateway(allowed_media_domains=["127.0.0.1"], max_image_bytes=LIMIT, media_fetch_timeout_secs=1) as gw:
            assert wait_status(gw.url + "/readiness", 200) == 200
            yield fleet, gw
    finally:
        for w in fleet.all:
            w.stop()


def test_a_listed_hosts_image_is_fetched_once_and_equals_it_inline(epd: tuple[Epd, pdgate.Gateway], images: str) -> None:
    fleet, gw = epd
    inline = chat("what is this: ", f"img:{NOISE}")
    want = colocated(fleet, inline)["choices"][0]["token_ids"]
    received = mm(fleet.prefill)["received"]
    before = Images.hits.get("/noise.png", 0)
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat("what is this: ", f"img:{images}/noise.png"), timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want, "the fetched image is the inline one, byte for byte"
    assert Images.hits["/noise.png"] == before + 1, "fetched once, by the gateway (no engine fetches)"
    assert mm(fleet.prefill)["received"] == received + 1, "its embedding came from an encode worker"
    assert encode_field(r.headers["x-pdgate-route"])
    # the same bytes give the same content hash: consistent hashing sends both forms to one encode worker
    r2 = httpx.post(gw.url + "/v1/chat/completions", json=inline, timeout=60)
    assert encode_field(r2.headers["x-pdgate-route"]) == encode_field(r.headers["x-pdgate-route"])
    fleet.clean()


@pytest.mark.parametrize(("path", "why"), [
    ("/missing.png", "answered 404"),
    ("/moved", "redirects are not followed"),
    ("/page", "not image/*"),
    ("/big.png", "--max-image-bytes"),
    ("/slow.png", "--media-fetch-timeout-secs"),
])
def test_a_bad_fetch_is_the_clients_400_before_any_worker(epd: tuple[Epd, pdgate.Gateway], images: str, path: str, why: str) -> None:
    fleet, gw = epd
    served = [requests_served(w) for w in (fleet.prefill, fleet.decode)]
    encoders = [mm(e) for e in fleet.encoders]
    t = time.monotonic()
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat("look: ", f"img:{images}{path}"), timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == "messages", err
    assert why in err["message"] and "image 0" in err["message"], err
    if path == "/slow.png":
        assert time.monotonic() - t < 2.5, "the fetch's own timeout (1 s) ended it, not the server"
    assert [requests_served(w) for w in (fleet.prefill, fleet.decode)] == served
    assert [mm(e) for e in fleet.encoders] == encoders


def test_an_anthropic_url_source_is_fetched_too(epd: tuple[Epd, pdgate.Gateway], images: str) -> None:
    fleet, gw = epd
    want = colocated(fleet, chat("what is this: ", f"img:{NOISE}", max_tokens=10))["choices"][0]["message"]["content"]
    client = anthropic.Anthropic(base_url=gw.url, api_key="unused", timeout=60, max_retries=0)
    got = client.messages.create(model=MODEL, max_tokens=10, extra_body={"temperature": 0}, messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is this: "}, {"type": "image", "source": {"type": "url", "url": f"{images}/noise.png"}}]}])
    assert got.content[0].text == want
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": f"{images}/missing.png"}}]}])
    assert "answered 404" in str(e.value)
    fleet.clean()


def test_an_image_host_that_is_down_is_the_clients_400(epd: tuple[Epd, pdgate.Gateway]) -> None:
    _, gw = epd
    down = f"http://127.0.0.1:{free_port()}/cat.png"
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat("look: ", f"img:{down}"), timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "could not be fetched" in message and "worker" not in message, message


def test_a_host_not_listed_is_never_fetched(epd: tuple[Epd, pdgate.Gateway], images: str) -> None:
    _, gw = epd
    before = dict(Images.hits)
    other = images.replace("127.0.0.1", "localhost")  # the same server, a name not in the list
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat("look: ", f"img:{other}/noise.png"), timeout=60)
    assert r.status_code == 400, r.text
    assert "not in --allowed-media-domains" in r.json()["error"]["message"]
    assert Images.hits == before, "no GET was made"


def test_the_flag_needs_epd() -> None:
    with pytest.raises(Exception, match="--allowed-media-domains needs --epd-disaggregation"):
        pdgate.Gateway(worker_urls=["http://127.0.0.1:1"], allowed_media_domains=["example.com"], port=0).start()
    with pytest.raises(Exception, match="is not a host name"):
        pdgate.Gateway(epd_disaggregation=True, prefill=[["http://127.0.0.1:1", None]], decode=["http://127.0.0.1:2"],
                       allowed_media_domains=["https://example.com"], port=0).start()
