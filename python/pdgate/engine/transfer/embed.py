"""EPD: image embeddings from an encode worker to a prefill over the side channel, the rows as
TCP frames or written by the Mooncake Transfer Engine (`embed_plane`).

The rendezvous is TokenSpeed's (docs/protocols.md, "EPD"): the gateway mints a room per image
and gives it to both the encode worker (`POST /encode`, `items[].bootstrap_room`) and the prefill
(`encode_bootstrap_info.items[]`, with the encode worker's bootstrap host and port). The encode
worker is the data source: it runs the bootstrap server, and the prefill finds its side channel
there, connects, and registers for the room. Either may come first:

    prefill -> encode   {"op": "embed_register", "room", "content_hash", "shape",
                         "data_plane": {"backend": "mooncake", "session", "addr", "bytes"} (optional)}
    encode  -> prefill  {"op": "embed", "room", "content_hash", "shape", "dtype": "float32"} + rows
                        or {"op": "embed_written", ..., "backend", "addr", "bytes", "digest"}
                        (the rows are in the prefill's staging slot already)
                        or {"op": "error", "message"}
    prefill -> encode   {"op": "ack", "room"}

A prefill announces a staging slot only when it runs Mooncake and has a free slot; an encode
worker writes through Mooncake only when it runs it too and the write succeeds, else it sends
the rows as TCP frames, which every prefill takes (so old and new, Mooncake or not, pair up).
An encode worker sends its answer only after its write has ended: once the prefill has an
answer, nothing more lands in its slot.

The prefill checks room, hash, shape and size (and for written rows the slot, the backend and
the digest) before it uses a byte. An embedding nobody registers for within the bootstrap
timeout is dropped, as is a registration no encode answers; a registration whose prefill
closes its connection (it was aborted) is dropped at once.
An `/abort_request` whose rid is a prefix of the encode call's `req_id` drops that call's rooms
at once (an offered embedding, a waiting registration: it gets an error), and a later
`/encode` with that `req_id` is refused, so an abandoned request pins nothing here.
"""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np

from ..sequence import EngineError
from . import wire
from .context import TransferContext, with_timeout
from .embed_plane import MooncakeEmbedPlane, digest

log = logging.getLogger("pdgate.engine.transfer")


class EmbedSource:
    """Encode side: embeddings offered by room, waiting for the prefill that registers for it."""

    def __init__(self, ctx: TransferContext, counts: dict, nbytes: dict,
                 plane: MooncakeEmbedPlane | None = None):
        # nbytes: {backend: {"sent": n, ...}}, the bytes each data plane moved
        self.ctx, self.counts, self.nbytes, self.plane = ctx, counts, nbytes, plane
        self.slots: dict[int, asyncio.Future] = {}
        self.claimed: set[int] = set()
        self._expiry: dict[int, asyncio.TimerHandle] = {}
        self.req_of: dict[int, str] = {}            # room -> the /encode req_id that owns it
        # aborted req_ids and abort rids (prefixes), kept for a late /encode
        self.aborted: dict[str, asyncio.TimerHandle] = {}

    def track(self, req_id: str | None, rooms: list[int | None]) -> None:
        """An `/encode` call's rooms, by its req_id (for `/abort_request`); refused if that
        req_id was aborted already (the abort overtook the call)."""
        if req_id is None:
            return
        if self.is_aborted(req_id):
            raise EngineError(f"encode request {req_id} was aborted", 499, "aborted")
        for room in rooms:
            if room is not None:
                self.req_of[room] = req_id

    def is_aborted(self, req_id: str) -> bool:
        return any(req_id.startswith(k) for k in self.aborted)

    def abort(self, hit, rid: str | None = None) -> int:
        """`/abort_request`: drop the rooms of every `/encode` whose req_id `hit` matches. A
        registration waiting for one of them is answered with an error; an offered embedding
        nobody claimed is freed. `rid` (the abort's prefix; none for abort_all) is kept too, so
        an `/encode` that the abort overtook is refused when it comes. Returns how many rooms
        were dropped."""
        loop = asyncio.get_running_loop()
        rooms = [r for r, req in self.req_of.items() if hit(req)]
        for req in {self.req_of[r] for r in rooms} | ({rid} if rid else set()):
            if req not in self.aborted:
                self.aborted[req] = loop.call_later(self.ctx.timeouts.bootstrap, self.aborted.pop, req, None)
        for room in rooms:
            del self.req_of[room]
            fut = self.slots.get(room)
            if fut is None:
                continue
            if not fut.done():
                fut.set_exception(EngineError(f"room {room}: the encode request was aborted", 499, "aborted"))
                fut.exception()  # retrieved: a slot nobody waits on must not log an unretrieved error
            if room not in self.claimed:
                self._drop(room, fut)
        return len(rooms)

    def _slot(self, room: int) -> asyncio.Future:
        return self.slots.setdefault(room, asyncio.get_running_loop().create_future())

    def check_free(self, room: int) -> None:
        fut = self.slots.get(room)
        if fut is not None and fut.done():
            raise EngineError(f"bootstrap_room {room} already holds an embedding", 400, "duplicate_bootstrap_room")

    def offer(self, room: int, content_hash: str, emb: np.ndarray) -> None:
        self.check_free(room)
        fut = self._slot(room)
        fut.set_result((content_hash, np.ascontiguousarray(emb, dtype=np.float32)))
        if room not in self.claimed:
            loop = asyncio.get_running_loop()
            self._expiry[room] = loop.call_later(self.ctx.timeouts.bootstrap, self._expire, room, fut)

    def _expire(self, room: int, fut: asyncio.Future) -> None:
        self._expiry.pop(room, None)
        if self.slots.get(room) is fut and room not in self.claimed:
            log.info("embedding for room %d expired: no prefill registered", room)
            del self.slots[room]
            self.req_of.pop(room, None)

    def _drop(self, room: int, fut: asyncio.Future) -> None:
        self.claimed.discard(room)
        self.req_of.pop(room, None)
        t = self._expiry.pop(room, None)
        if t is not None:
            t.cancel()
        if self.slots.get(room) is fut:
            del self.slots[room]

    @property
    def pending(self) -> int:
        return len(self.slots)

    async def on_register(self, hdr: dict, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        room = hdr.get("room")
        if not isinstance(room, int) or room in self.claimed:
            await wire.send(writer, {"op": "error", "message": f"bad or duplicate registration for room {room!r}"})
            return
        fut = self._slot(room)
        self.claimed.add(room)
        try:
            if not await self._until_offered(room, fut, reader):
                return  # the prefill went away: nobody waits for this room any more
            if not fut.done():
                await wire.send(writer, {"op": "error", "message": f"no embedding for room {room} within "
                                         f"{self.ctx.timeouts.bootstrap:g}s"})
                return
            try:
                content_hash, emb = fut.result()
            except EngineError as e:  # aborted
                await wire.send(writer, {"op": "error", "message": str(e)})
                return
            want = hdr.get("content_hash")
            if want is not None and want != content_hash:
                await wire.send(writer, {"op": "error", "message": f"room {room} holds image {content_hash}, "
                                         f"not {want}"})
                return
            backend = await self._send_rows(writer, room, content_hash, emb, hdr.get("data_plane"))
            ack, _ = await asyncio.wait_for(wire.recv(reader, 0), self.ctx.timeouts.transfer)
            if ack.get("op") == "ack" and ack.get("room") == room:
                self.counts["sent"] += 1
                self.nbytes[backend]["sent"] += emb.nbytes
        finally:
            self._drop(room, fut)

    async def _send_rows(self, writer: asyncio.StreamWriter, room: int, content_hash: str,
                         emb: np.ndarray, peer: dict | None) -> str:
        """The rows to the prefill: written into its staging slot when both sides run the
        plane and the write succeeds, else as a TCP frame. Returns the backend that moved them."""
        hdr = {"op": "embed", "room": room, "content_hash": content_hash, "shape": list(emb.shape),
               "dtype": "float32"}
        plane = self.plane
        if plane is not None and plane.accepts(peer, emb.nbytes) and await self._write(plane, peer, emb, room):
            await wire.send(writer, dict(hdr, op="embed_written", backend=plane.name, addr=peer["addr"],
                                         bytes=emb.nbytes, digest=digest(emb)))
            return plane.name
        await wire.send(writer, hdr, emb.tobytes())
        return "tcp"

    async def _write(self, plane: MooncakeEmbedPlane, peer: dict, emb: np.ndarray, room: int) -> bool:
        """Write through the plane from a slot of our own; False (counted) means send TCP frames.
        Returns only once the write has ended: no answer may overtake a write still landing."""
        slot = plane.take(time.monotonic())
        if slot is None:
            return False
        fut = asyncio.get_running_loop().run_in_executor(None, plane.write, peer, emb, slot)
        try:
            await with_timeout(asyncio.shield(fut), self.ctx.timeouts.transfer,
                               f"writing the embedding of room {room} through {plane.name}")
            return True
        except (RuntimeError, EngineError) as e:
            plane.fallbacks["write_failed"] += 1
            log.warning("room %d: %s write failed, sending the rows as TCP frames: %s", room, plane.name, e)
            return False
        finally:
            if not fut.done():
                await asyncio.gather(fut, return_exceptions=True)
            plane.give_back(slot, True, time.monotonic())

    async def _until_offered(self, room: int, fut: asyncio.Future, reader: asyncio.StreamReader) -> bool:
        """Wait for the room's embedding (or its abort), at most the bootstrap timeout, while
        watching the registered prefill's connection: False when the prefill closed it first
        (it was aborted or gave up), so its registration is dropped at once, not at the
        timeout. The prefill sends nothing before the embedding, so any byte is a hang-up too."""
        gone = asyncio.ensure_future(reader.read(1))
        try:
            await asyncio.wait({fut, gone}, timeout=self.ctx.timeouts.bootstrap,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not fut.done() and gone.done():
            log.info("room %d: the prefill left before the embedding was offered", room)
            return False
        return True


async def embed_receive(ctx: TransferContext, addr: tuple[str, int], room: int, content_hash: str,
                        shape: tuple[int, int], plane: MooncakeEmbedPlane | None = None
                        ) -> tuple[np.ndarray, str]:
    """Prefill side: register for `room` at the encode worker's side channel (announcing a
    staging slot of `plane` when one is free), take and check the rows, ack. Returns the rows
    and the backend that moved them. Bounded by the bootstrap timeout (the encode may still be
    running). The slot is given back however this ends: free at once when the encode worker has
    answered, else quarantined (a write may still land)."""
    size = shape[0] * shape[1] * 4

    async def attempt() -> tuple[np.ndarray, str]:
        writer, slot, settled = None, None, True
        try:
            if plane is not None:
                slot = plane.take(time.monotonic())  # None: no free slot, TCP frames (counted)
            reader, writer = await asyncio.open_connection(*addr)
            reg = {"op": "embed_register", "room": room, "content_hash": content_hash,
                   "shape": list(shape), "engine_id": ctx.engine_id}
            if slot is not None:
                reg["data_plane"] = plane.describe(slot)
                settled = False  # from now on a write may land in the slot, until an answer
            await wire.send(writer, reg)
            hdr, payload = await wire.recv(reader, size)
            settled = True  # the encode worker answered: it writes nothing more
            if hdr.get("op") == "error":
                raise EngineError(f"encode worker: {hdr.get('message')}", 500, "embedding_transfer_failed")
            if hdr.get("op") not in ("embed", "embed_written") or \
                    (hdr.get("room"), hdr.get("content_hash"), hdr.get("dtype")) != (room, content_hash, "float32") \
                    or tuple(hdr.get("shape") or ()) != tuple(shape):
                raise _mismatch(room, hdr)
            if hdr["op"] == "embed":
                if len(payload) != size:
                    raise _mismatch(room, hdr)
                emb, backend = np.frombuffer(payload, dtype=np.float32).reshape(shape).copy(), "tcp"
            else:
                if slot is None or payload or hdr.get("backend") != plane.name or \
                        hdr.get("addr") != plane.describe(slot)["addr"] or hdr.get("bytes") != size:
                    raise _mismatch(room, hdr)
                emb, backend = plane.read(slot, shape), plane.name
                if digest(emb) != hdr.get("digest"):
                    settled = False  # another write landed here: keep the slot out of use a while
                    raise EngineError(f"the embedding written for room {room} does not match its digest",
                                      500, "embedding_transfer_failed")
            await wire.send(writer, {"op": "ack", "room": room})
            return emb, backend
        except (wire.WireError, ConnectionError, OSError) as e:
            raise EngineError(f"embedding transfer for room {room} failed: {e}", 500,
                              "embedding_transfer_failed") from None
        finally:
            if slot is not None:
                plane.give_back(slot, settled, time.monotonic())
            await wire.close(writer)
    return await with_timeout(attempt(), ctx.timeouts.bootstrap, f"receiving the embedding of room {room}")


def _mismatch(room: int, hdr: dict) -> EngineError:
    return EngineError(f"encode worker sent a mismatched embedding for room {room}: {hdr}",
                       500, "embedding_transfer_failed")
