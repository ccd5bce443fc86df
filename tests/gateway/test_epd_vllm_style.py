"""EPD in vLLM's style through the gateway (`--epd-disaggregation --kv-connector nixl`): reference
workers that imitate vLLM's disaggregated encoder (`--ec-transfer-config`, ECExampleConnector;
docs/engine.md). Real vLLM runs the same in tests/real_vllm_epd.

The invariant: greedy output of an image + text prompt through encode -> NIXL prefill -> decode
equals one colocated `tiny-mm` worker token for token, while the prefill's counters show every
image's rows loaded from the encoders' store (`ec_storage`) and none computed there. That needs
the gateway to have every encoder's answer before it sends the prefill: a prefill sent with the
encode calls would find no file and encode the images itself. Also: text-only requests skip the
encoders; a dead encoder is retried on another; an encoder with no encoder-cache connector (it
stores nothing) leaves the work to the prefill, and the gateway counts it; a hung or garbage
encoder costs one --encode-timeout-secs at most and is retried on another before the prefill is sent.
"""

from __future__ import annotations

import base64
import io
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator

import httpx
import openai
import pytest
from PIL import Image

import pdgate
from pdgate.workers import ReferenceWorker, free_port
from tests.gateway.harness import wait_status
from tests.gateway.test_aborts_free_memory import wait_idle

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny-mm"


def image_url(seed: int) -> str:
    rng = random.Random(seed)
    img = Image.frombytes("RGB", (40, 36), bytes(rng.randrange(256) for _ in range(40 * 36 * 3)))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(*parts: str, max_tokens: int = 10) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": p[4:]}} if p.startswith("img:") else {"type": "text", "text": p}
               for p in parts]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True}


def ec(role: str, store) -> dict[str, Any]:
    return {"ec_connector": "ECExampleConnector", "ec_role": role,
            "ec_connector_extra_config": {"shared_storage_path": str(store)}}


def mm(w: ReferenceWorker) -> dict[str, int]:
    return httpx.get(w.url + "/v1/loads", timeout=10).json()["loads"][0]["multimodal"]["embeddings"]


def route_fields(route: str) -> dict[str, str]:
    return dict(f.split("=", 1) for f in route.split("; ") if "=" in f)


def gateway_metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        key, _, value = line.rpartition(" ")
        series, _, rest = key.partition("{")
        if series == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total


class Fleet:
    def __init__(self, store) -> None:
        self.colo = ReferenceWorker(model=MODEL)
        self.encoders = [ReferenceWorker(model=MODEL, ec_transfer_config=ec("ec_producer", store)) for _ in range(2)]
        # A worker with no encoder-cache connector: it answers the encode call by generating.
        self.plain = ReferenceWorker(model=MODEL)
        # Chunks of 24 tokens: every image is cut across prefill chunks.
        self.prefill = ReferenceWorker(mode="prefill", model=MODEL, kv_connector="NixlConnector",
                                       ec_transfer_config=ec("ec_consumer", store), extra_args=["--chunked-prefill-size", "24"])
        self.decode = ReferenceWorker(mode="decode", model=MODEL, kv_connector="NixlConnector")
        self.all = [self.colo, *self.encoders, self.plain, self.prefill, self.decode]

    def gateway(self, encode: list[str]) -> pdgate.Gateway:
        return pdgate.Gateway(epd_disaggregation=True, kv_connector="nixl", port=0, request_timeout_secs=60,
                              encode=[[u, None] for u in encode], encode_policy="round_robin",
                              prefill=[[self.prefill.url, None]], decode=[self.decode.url],
                              health_check_interval_secs=1, health_success_threshold=1, admin_api_open=True)

    def colocated(self, body: dict[str, Any]) -> dict[str, Any]:
        r = httpx.post(self.colo.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("ec-store"))
    with ThreadPoolExecutor(len(f.all)) as pool:
        list(pool.map(lambda w: w.start(timeout=90), f.all))
    try:
        yield f
    finally:
        for w in f.all:
            w.stop()


@pytest.fixture(scope="module")
def gw(fleet: Fleet) -> Iterator[pdgate.Gateway]:
    with fleet.gateway([e.url for e in fleet.encoders]) as g:
        assert wait_status(g.url + "/readiness", 200) == 200
        yield g


def test_epd_equals_colocated_with_every_image_from_the_store(fleet: Fleet, gw: pdgate.Gateway) -> None:
    before_p, before_d = mm(fleet.prefill), mm(fleet.decode)
    images = 0
    for i, parts in enumerate([("describe: ", "img"), ("first ", "img", " then ", "img", " compare")]):
        body = chat(*[f"img:{image_url(100 * i + k)}" if p == "img" else p for k, p in enumerate(parts)])
        want = fleet.colocated(body)
        r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"], parts
        # NIXL: the decode pulled the prompt's KV but its last token, which vLLM's decode computes
        usage = got["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, usage
        n = parts.count("img")
        images += n
        fields = route_fields(r.headers["x-pdgate-route"])
        assert fields["images"] == str(n) and set(fields["encode"].split(",")) <= {e.url for e in fleet.encoders}
    after_p = mm(fleet.prefill)
    assert after_p["ec_storage"] - before_p["ec_storage"] == images, "every image's rows came from the store"
    assert (after_p["computed"], after_p["cached"]) == (before_p["computed"], before_p["cached"]), "none encoded on the prefill"
    assert mm(fleet.decode) == before_d, "the decode never touched an image"
    assert gateway_metric(gw.url, "pdgate_pd_silent_recompute_total") == 0
    assert gateway_metric(gw.url, "pdgate_epd_unstored_images_total") == 0
    wait_idle([fleet.prefill, fleet.decode], 10)


def test_stream_with_the_openai_client(fleet: Fleet, gw: pdgate.Gateway) -> None:
    body = chat("stream this: ", f"img:{image_url(7)}")
    want = fleet.colocated(body)["choices"][0]["message"]["content"]
    stored = mm(fleet.prefill)["ec_storage"]
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=10, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    assert mm(fleet.prefill)["ec_storage"] == stored + 1


def test_text_only_requests_skip_the_encoders(fleet: Fleet, gw: pdgate.Gateway) -> None:
    body = chat("no image here")
    r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == fleet.colocated(body)["choices"][0]["token_ids"]
    assert "encode" not in route_fields(r.headers["x-pdgate-route"])


def test_a_dead_encoder_is_retried_on_another(fleet: Fleet) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    live = fleet.encoders[0]
    # Round robin from the dead one; health checks have not yet marked it down on the first try.
    with fleet.gateway([dead, live.url]) as g:
        assert wait_status(g.url + "/health", 200) == 200
        for seed in (31, 32):
            body = chat("again: ", f"img:{image_url(seed)}")
            r = httpx.post(g.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == fleet.colocated(body)["choices"][0]["token_ids"]
            assert route_fields(r.headers["x-pdgate-route"])["encode"] == live.url
    # With no encoder that answers, an image request fails clearly, and fast.
    with fleet.gateway([dead]) as g:
        r = httpx.post(g.url + "/v1/chat/completions", json=chat("x", f"img:{image_url(33)}"), timeout=60)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] in ("encode_unavailable", "no_available_workers"), r.text


def test_an_encoder_that_stores_nothing_is_counted(fleet: Fleet) -> None:
    with fleet.gateway([fleet.plain.url]) as g:
        assert wait_status(g.url + "/readiness", 200) == 200
        computed = mm(fleet.prefill)["computed"]
        body = chat("plain: ", f"img:{image_url(41)}")
        r = httpx.post(g.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == fleet.colocated(body)["choices"][0]["token_ids"]
        assert mm(fleet.prefill)["computed"] == computed + 1, "the prefill encoded the image itself"
        assert gateway_metric(g.url, "pdgate_epd_unstored_images_total", protocol="nixl") == 1


def test_mooncake_pd_takes_the_stored_images_too(fleet: Fleet) -> None:
    """vLLM's Mooncake connector (push; the legs are concurrent): the encode calls still end
    before the prefill and decode are sent."""
    store = fleet.encoders[0].ec_transfer_config["ec_connector_extra_config"]["shared_storage_path"]
    prefill = ReferenceWorker(mode="prefill", model=MODEL, kv_connector="MooncakeConnector", ec_transfer_config=ec("ec_consumer", store))
    decode = ReferenceWorker(mode="decode", model=MODEL, kv_connector="MooncakeConnector")
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda w: w.start(timeout=90), [prefill, decode]))
    try:
        with pdgate.Gateway(epd_disaggregation=True, kv_connector="mooncake", port=0, request_timeout_secs=60,
                            encode=[[e.url, None] for e in fleet.encoders], prefill=[[prefill.url, prefill.bootstrap_port]],
                            decode=[decode.url], health_check_interval_secs=1, health_success_threshold=1) as g:
            assert wait_status(g.url + "/readiness", 200) == 200
            before = mm(prefill)
            body = chat("mooncake: ", f"img:{image_url(61)}", " and ", f"img:{image_url(62)}")
            r = httpx.post(g.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == fleet.colocated(body)["choices"][0]["token_ids"]
            after = mm(prefill)
            assert after["ec_storage"] - before["ec_storage"] == 2 and after["computed"] == before["computed"]
            assert route_fields(r.headers["x-pdgate-route"])["images"] == "2"
    finally:
        prefill.stop()
        decode.stop()


class _Bad(BaseHTTPRequestHandler):
    """An encoder that hangs on POST (`/hang` mode) or answers 200 with a body that is not JSON."""

    mode = "garbage"

    def do_GET(self) -> None:  # noqa: N802 (http.server's name): health checks pass
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if type(self).mode == "hang":
            time.sleep(30)
            return
        body = b"this is not json"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("mode", ["hang", "garbage"])
def test_a_hung_or_garbage_encoder_is_retried_within_the_deadline(fleet: Fleet, mode: str) -> None:
    handler = type(f"Bad_{mode}", (_Bad,), {"mode": mode})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    bad = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pdgate.Gateway(epd_disaggregation=True, kv_connector="nixl", port=0, request_timeout_secs=30,
                            encode=[[bad, None], [fleet.encoders[1].url, None]],
                            encode_timeout_secs=1, prefill=[[fleet.prefill.url, None]], decode=[fleet.decode.url],
                            health_check_interval_secs=1, health_success_threshold=1) as g:
            assert wait_status(g.url + "/readiness", 200) == 200
            retried = 0
            # Consistent hashing (by image) over the two: some of these images start on the bad one.
            for seed in range(71 if mode == "hang" else 81, 77 if mode == "hang" else 87):
                stored = mm(fleet.prefill)["ec_storage"]
                body = chat("retry: ", f"img:{image_url(seed)}")
                t = time.monotonic()
                r = httpx.post(g.url + "/v1/chat/completions", json=body, timeout=60)
                assert r.status_code == 200, r.text
                assert time.monotonic() - t < 10, "the bad encoder cost one --encode-timeout-secs at most"
                assert r.json()["choices"][0]["token_ids"] == fleet.colocated(body)["choices"][0]["token_ids"]
                fields = route_fields(r.headers["x-pdgate-route"])
                assert fields["encode"] == fleet.encoders[1].url, fields
                retried += fields["attempts"] == "2"
                assert mm(fleet.prefill)["ec_storage"] == stored + 1, "the prefill was sent once, after the good encoder"
            assert retried >= 1, "some image started on the bad encoder and was retried"
            code = "encode_timeout" if mode == "hang" else "encode_bad_response"
            assert gateway_metric(g.url, "pdgate_worker_errors_total", leg="encode", code=code) == retried
        wait_idle([fleet.prefill, fleet.decode], 10)
    finally:
        server.shutdown()
