"""SGLang-style PD ("bootstrap") mocks that enforce the rendezvous of docs/protocols.md §1.

The prefill runs a bootstrap server. For each room the decode first reserves KV there, then
waits for the KV; the prefill waits for the reservation before "computing", writes the KV (the
first token and the cached-token count), and answers only after the decode has read it. So a
gateway that sends the decode leg only after the prefill answered stalls until the rendezvous
timeout and fails, as with real engines.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from . import model
from .core import LegFailure, MockWorker
from .model import Item

HEALTH_CHECK_HOST = "2.2.2.2"  # engines skip the transfer for this reserved host
MAX_ROOM = 2**63 - 1


@dataclass
class Room:
    reserved: asyncio.Event = field(default_factory=asyncio.Event)
    kv: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    consumed: asyncio.Event = field(default_factory=asyncio.Event)
    prompt_key: int | None = None


def bootstrap_fields(worker: MockWorker, body: dict[str, Any], items: list[Item]) -> list[tuple[str, int | None, int]]:
    """(host, port, room) per item; records a violation and raises 400 when malformed."""
    missing = [k for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room") if k not in body]
    if missing:
        raise worker.violation(f"missing bootstrap fields {missing}")
    host, port, room = body["bootstrap_host"], body["bootstrap_port"], body["bootstrap_room"]
    n = len(items)
    if isinstance(room, list):
        if not (isinstance(host, list) and isinstance(port, list)) or not (len(host) == len(port) == len(room) == n):
            raise worker.violation(f"bootstrap lists must all have {n} entries (one per item)")
        if len(set(room)) != n:
            raise worker.violation("bootstrap_room list repeats a room")
        triples = list(zip(host, port, room))
    else:
        if isinstance(host, list) or isinstance(port, list):
            raise worker.violation("bootstrap_host/port are lists but bootstrap_room is not")
        triples = [(host, port, room + i) for i in range(n)]  # the engine's R+i rule
    for h, p, r in triples:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r <= MAX_ROOM:
            raise worker.violation(f"bootstrap_room {r!r} is not an integer in [0, 2^63-1]")
        if not isinstance(h, str) or (p is not None and not isinstance(p, int)):
            raise worker.violation(f"bad bootstrap_host/port {h!r}/{p!r}")
    return triples


class BootstrapPrefill(MockWorker):
    role = "prefill"
    prefill_only = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bootstrap_port = 0
        self.rooms: dict[int, Room] = {}

    async def start(self) -> None:
        await super().start()
        app = web.Application()
        app.router.add_post("/reserve", self.reserve)
        app.router.add_get("/kv", self.read_kv)
        self.bootstrap_port = await self.serve(app)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "bootstrap_port": self.bootstrap_port}

    def room(self, room: int) -> Room:
        return self.rooms.setdefault(room, Room())

    def held(self) -> int:
        # Rooms with KV written but not yet read by a decode are held memory.
        return sum(1 for r in self.rooms.values() if r.kv.done() and not r.consumed.is_set())

    async def reserve(self, request: web.Request) -> web.Response:
        body = await request.json()
        room = self.room(int(body["room"]))
        room.prompt_key = body.get("prompt_key")
        room.reserved.set()
        return web.json_response({"ok": True})

    async def read_kv(self, request: web.Request) -> web.Response:
        room = self.room(int(request.query["room"]))
        timeout = float(self.knobs["rendezvous_timeout_s"])
        try:
            kv = await asyncio.wait_for(asyncio.shield(room.kv), timeout)
        except asyncio.TimeoutError:
            return web.json_response({"error": "no KV for this room"}, status=504)
        room.consumed.set()
        return web.json_response(kv)

    async def prepare(self, api: str, body: dict[str, Any], items: list[Item], request: web.Request) -> None:
        triples = bootstrap_fields(self, body, items)
        if all(h == HEALTH_CHECK_HOST for h, _, _ in triples):
            return
        for h, p, r in triples:
            if h != self.host or p not in (self.bootstrap_port, None):
                raise self.violation(f"bootstrap_host/port {h}:{p} is not this prefill ({self.host}:{self.bootstrap_port})")
        timeout = float(self.knobs["rendezvous_timeout_s"])
        for item, (_, _, r) in zip(items, triples):
            room = self.room(r)
            try:
                await asyncio.wait_for(room.reserved.wait(), timeout)
            except asyncio.TimeoutError:
                raise LegFailure(f"bootstrap timeout: no decode reserved room {r}") from None
            if room.prompt_key != model.prompt_key(item.prompt_ids):
                raise LegFailure(f"room {r}: decode reserved it for a different prompt")
            first = model.token(item.prompt_ids, 0)
            if not room.kv.done():
                room.kv.set_result({"first_token": list(first), "cached_tokens": len(item.prompt_ids)})
        # The prefill answers only after every transfer completed.
        for _, _, r in triples:
            try:
                await asyncio.wait_for(self.rooms[r].consumed.wait(), timeout)
            except asyncio.TimeoutError:
                raise LegFailure(f"transfer of room {r} never completed") from None
            self.rooms.pop(r, None)
        for item in items:
            item.cached_tokens = len(item.prompt_ids)


class BootstrapDecode(MockWorker):
    role = "decode"
    logprob_side = "decode"

    async def prepare(self, api: str, body: dict[str, Any], items: list[Item], request: web.Request) -> None:
        triples = bootstrap_fields(self, body, items)
        if all(h == HEALTH_CHECK_HOST for h, _, _ in triples):
            return
        timeout = aiohttp.ClientTimeout(total=float(self.knobs["rendezvous_timeout_s"]) + 5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for item, (h, p, r) in zip(items, triples):
                base = f"http://{h}:{p if p is not None else 8998}"
                try:
                    async with session.post(f"{base}/reserve", json={"room": r, "prompt_key": model.prompt_key(item.prompt_ids)}) as resp:
                        resp.raise_for_status()
                except aiohttp.ClientError as exc:
                    raise LegFailure(f"cannot reach bootstrap server {base}: {exc}") from None
            for item, (h, p, r) in zip(items, triples):
                base = f"http://{h}:{p if p is not None else 8998}"
                async with session.get(f"{base}/kv", params={"room": str(r)}) as resp:
                    if resp.status != 200:
                        raise LegFailure(f"KV transfer for room {r} failed ({resp.status})")
                    kv = await resp.json()
                item.first_token = (kv["first_token"][0], kv["first_token"][1])
                item.cached_tokens = kv["cached_tokens"]
