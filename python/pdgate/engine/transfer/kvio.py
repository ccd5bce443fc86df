"""Sending pages and receiving them into a reservation, with every frame checked."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

from ..sequence import EngineError
from . import wire
from .context import TransferContext, with_timeout


async def send_kv(ctx: TransferContext, writer: asyncio.StreamWriter, src: list[int],
                  dst: list[int], tag: dict, peer: dict | None = None) -> int:
    """Write `src` pages into the sink's `dst` pages; returns payload bytes sent.

    `peer` is the sink's data-plane description; when both sides run the same optional
    backend (Mooncake TE, NIXL) over the same pool layout the pages go through it, otherwise
    as TCP frames."""
    if len(src) != len(dst):
        raise EngineError(f"sink reserved {len(dst)} pages, source has {len(src)}", 500,
                          "kv_transfer_failed")
    if ctx.backend is not None and ctx.backend.compatible(peer) and src:
        return await _send_via_backend(ctx, writer, src, dst, tag, peer)
    per, sent = ctx.fault_frame_pages or wire.pages_per_frame(ctx.pool.page_bytes), 0
    for i in range(0, len(src), per):
        if ctx.fault_send_delay:
            await asyncio.sleep(ctx.fault_send_delay)
        hdr = {"op": "kv", "dst": dst[i:i + per], **tag}
        if i == 0:
            hdr["t0"] = time.time()  # lets the sink time the whole transfer (same-host clocks)
        payload = ctx.pool.read_pages(src[i:i + per])
        await with_timeout(wire.send(writer, hdr, payload),
                           ctx.timeouts.transfer, "sending KV")
        sent += len(payload)
    ctx.stats.bytes_sent += sent
    ctx.stats.pages_sent += len(src)
    return sent


async def _send_via_backend(ctx, writer, src, dst, tag, peer) -> int:
    t0 = time.time()
    fut = asyncio.get_running_loop().run_in_executor(None, ctx.backend.write, peer, src, dst)
    try:
        nbytes = await with_timeout(asyncio.shield(fut), ctx.timeouts.transfer,
                                    f"writing KV through {ctx.backend.name}")
    except RuntimeError as e:
        raise EngineError(str(e), 500, "kv_transfer_failed") from e
    finally:
        if not fut.done():  # drain: the sink's pages are not released while a write may land
            await asyncio.gather(fut, return_exceptions=True)
    await with_timeout(wire.send(writer, {"op": "kv_written", "dst": dst, "bytes": nbytes,
                                          "backend": ctx.backend.name, "t0": t0, **tag}),
                       ctx.timeouts.transfer, "sending KV")
    ctx.stats.bytes_sent += nbytes
    ctx.stats.pages_sent += len(src)
    ctx.stats.backend_bytes += nbytes
    return nbytes


async def recv_kv(ctx: TransferContext, reader: asyncio.StreamReader, dst: list[int], tag: dict,
                  on_first: Callable[[], None]) -> tuple[dict, int]:
    """Receive frames into `dst` until `done`; returns (metadata row, bytes received).

    Nothing is exposed before `done` has arrived and every destination page was written exactly
    once; a frame for another key or attempt, or for a page outside the reservation, fails it.
    """
    allowed, got, nbytes = set(dst), set(), 0
    timeout, what, started = ctx.timeouts.waiting, "waiting for the source's KV", False
    max_payload = wire.pages_per_frame(ctx.pool.page_bytes) * ctx.pool.page_bytes
    while True:
        try:
            hdr, payload = await with_timeout(wire.recv(reader, max_payload), timeout, what)
        except wire.WireError as e:
            raise EngineError(f"KV source lost: {e}", 500, "kv_transfer_failed") from e
        if hdr["op"] == "error":
            raise EngineError(f"KV source failed: {hdr.get('message')}", 500, "kv_transfer_failed")
        if any(hdr.get(k) != v for k, v in tag.items()):
            raise EngineError(f"frame for another transfer {hdr}", 500, "kv_transfer_failed")
        if not started:
            t_first = float(hdr.get("t0") or time.time())
            on_first()
            started, timeout, what = True, ctx.timeouts.transfer, "during KV transfer"
        if hdr["op"] in ("kv", "kv_written"):
            pages = hdr.get("dst") or []
            if not set(pages) <= allowed or got & set(pages):
                raise EngineError("KV frame outside the reservation", 500, "kv_transfer_failed")
            if hdr["op"] == "kv":
                ctx.pool.write_pages(pages, payload)
                size = len(payload)
            else:  # the source already wrote them into our registered pool
                size = len(pages) * ctx.pool.page_bytes
                if ctx.backend is None or hdr.get("bytes") != size:
                    raise EngineError("backend write does not match the reservation", 500,
                                      "kv_transfer_failed")
                ctx.stats.backend_bytes += size
            got |= set(pages)
            nbytes += size
            ctx.stats.bytes_received += size
            ctx.stats.pages_received += len(pages)
        elif hdr["op"] == "done":
            if got != allowed:
                raise EngineError(f"transfer ended with {len(got)}/{len(allowed)} pages", 500,
                                  "kv_transfer_failed")
            meta = dict(hdr.get("meta") or {})
            meta["_seconds"] = max(0.0, time.time() - t_first)
            ctx.stats.transferred(nbytes, meta["_seconds"])
            return meta, nbytes
        else:
            raise EngineError(f"unexpected frame {hdr['op']!r}", 500, "kv_transfer_failed")
