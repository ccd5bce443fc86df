"""`POST /encode` of an encode worker (`--encoder-only`): the EPD encode leg over HTTP.

The body takes SGLang's encode-server fields (`mm_items`: image URLs, `req_id`, `num_parts`,
`part_idx`) and TokenSpeed's rendezvous (`items`: one `{"bootstrap_room": R}` per image, as its
`EncodeItemAssignment`); see docs/protocols.md, "EPD". Every image is decoded and checked before
any is encoded, so a bad one fails the whole call with a 400 and offers nothing. Each image's
embedding comes from the cache or the tower, and with a room it waits there for the prefill
(`transfer/embed.py`). The answer comes once the embeddings are ready (TokenSpeed answers when
the work is queued): `{req_id, accepted, items: [{content_hash, bootstrap_room, embedding_len,
embedding_dim, embedding_size, cached}]}`, the sizes named as SGLang's encode server names them.

`--fault-encode` (tests only) breaks the call on purpose: `hang` reads it and never answers
(until an `/abort_request` for its req_id or the bootstrap timeout), `garbage` answers 200 with
a body that is not JSON and encodes nothing, `bad-embedding` answers as usual but offers each
embedding under another content hash, which the prefill refuses.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from .http_common import read_json
from .multimodal import load_image
from .sampling import BadRequest
from .sequence import EngineError

GARBAGE = "<html><body>502 Bad Gateway</body></html>"


def _rooms(body: dict, n: int) -> list[int | None]:
    items = body.get("items")
    if items is None:
        return [None] * n
    if not isinstance(items, list) or len(items) != n:
        raise BadRequest(f"items must be a list with one entry per mm_items entry ({n})", "items")
    rooms = []
    for it in items:
        room = it.get("bootstrap_room") if isinstance(it, dict) else None
        if not isinstance(room, int) or isinstance(room, bool) or room < 0:
            raise BadRequest("each items entry needs a non-negative integer bootstrap_room", "items")
        rooms.append(room)
    if len(set(rooms)) != len(rooms):
        raise BadRequest("bootstrap_room values must differ between items", "items")
    return rooms


async def encode(request: web.Request) -> web.Response:
    e = request.app["engine"]
    body = await read_json(request)
    urls = body.get("mm_items")
    if not isinstance(urls, list) or not urls:
        raise BadRequest("mm_items must be a non-empty list of image URLs", "mm_items")
    req_id = body.get("req_id")
    if req_id is not None and not isinstance(req_id, str):
        raise BadRequest("req_id must be a string", "req_id")
    rooms = _rooms(body, len(urls))
    images = [load_image(u, i, e.cfg, "mm_items") for i, u in enumerate(urls)]
    for room in rooms:
        if room is not None:
            e.embeds.check_free(room)
    e.embeds.track(req_id, rooms)
    fault = e.config.fault_encode
    if fault == "hang":
        await _hang(e, req_id)
    if fault == "garbage":
        return web.Response(text=GARBAGE, content_type="text/html")
    out = []
    for img, room in zip(images, rooms):
        emb, cached = e.images.embed(img)
        if room is not None:
            e.embeds.offer(room, "0" * 64 if fault == "bad-embedding" else img.content_hash, emb)
        out.append({"content_hash": img.content_hash, "bootstrap_room": room,
                    "embedding_len": emb.shape[0], "embedding_dim": emb.shape[1],
                    "embedding_size": emb.nbytes, "cached": cached})
    return web.json_response({"req_id": req_id, "accepted": True, "items": out})


async def _hang(e, req_id: str | None) -> None:
    """`--fault-encode hang`: never answer; give up when the call is aborted (its rooms are
    dropped) or after the bootstrap timeout, whichever comes first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + e.ctx.timeouts.bootstrap
    while loop.time() < deadline and (req_id is None or not e.embeds.is_aborted(req_id)):
        await asyncio.sleep(0.05)
    raise EngineError(f"--fault-encode hang: encode request {req_id} gave up", 499, "aborted")
