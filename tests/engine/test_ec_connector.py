"""vLLM's disaggregated encoder on the reference engine (`--ec-transfer-config`, ECExampleConnector):
an `ec_producer` embeds each image into a shared folder and answers without generating; a
consumer (colocated, or the prefill of a NIXL PD pair, chunked) loads the rows from there.

The invariant: greedy output of an image + text chat through producer -> consumer equals a
plain colocated `tiny-mm` worker token for token, while the consumer's counters show the rows
came from storage (`source="ec_storage"`) and its tower did not run. A file overwritten with
zeros changes the answer (the file really is what the consumer uses); a missing or broken file
is computed locally (counted, never an error). The legs are driven as vLLM's EPD proxy drives
them (`engine_router.ec_encode`, then the original body).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from PIL import Image

import engine_router as router
import pdgate
from conftest import assert_clean, loads, start_all
from pdgate.engine.safetensors_file import dumps, read_f32
from pdgate.workers import ReferenceWorker

MODEL = "tiny-mm"
SHAPE = (16, 64)


def png(seed: int, size=(40, 36)) -> bytes:
    rng = random.Random(seed)
    img = Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(size[0] * size[1] * 3)))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def chat(*parts, max_tokens: int = 10) -> dict:
    content = [{"type": "image_url", "image_url": {"url": url(p)}} if isinstance(p, bytes)
               else {"type": "text", "text": p} for p in parts]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "return_token_ids": True}


def ec(role: str, path) -> dict:
    return {"ec_connector": "ECExampleConnector", "ec_role": role,
            "ec_connector_extra_config": {"shared_storage_path": str(path)}}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    store = tmp_path_factory.mktemp("ec-storage")
    f = SimpleNamespace(
        store=store,
        colo=ReferenceWorker(model=MODEL),
        enc=ReferenceWorker(model=MODEL, ec_transfer_config=ec("ec_producer", store)),
        cons=ReferenceWorker(model=MODEL, ec_transfer_config=ec("ec_consumer", store)),
        both=ReferenceWorker(model=MODEL, ec_transfer_config=ec("ec_both", store)),
        # the NIXL prefill computes in chunks of 24 tokens: every image is cut across chunks
        p=ReferenceWorker(mode="prefill", model=MODEL, kv_connector="NixlConnector",
                          ec_transfer_config=ec("ec_consumer", store), extra_args=["--chunked-prefill-size", "24"]),
        d=ReferenceWorker(mode="decode", model=MODEL, kv_connector="NixlConnector"),
    )
    ws = start_all(f.colo, f.enc, f.cons, f.both, f.p, f.d)
    try:
        yield f
    finally:
        for w in ws:
            w.stop()


def post(w, body: dict, path: str = "/v1/chat/completions") -> dict:
    r = httpx.post(w.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def ids(answer: dict) -> list[int]:
    return answer["choices"][0]["token_ids"]


def mm(w) -> dict:
    return loads(w)["multimodal"]["embeddings"]


def files(w) -> dict:
    return loads(w)["multimodal"]["ec_connector"]["files"]


def encode(f, body: dict) -> dict | None:
    """The proxy's encode step; every answer is the producer's empty one."""
    async def go():
        async with httpx.AsyncClient(timeout=60) as c:
            return await router.ec_encode(c, f.enc, body)
    answers, params = asyncio.run(go())
    for r in answers:
        assert r.status_code == 200, r.text
    return params


def path_of(f, data: bytes) -> str:
    return os.path.join(f.store, sha(data), "encoder_cache.safetensors")


def test_producer_answers_without_generating(fleet):
    f = fleet
    a, b = png(1), png(2)
    body = chat("compare ", a, " with ", b, " and ", a)
    before, files_before = mm(f.enc), files(f.enc)
    out = post(f.enc, body)
    choice = out["choices"][0]
    assert (choice["message"], choice["finish_reason"]) == ({"role": "assistant", "content": ""}, "stop")
    want_prompt = post(f.colo, dict(body, max_tokens=1))["usage"]["prompt_tokens"]
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == want_prompt
    assert out["usage"]["total_tokens"] == want_prompt and out["kv_transfer_params"] is None
    # one entry per distinct image, keyed by SHA-256 of its bytes, with its positions
    assert out["ec_transfer_params"] == {sha(a): {"item_indices": [0, 2], "metadata": {}},
                                         sha(b): {"item_indices": [1], "metadata": {}}}
    after = mm(f.enc)
    assert (after["computed"] - before["computed"], after["cached"] - before["cached"]) == (2, 1)
    assert files(f.enc)["saved"] - files_before["saved"] == 2
    for data in (a, b):
        rows = read_f32(path_of(f, data), "ec_cache", SHAPE)
        assert rows.shape == SHAPE and np.isfinite(rows).all()
    # an image whose file is there is not written again (as vLLM: an existing file is done)
    post(f.enc, chat(a))
    assert files(f.enc)["saved"] - files_before["saved"] == 2


def test_producer_stream_text_only_and_completions(fleet):
    f = fleet
    body = dict(chat("stream ", png(3)), stream=True, stream_options={"include_usage": True})
    r = httpx.post(f.enc.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"][0]["finish_reason"] == "stop" and chunks[1]["choices"][0]["delta"] == {}
    assert chunks[2]["choices"] == [] and chunks[2]["usage"]["completion_tokens"] == 0
    assert len(chunks) == 3 and os.path.isfile(path_of(f, png(3)))
    text = post(f.enc, chat("no picture"))
    assert text["choices"][0]["message"]["content"] == "" and text["ec_transfer_params"] is None
    assert text["usage"]["completion_tokens"] == 0
    comp = post(f.enc, {"model": MODEL, "prompt": "hello", "max_tokens": 5}, "/v1/completions")
    assert comp["choices"][0]["text"] == "" and comp["usage"]["completion_tokens"] == 0
    r = httpx.post(f.enc.url + "/generate", json={"text": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "encoder_only"
    assert httpx.get(f.enc.url + "/health_generate", timeout=30).status_code == 200
    info = httpx.get(f.enc.url + "/server_info", timeout=10).json()
    assert info["ec_transfer_config"]["ec_role"] == "ec_producer"
    assert info["ec_transfer_config"]["ec_connector_extra_config"] == {"shared_storage_path": str(f.store)}


PROMPTS = [("describe: ", 10), (20, " and what colour is it?"), ("first ", 30, " then ", 31, " compare them")]


def _prompt(parts) -> dict:
    return chat(*(png(p) if isinstance(p, int) else p for p in parts))


def test_producer_then_colocated_consumer_equals_colocated(fleet):
    f = fleet
    before = mm(f.cons)
    n_images = 0
    for parts in PROMPTS:
        body = _prompt(parts)
        params = encode(f, body)
        n_images += len(params)
        got = post(f.cons, dict(body, ec_transfer_params=params))
        want = post(f.colo, body)
        assert ids(got) == ids(want), parts
    after = mm(f.cons)
    assert after["ec_storage"] - before["ec_storage"] == n_images
    assert (after["computed"], after["cached"]) == (before["computed"], before["cached"])
    metrics = httpx.get(f.cons.url + "/metrics", timeout=10).text
    assert f'pdgate_engine_mm_embeddings_total{{source="ec_storage"}} {float(after["ec_storage"])}' in metrics
    assert_clean(f.cons)


def test_producer_then_nixl_prefill_consumer_then_decode(fleet):
    f = fleet
    before = mm(f.p)
    n_images = 0
    for parts in [("look: ", 40), (41, " or ", 42, " which one?")]:
        body = _prompt(parts)
        params = encode(f, body)
        n_images += len(params)

        async def pd(b=dict(body, ec_transfer_params=params)):
            async with httpx.AsyncClient(timeout=60) as c:
                return await router.nixl(c, f.p, f.d, "/v1/chat/completions", b)
        rp, rd = asyncio.run(pd())
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        want = post(f.colo, body)
        assert ids(rd.json()) == ids(want), parts
        usage = rd.json()["usage"]  # the decode pulled the prompt's KV (vLLM recomputes one token)
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    after = mm(f.p)
    assert after["ec_storage"] - before["ec_storage"] == n_images
    assert (after["computed"], after["cached"]) == (before["computed"], before["cached"])
    assert mm(f.d)["computed"] == 0 and mm(f.d)["ec_storage"] == 0  # the decode never saw an image
    assert_clean(f.p, f.d)


def test_a_tampered_file_changes_the_answer(fleet):
    """Zeros of the right shape written over the producer's file: the consumer loads them
    (counted ec_storage) and answers differently from the colocated worker."""
    f = fleet
    body = chat("what is this? ", png(50), max_tokens=16)
    encode(f, body)
    with open(path_of(f, png(50)), "wb") as fh:
        fh.write(dumps({"ec_cache": np.zeros(SHAPE, np.float32)}))
    before = mm(f.cons)
    got = post(f.cons, body)
    assert ids(got) != ids(post(f.colo, body))
    after = mm(f.cons)
    assert (after["ec_storage"] - before["ec_storage"], after["computed"] - before["computed"]) == (1, 0)


def test_a_missing_file_is_computed_here(fleet):
    f = fleet
    body = chat("never encoded: ", png(60))
    assert not os.path.exists(path_of(f, png(60)))
    before, fb = mm(f.cons), files(f.cons)
    assert ids(post(f.cons, body)) == ids(post(f.colo, body))
    after = mm(f.cons)
    assert (after["computed"] - before["computed"], after["ec_storage"] - before["ec_storage"]) == (1, 0)
    assert files(f.cons)["missing"] - fb["missing"] == 1


CORRUPT = {
    "truncated": lambda good: good[:-10],
    "garbage": lambda good: b"this is not a safetensors file",
    "wrong_shape": lambda good: dumps({"ec_cache": np.ones((8, 64), np.float32)}),
    "wrong_name": lambda good: dumps({"embeddings": np.ones(SHAPE, np.float32)}),
    "not_finite": lambda good: dumps({"ec_cache": np.full(SHAPE, np.nan, np.float32)}),
    "trailing_bytes": lambda good: good + b"\0" * 4,
}


@pytest.mark.parametrize("kind", list(CORRUPT))
def test_a_corrupt_file_is_computed_here_and_counted(fleet, kind):
    f = fleet
    data = png(100 + list(CORRUPT).index(kind))
    body = chat("broken: ", data)
    encode(f, body)
    path = path_of(f, data)
    with open(path, "rb") as fh:
        good = fh.read()
    with open(path, "wb") as fh:
        fh.write(CORRUPT[kind](good))
    before, fb = mm(f.cons), files(f.cons)
    assert ids(post(f.cons, body)) == ids(post(f.colo, body))
    after = mm(f.cons)
    assert (after["computed"] - before["computed"], after["ec_storage"] - before["ec_storage"]) == (1, 0)
    assert files(f.cons)["invalid"] - fb["invalid"] == 1


def test_ec_both_computes_saves_and_loads(fleet):
    """ec_both: a missing file is computed here and written; its answer carries
    ec_transfer_params, and a consumer then loads what it wrote."""
    f = fleet
    data = png(70)
    body = chat("both ways: ", data)
    before, fb = mm(f.both), files(f.both)
    out = post(f.both, body)
    assert ids(out) == ids(post(f.colo, body))
    assert out["ec_transfer_params"] == {sha(data): {"item_indices": [0], "metadata": {}}}
    assert mm(f.both)["computed"] - before["computed"] == 1 and files(f.both)["saved"] - fb["saved"] == 1
    c0 = mm(f.cons)
    assert ids(post(f.cons, body)) == ids(out)
    assert mm(f.cons)["ec_storage"] - c0["ec_storage"] == 1
    # and an ec_both worker that has not seen an image loads it when its file is there
    other = png(71)
    encode(f, chat(other))
    b0 = mm(f.both)
    post(f.both, chat("loaded: ", other))
    assert (mm(f.both)["ec_storage"] - b0["ec_storage"], mm(f.both)["computed"] - b0["computed"]) == (1, 0)


@pytest.mark.parametrize("value", ["abc", [1, 2], 3, True])
def test_ec_transfer_params_must_be_an_object(fleet, value):
    for w, path in ((fleet.cons, "/v1/chat/completions"), (fleet.colo, "/v1/completions")):
        body = chat("x") if path.endswith("chat/completions") else {"model": MODEL, "prompt": "x", "max_tokens": 2}
        r = httpx.post(w.url + path, json=dict(body, ec_transfer_params=value), timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert (err["type"], err["param"]) == ("invalid_request_error", "ec_transfer_params")
    assert post(fleet.cons, dict(chat("x"), ec_transfer_params=None))["choices"]
    assert post(fleet.cons, dict(chat("x"), ec_transfer_params={"anything": {}}))["choices"]


def test_an_unsupported_connector_stops_the_cli():
    cfg = json.dumps({"ec_connector": "ECMooncakeConnector", "ec_role": "ec_consumer"})
    out = subprocess.run([sys.executable, "-m", "pdgate.engine", "--model", MODEL, "--port", "1",
                          "--ec-transfer-config", cfg], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(pdgate.__file__))))
    assert out.returncode == 1
    assert "ECMooncakeConnector" in out.stderr and "ECExampleConnector" in out.stderr
