"""Optional data plane for EPD embeddings: the Mooncake Transfer Engine writes an embedding's
rows into a staging slot that the prefill registered (`--disaggregation-transfer-backend mooncake`
on both sides; the rendezvous and checks stay those of `embed`).

Registering memory with the engine per request is costly, so a worker registers one staging
area at startup, `--mm-embedding-staging-slots` slots of one embedding each, and hands out a
slot per transfer:

- a prefill takes a slot when it registers for a room and announces it in its `embed_register`
  frame (`data_plane`: backend, session, slot address, slot bytes); the encode worker writes the
  rows there, then says so in an `embed_written` frame that carries a digest of the bytes. The
  slot is free again once the encode worker has answered (rows written and copied out, TCP
  rows, an error);
- an encode worker copies the rows into a slot of its own and writes from there (only Mooncake's
  TCP protocol reads unregistered memory) and frees it once the write has ended.

No free slot: that embedding travels as TCP frames (counted `no_slot`); nothing waits for a slot.
A slot a prefill gave up on before any answer (timeout, cancellation, a broken connection) may
still take a late write, so it is quarantined for a grace period (the transfer timeout) before
it is handed out again; and the prefill checks every written embedding against its digest, so
a stray write is caught, never used. Time comes in as `now` (a monotonic clock reading).
"""

from __future__ import annotations

import hashlib

import numpy as np


def digest(rows: np.ndarray) -> str:
    """What an `embed_written` frame carries: SHA-256 (hex) of the rows' bytes."""
    return hashlib.sha256(np.ascontiguousarray(rows).tobytes()).hexdigest()


class StagingArea:
    """`slots` buffers of `slot_bytes` in one array, which the owner registers once. Pure
    bookkeeping: which slots are free, in use, or quarantined until a deadline."""

    def __init__(self, slots: int, slot_bytes: int, grace: float):
        if slots < 1 or slot_bytes < 1:
            raise ValueError("a staging area needs at least one slot of at least one byte")
        self.slots, self.slot_bytes, self.grace = slots, slot_bytes, grace
        self.buf = np.zeros(slots * slot_bytes, dtype=np.uint8)
        self.free: list[int] = list(range(slots - 1, -1, -1))  # pop() hands out the lowest first
        self.in_use: set[int] = set()
        self.quarantine: dict[int, float] = {}  # slot -> when it may be handed out again

    def _thaw(self, now: float) -> None:
        for slot in [s for s, until in self.quarantine.items() if until <= now]:
            del self.quarantine[slot]
            self.free.append(slot)

    def acquire(self, now: float) -> int | None:
        """A free slot, or None when every slot is in use or quarantined."""
        self._thaw(now)
        if not self.free:
            return None
        slot = self.free.pop()
        self.in_use.add(slot)
        return slot

    def release(self, slot: int, settled: bool, now: float) -> None:
        """Give `slot` back: free at once when no write can land in it any more (`settled`),
        else quarantined for the grace period. Releasing a slot twice does nothing."""
        if slot not in self.in_use:
            return
        self.in_use.discard(slot)
        if settled or self.grace <= 0:
            self.free.append(slot)
        else:
            self.quarantine[slot] = now + self.grace

    def address(self, slot: int) -> int:
        return self.buf.ctypes.data + slot * self.slot_bytes

    def view(self, slot: int, nbytes: int) -> np.ndarray:
        start = slot * self.slot_bytes
        return self.buf[start:start + nbytes]

    def stats(self, now: float) -> dict:
        self._thaw(now)
        return {"slots": self.slots, "slot_bytes": self.slot_bytes, "in_use": len(self.in_use),
                "quarantined": len(self.quarantine)}


class MooncakeEmbedPlane:
    """A worker's staging area registered with its Mooncake Transfer Engine (`MooncakeBackend`,
    whose engine also moves the KV pages), and the fallbacks to TCP it counted."""

    name = "mooncake"

    def __init__(self, backend, slots: int, slot_bytes: int, grace: float):
        self.backend = backend
        self.staging = StagingArea(slots, slot_bytes, grace)
        backend.register(self.staging.buf)
        # embeddings sent as TCP frames although both sides could use the plane
        self.fallbacks = {"no_slot": 0, "write_failed": 0}

    def take(self, now: float) -> int | None:
        """A slot for one embedding; None (counted) sends that embedding as TCP frames."""
        slot = self.staging.acquire(now)
        if slot is None:
            self.fallbacks["no_slot"] += 1
        return slot

    def give_back(self, slot: int, settled: bool, now: float) -> None:
        self.staging.release(slot, settled, now)

    def describe(self, slot: int) -> dict:
        """The `data_plane` of an `embed_register` frame: where the rows may be written."""
        return {"backend": self.name, "session": self.backend.session,
                "addr": self.staging.address(slot), "bytes": self.staging.slot_bytes}

    def accepts(self, peer, nbytes: int) -> bool:
        """Whether a prefill's `data_plane` lets this worker write `nbytes` there."""
        return (isinstance(peer, dict) and peer.get("backend") == self.name
                and isinstance(peer.get("session"), str) and isinstance(peer.get("addr"), int)
                and isinstance(peer.get("bytes"), int) and 0 < nbytes <= peer["bytes"]
                and nbytes <= self.staging.slot_bytes)

    def write(self, peer: dict, rows: np.ndarray, slot: int) -> int:
        """Blocking: copy `rows` into our `slot`, write them to the peer's slot. Returns bytes."""
        data = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint8).reshape(-1)
        self.staging.view(slot, data.nbytes)[:] = data
        self.backend.write_bytes(peer["session"], self.staging.address(slot), peer["addr"], data.nbytes)
        return data.nbytes

    def read(self, slot: int, shape: tuple[int, int]) -> np.ndarray:
        """A copy of the float32 rows in `slot` (the slot may be handed out right after)."""
        nbytes = shape[0] * shape[1] * 4
        return self.staging.view(slot, nbytes).view(np.float32).reshape(shape).copy()

    def stats(self, now: float) -> dict:
        return {"backend": self.name, **self.staging.stats(now), "fallbacks": dict(self.fallbacks)}
