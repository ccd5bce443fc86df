"""EPD embeddings over Mooncake TE without worker processes: the staging area's bookkeeping on a
given clock, then the embedding exchange on loopback between an `EmbedSource` and
`embed_receive`, each with a real Mooncake Transfer Engine of its own in this process (skipped
where `mooncake` is not installed): rows written into the prefill's slot, every pairing with a
side on TCP, a failed write, no free slot, a stray write caught by the digest, and every slot
back after each of them."""

from __future__ import annotations

import asyncio
import importlib.util
import time

import numpy as np
import pytest

from pdgate.engine.kv import KVPool
from pdgate.engine.sequence import EngineError
from pdgate.engine.transfer.context import Timeouts, TransferContext
from pdgate.engine.transfer.embed import EmbedSource, embed_receive
from pdgate.engine.transfer.embed_plane import StagingArea
from pdgate.engine.transfer.server import TransferServer

SHAPE = (16, 64)
SLOT = SHAPE[0] * SHAPE[1] * 4
mooncake = pytest.mark.skipif(importlib.util.find_spec("mooncake") is None,
                              reason="mooncake-transfer-engine is not installed")


# ---- the staging area: pure bookkeeping, time as an argument ------------------------------

def test_slots_are_handed_out_lowest_first_until_none_is_free():
    s = StagingArea(3, 8, grace=5.0)
    assert [s.acquire(0.0) for _ in range(4)] == [0, 1, 2, None]
    assert s.stats(0.0) == {"slots": 3, "slot_bytes": 8, "in_use": 3, "quarantined": 0}
    assert s.address(2) - s.address(0) == 16 and s.view(1, 8).nbytes == 8


def test_a_settled_slot_is_free_at_once_an_unsettled_one_after_the_grace():
    s = StagingArea(2, 8, grace=5.0)
    a, b = s.acquire(0.0), s.acquire(0.0)
    s.release(a, True, 1.0)
    s.release(b, False, 1.0)
    s.release(b, True, 1.0)  # twice: nothing more happens
    assert s.stats(1.0)["in_use"] == 0 and s.stats(1.0)["quarantined"] == 1
    assert s.acquire(1.0) == a and s.acquire(5.9) is None  # b rests until 6.0
    assert s.acquire(6.0) == b
    assert s.stats(6.0) == {"slots": 2, "slot_bytes": 8, "in_use": 2, "quarantined": 0}


def test_a_staging_area_needs_a_slot():
    with pytest.raises(ValueError):
        StagingArea(0, 8, 1.0)


# ---- the exchange on loopback with real Mooncake engines --------------------------------------

def _ctx() -> TransferContext:
    return TransferContext(KVPool(2, 16, 1, 1, 4), {}, "e", "127.0.0.1", Timeouts(bootstrap=5, transfer=5),
                           None, None, None)


@pytest.fixture(scope="module")
def engines():
    """Two Mooncake engines (an encode worker's, a prefill's) for the whole module, as a worker
    keeps its one for its life: an engine torn down mid-test blocks the event loop for seconds.
    The staging areas registered with them are kept alive with them."""
    from pdgate.engine.transfer.mooncake_te import MooncakeBackend

    keep: list = []
    yield [MooncakeBackend(KVPool(2, 16, 1, 1, 4), "127.0.0.1") for _ in range(2)], keep
    keep.clear()


def _planes(engines, enc_slots: int = 2, rx_slots: int = 2, grace: float = 30.0):
    """(encode worker's plane, prefill's plane), each on an engine of its own."""
    from pdgate.engine.transfer.embed_plane import MooncakeEmbedPlane

    (a, b), keep = engines
    planes = MooncakeEmbedPlane(a, enc_slots, SLOT, grace), MooncakeEmbedPlane(b, rx_slots, SLOT, grace)
    keep.extend(planes)
    return planes


def _exchange(src_plane, rx_plane, body, bootstrap: float = 5):
    """Run `body(src, addr)` against an EmbedSource (with `src_plane`) on a loopback side channel."""
    nbytes = {"tcp": {"sent": 0}, "mooncake": {"sent": 0}}

    async def run():
        ctx = _ctx()
        ctx.timeouts.bootstrap = bootstrap
        src = EmbedSource(ctx, {"sent": 0}, nbytes, src_plane)
        server = TransferServer({"embed_register": src.on_register})
        port = await server.start("127.0.0.1", 0)
        try:
            return await body(src, ("127.0.0.1", port))
        finally:
            await server.stop()
    return asyncio.run(run()), nbytes


async def _settle(pred, what: str):
    for _ in range(300):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def _free(plane, now: float = 0.0) -> bool:
    st = plane.staging.stats(now)
    return st["in_use"] == 0 and st["quarantined"] == 0


def _rows(k: float = 1.0) -> np.ndarray:
    return (np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32).reshape(SHAPE) * k)


@mooncake
def test_rows_are_written_into_the_prefills_slot(engines):
    enc, rx = _planes(engines)

    async def body(src, addr):
        src.offer(1, "h1", _rows())  # encode first
        got1 = await embed_receive(_ctx(), addr, 1, "h1", SHAPE, rx)
        waiter = asyncio.create_task(embed_receive(_ctx(), addr, 2, "h2", SHAPE, rx))  # prefill first
        await _settle(lambda: 2 in src.claimed, "the registration")
        assert rx.staging.stats(0)["in_use"] == 1  # a waiting registration holds its slot
        src.offer(2, "h2", _rows(2))
        got2 = await asyncio.wait_for(waiter, 10)
        await _settle(lambda: src.counts["sent"] == 2, "the acks")
        return got1, got2

    ((a, via_a), (b, via_b)), nbytes = _exchange(enc, rx, body)
    assert (via_a, via_b) == ("mooncake", "mooncake")
    assert np.array_equal(a, _rows()) and np.array_equal(b, _rows(2))
    assert nbytes == {"tcp": {"sent": 0}, "mooncake": {"sent": 2 * SLOT}}
    assert _free(rx) and _free(enc)
    assert rx.fallbacks == enc.fallbacks == {"no_slot": 0, "write_failed": 0}


@mooncake
@pytest.mark.parametrize("side", ["encoder", "prefill"])
def test_a_side_without_the_plane_gets_tcp_frames(engines, side):
    """Encoder on TCP, prefill on Mooncake (its announced slot is freed at once on the TCP
    answer), and the reverse (no slot announced: the encoder sends frames)."""
    enc, rx = _planes(engines)
    enc, rx = (None, rx) if side == "encoder" else (enc, None)

    async def body(src, addr):
        src.offer(1, "h1", _rows())
        got = await embed_receive(_ctx(), addr, 1, "h1", SHAPE, rx)
        await _settle(lambda: src.counts["sent"] == 1, "the ack")
        return got

    (emb, via), nbytes = _exchange(enc, rx, body)
    assert via == "tcp" and np.array_equal(emb, _rows())
    assert nbytes == {"tcp": {"sent": SLOT}, "mooncake": {"sent": 0}}
    for plane in (enc, rx):
        if plane is not None:
            assert _free(plane) and plane.fallbacks == {"no_slot": 0, "write_failed": 0}


@mooncake
def test_a_failed_write_falls_back_to_tcp_frames_counted(engines):
    """The prefill names an address its engine never registered: the peer's engine refuses the
    write, the encoder counts it, logs it and sends the rows as a TCP frame."""
    enc, rx = _planes(engines)
    real = rx.describe
    rx.describe = lambda slot: dict(real(slot), addr=real(slot)["addr"] + (1 << 40))

    async def body(src, addr):
        src.offer(1, "h1", _rows(3))
        got = await embed_receive(_ctx(), addr, 1, "h1", SHAPE, rx)
        await _settle(lambda: src.counts["sent"] == 1, "the ack")
        return got

    (emb, via), nbytes = _exchange(enc, rx, body)
    assert via == "tcp" and np.array_equal(emb, _rows(3))
    assert enc.fallbacks == {"no_slot": 0, "write_failed": 1}
    assert nbytes == {"tcp": {"sent": SLOT}, "mooncake": {"sent": 0}}
    assert _free(enc) and _free(rx)


@mooncake
@pytest.mark.parametrize("side", ["encoder", "prefill"])
def test_no_free_slot_falls_back_to_tcp_frames_counted(engines, side):
    enc, rx = _planes(engines, 1, 1)
    full = enc if side == "encoder" else rx
    held = full.take(0.0)

    async def body(src, addr):
        src.offer(1, "h1", _rows())
        got = await embed_receive(_ctx(), addr, 1, "h1", SHAPE, rx)
        await _settle(lambda: src.counts["sent"] == 1, "the ack")
        return got

    (emb, via), nbytes = _exchange(enc, rx, body)
    assert via == "tcp" and np.array_equal(emb, _rows())
    assert full.fallbacks == {"no_slot": 1, "write_failed": 0}
    assert nbytes == {"tcp": {"sent": SLOT}, "mooncake": {"sent": 0}}
    full.give_back(held, True, 0.0)
    assert _free(enc) and _free(rx)


@mooncake
def test_a_stray_write_is_caught_by_the_digest_and_the_slot_quarantined(engines):
    """Rows other than the ones the digest names land in the slot (as a late write from an
    abandoned transfer would): the prefill refuses them and rests the slot."""
    enc, rx = _planes(engines)
    write = enc.write
    enc.write = lambda peer, rows, slot: write(peer, rows * 2, slot)

    async def body(src, addr):
        src.offer(1, "h1", _rows())
        with pytest.raises(EngineError) as e:
            await embed_receive(_ctx(), addr, 1, "h1", SHAPE, rx)
        return e.value

    err, _ = _exchange(enc, rx, body)
    assert err.code == "embedding_transfer_failed" and "digest" in str(err)
    now = time.monotonic()
    assert rx.staging.stats(now)["in_use"] == 0 and rx.staging.stats(now)["quarantined"] == 1
    assert _free(rx, now + 31)


@mooncake
def test_every_fault_gives_the_slot_back(engines):
    """A wrong image and a missing encode are answered (the slot is free at once); a prefill that
    gives up before any answer (cancelled) quarantines it for the grace period only."""
    enc, rx = _planes(engines)

    async def body(src, addr):
        src.offer(1, "other", _rows())
        with pytest.raises(EngineError, match="holds image other"):
            await embed_receive(_ctx(), addr, 1, "mine", SHAPE, rx)
        answered = _free(rx)
        waiter = asyncio.create_task(embed_receive(_ctx(), addr, 2, "h2", SHAPE, rx))
        await _settle(lambda: 2 in src.claimed, "the registration")
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await _settle(lambda: src.pending == 0, "the encoder to drop the registration")
        with pytest.raises(EngineError, match="no embedding for room 3"):  # the encoder's deadline
            await embed_receive(_ctx(), addr, 3, "h3", SHAPE, rx)
        return answered

    answered, nbytes = _exchange(enc, rx, body, bootstrap=0.5)
    now = time.monotonic()
    assert answered
    assert rx.staging.stats(now) == {"slots": 2, "slot_bytes": SLOT, "in_use": 0, "quarantined": 1}
    assert _free(rx, now + 31) and _free(enc)
    assert nbytes == {"tcp": {"sent": 0}, "mooncake": {"sent": 0}}
