"""pdgate's EPD in front of real vLLM's disaggregated encoder (issue 31 item 4).

The proof is in two parts. First, a fact about vLLM, checked here so an upgrade that changes it
fails loudly: a prefill that is the encoder cache's consumer takes a stored embedding instead of
running its own vision tower (an embedding overwritten with zeros changes its answer). Second,
through pdgate: every image went to the encoder and was stored there before the prefill was
sent, and greedy output equals the same request on one colocated vLLM worker, token for token,
streamed and not; text-only requests never reach the encoder; an encoder that is down fails an
image request with a clear error and leaves text-only requests working.
"""

from __future__ import annotations

import base64
import io
import json
import random
import struct
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from tests.real_vllm.conftest import gateway_metric, metric, wait_until, worker_healthy
from tests.real_vllm_epd.conftest import MODEL, Epd

pytestmark = pytest.mark.timeout(900)


def image_url(seed: int) -> str:
    rng = random.Random(seed)
    img = Image.frombytes("RGB", (40, 36), bytes(rng.randrange(256) for _ in range(40 * 36 * 3)))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(*parts: str, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": p[4:]}} if p.startswith("img:") else {"type": "text", "text": p}
               for p in parts]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def answer(url: str, body: dict[str, Any]) -> tuple[str, dict]:
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    j = r.json()
    return j["choices"][0]["message"]["content"], j


def zero_stored_embedding(path) -> None:
    """Overwrite a safetensors file's data with zeros, keeping its header (shape, dtype)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert set(k for k in header if k != "__metadata__") == {"ec_cache"}, header
    path.write_bytes(raw[:8 + n] + bytes(len(raw) - 8 - n))


def test_vllm_prefill_takes_a_stored_embedding_instead_of_encoding(epd: Epd) -> None:
    img = image_url(101)
    expected, _ = answer(epd.decode.url, chat(f"img:{img}", "what is this"))
    # The encoder, asked as pdgate asks it: the image alone, one token.
    _, enc = answer(epd.encoder.url, {"model": MODEL, "max_tokens": 1, "stream": False,
                                      "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": img}}]}]})
    assert enc["choices"][0]["message"]["content"] == "" and enc["usage"]["completion_tokens"] == 0, "the encoder only encodes"
    hashes = list(enc["ec_transfer_params"])
    assert len(hashes) == 1
    stored = epd.store / hashes[0] / "encoder_cache.safetensors"
    assert stored.is_file(), f"the encoder stored the embedding at {stored}"
    zero_stored_embedding(stored)
    # The consumer, asked colocated (no kv_transfer_params): its answer follows the stored zeros.
    tampered, _ = answer(epd.prefill.url, chat(f"img:{img}", "what is this"))
    assert tampered != expected, "the consumer used the stored (zeroed) embedding, not its own tower"


def test_image_requests_through_pdgate_equal_colocated_vllm(epd: Epd) -> None:
    client = openai.OpenAI(base_url=epd.url + "/v1", api_key="-", timeout=600, max_retries=0)
    before_enc = metric(epd.encoder, "vllm:request_success_total")
    silent = gateway_metric(epd.url, "pdgate_pd_silent_recompute_total") + gateway_metric(epd.url, "pdgate_epd_unstored_images_total")
    for seed, parts in [(7, ("img", "describe")), (8, ("look:", "img", "and then", "img2"))]:
        imgs = [image_url(seed), image_url(seed + 100)]
        body_parts = [f"img:{imgs[0]}" if p == "img" else f"img:{imgs[1]}" if p == "img2" else p for p in parts]
        body = chat(*body_parts)
        expected, _ = answer(epd.decode.url, body)
        raw = client.chat.completions.with_raw_response.create(**body)
        got = raw.parse()
        assert got.choices[0].message.content == expected, parts
        route = raw.headers["x-pdgate-route"]
        assert epd.encoder.url in route, route
        stream = client.chat.completions.create(**body, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert streamed == expected, parts
    # Every image reached the encoder (twice: non-streamed and streamed), and every one was stored
    # under its hash before the prefill was sent (pdgate awaits the encoder's answer first).
    assert metric(epd.encoder, "vllm:request_success_total") - before_enc == 2 * 3
    assert len(list(epd.store.glob("*/encoder_cache.safetensors"))) >= 3
    unstored = gateway_metric(epd.url, "pdgate_epd_unstored_images_total")
    assert gateway_metric(epd.url, "pdgate_pd_silent_recompute_total") + unstored == silent, "no encoder left an image to the prefill, no decode recomputed"


def test_text_only_requests_skip_the_encoder(epd: Epd) -> None:
    before = metric(epd.encoder, "vllm:request_success_total")
    body = chat("just text, no image")
    expected, _ = answer(epd.decode.url, body)
    got, _ = answer(epd.url, body)
    assert got == expected
    assert metric(epd.encoder, "vllm:request_success_total") == before


def test_an_encoder_that_is_down_fails_image_requests_clearly(epd: Epd) -> None:
    epd.encoder.kill()
    try:
        r = httpx.post(epd.url + "/v1/chat/completions", json=chat(f"img:{image_url(55)}", "x"), timeout=600)
        assert r.status_code in (502, 503), r.text
        err = r.json()["error"]
        assert err["code"] in ("encode_unavailable", "no_available_workers"), err
        got, _ = answer(epd.url, chat("text still works"))
        assert isinstance(got, str)
    finally:
        epd.encoder.stop()
        epd.encoder.start(300)
        wait_until(lambda: worker_healthy(epd.url, epd.encoder.url), 60, "the encoder healthy again at the gateway")
