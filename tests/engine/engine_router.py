"""A minimal router that follows docs/protocols.md, written with plain httpx: the engine must work
behind any such router, not only behind pdgate."""

from __future__ import annotations

import asyncio
import random
import uuid

import httpx

NIXL_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                       "remote_block_ids": None, "remote_host": None, "remote_port": None}


def bootstrap_body(body: dict, prefill, room: int | list[int]) -> dict:
    return dict(body, bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port,
                bootstrap_room=room)


async def bootstrap(c: httpx.AsyncClient, p, d, path: str, body: dict, rng: random.Random):
    """Same body to P and D concurrently; the client gets D's answer. Returns (P resp, D resp)."""
    b = bootstrap_body(body, p, rng.randrange(2**63))
    return await asyncio.gather(c.post(p.url + path, json=b), c.post(d.url + path, json=b))


def _prefill_leg(body: dict, params: dict) -> dict:
    pb = dict(body, stream=False, max_tokens=1, kv_transfer_params=params)
    if "messages" in pb:
        pb["max_completion_tokens"] = 1
    for k in ("stream_options", "min_tokens", "min_completion_tokens"):
        pb.pop(k, None)
    return pb


async def nixl(c: httpx.AsyncClient, p, d, path: str, body: dict):
    """P with max_tokens 1 and empty params, then D with P's params verbatim."""
    hdr = {"X-Request-Id": uuid.uuid4().hex}
    rp = await c.post(p.url + path, json=_prefill_leg(body, dict(NIXL_PREFILL_PARAMS)), headers=hdr)
    rp.raise_for_status()
    params = rp.json()["kv_transfer_params"]
    rd = await c.post(d.url + path, json=dict(body, kv_transfer_params=params), headers=hdr)
    return rp, rd


async def mooncake(c: httpx.AsyncClient, p, d, path: str, body: dict):
    """Mint a transfer id, learn P's engine id from its bootstrap /query, run both legs at once."""
    q = (await c.get(f"http://127.0.0.1:{p.bootstrap_port}/query")).json()
    engine_id = next(iter(q.values()))["engine_id"]
    tid = f"xfer-{uuid.uuid4()}"
    pb = _prefill_leg(body, {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid})
    db = dict(body, kv_transfer_params={
        "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": tid,
        "remote_engine_id": engine_id, "remote_bootstrap_addr": f"http://127.0.0.1:{p.bootstrap_port}"})
    return await asyncio.gather(c.post(p.url + path, json=pb), c.post(d.url + path, json=db))


def image_urls(body: dict) -> list[str]:
    """The data URLs of a chat body's `image_url` parts, in prompt order."""
    return [p["image_url"]["url"] for m in body.get("messages", []) if isinstance(m.get("content"), list)
            for p in m["content"] if isinstance(p, dict) and p.get("type") == "image_url"]


async def epd(c: httpx.AsyncClient, e, p, d, path: str, body: dict, rng: random.Random):
    """E/P/D as SMG's EPD router runs it (docs/protocols.md, "EPD"): one room per image, one
    encode call per image (TokenSpeed's one item per Encode), the prefill told where each
    embedding waits (`encode_bootstrap_info`), and the encode calls sent together with the
    bootstrap-style P and D legs. Text-only bodies skip the encode leg.
    Returns (encode responses, P response, D response)."""
    urls = image_urls(body)
    rooms = [rng.randrange(2**63) for _ in urls]
    b = bootstrap_body(body, p, rng.randrange(2**63))
    if urls:
        b["encode_bootstrap_info"] = {"items": [
            {"item_index": i, "bootstrap_host": "127.0.0.1", "bootstrap_port": e.bootstrap_port,
             "bootstrap_room": r} for i, r in enumerate(rooms)]}
    encodes = [c.post(e.url + "/encode", json={"req_id": f"encode-{uuid.uuid4().hex}", "mm_items": [u],
                                               "items": [{"bootstrap_room": r}]})
               for u, r in zip(urls, rooms)]
    *re, rp, rd = await asyncio.gather(*encodes, c.post(p.url + path, json=b), c.post(d.url + path, json=b))
    return re, rp, rd


async def ec_encode(c: httpx.AsyncClient, encoder, body: dict) -> tuple[list[httpx.Response], dict | None]:
    """vLLM's disaggregated-encoder proxy (examples/online_serving/disaggregated_encoder/
    disagg_epd_proxy.py), its encode step: each image part of the body goes to the encoder (an
    `ec_producer`) as a chat request of its own (`max_tokens` 1, not streamed, `x-request-id`
    `<parent>:<i>:<6 hex>`), all at once; the proxy waits for every answer before the prefill
    (or colocated) leg runs on the ORIGINAL body.
    Returns the answers and their `ec_transfer_params` merged (None when there are no images)."""
    parts = [p for m in body.get("messages", []) if isinstance(m.get("content"), list)
             for p in m["content"] if isinstance(p, dict) and p.get("type") == "image_url"]
    parent = uuid.uuid4().hex
    answers = await asyncio.gather(*(c.post(
        encoder.url + "/v1/chat/completions",
        json={"model": body.get("model"), "messages": [{"role": "user", "content": [part]}],
              "max_tokens": 1, "stream": False},
        headers={"x-request-id": f"{parent}:{i}:{uuid.uuid4().hex[:6]}"}) for i, part in enumerate(parts)))
    merged: dict = {}
    for r in answers:
        if r.status_code == 200:
            merged.update(r.json().get("ec_transfer_params") or {})
    return list(answers), merged or None
