"""Pull transfers (vLLM NIXL style): the source holds computed pages under a lease; the sink
reads them by (engine id, request id, block ids); the source frees them once read and acked, or
when the lease expires.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass

from ..sequence import EngineError, Seq
from . import wire
from .context import TransferContext, with_timeout
from .kvio import recv_kv, send_kv
from .states import KVPoll

log = logging.getLogger("pdgate.engine.transfer")
PROTOCOL = "nixl"


@dataclass
class Hold:
    seq: Seq
    pages: list[int]
    expiry: asyncio.TimerHandle | None = None


def duplicate_request_id(rid: str) -> EngineError:
    return EngineError(f"request id {rid!r} already holds KV blocks waiting for a pull: request ids "
                       "must be unique per request", 409, "duplicate_request_id")


class PullSource:
    def __init__(self, ctx: TransferContext):
        self.ctx = ctx
        self.holds: dict[str, Hold] = {}

    def hold(self, seq: Seq) -> dict:
        """Pin a finished prefill's pages and publish them; returns `kv_transfer_params`."""
        ctx = self.ctx
        if seq.rid in self.holds:
            # A second hold under one request id would orphan the first one's pages (its lease
            # timer would free the newer hold, and nothing the older): refuse the newcomer.
            ctx.release(seq)
            raise duplicate_request_id(seq.rid)
        pages = seq.pages[:ctx.pool.pages_for(seq.prompt_len)]
        ctx.pool.pin(seq.pages, seq)
        h = Hold(seq, pages)
        h.expiry = asyncio.get_running_loop().call_later(ctx.timeouts.lease, self._expire, seq.rid)
        self.holds[seq.rid] = h
        ctx.table.set((PROTOCOL, seq.rid, "hold"), KVPoll.WaitingForInput, role="source")
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": pages,
                "remote_engine_id": ctx.engine_id, "remote_request_id": seq.rid,
                "remote_host": ctx.host, "remote_port": ctx.port, "tp_size": 1}

    def _expire(self, rid: str) -> None:
        if self._drop(rid, "lease expired"):
            log.warning("lease expired for %s: freed the pages nobody pulled", rid)

    def _drop(self, rid: str, why: str) -> bool:
        """Free a hold that will not be pulled. A pull already under way has taken the hold
        out of `holds` and frees the pages itself once its connection has drained."""
        h = self.holds.pop(rid, None)
        if h is None:
            return False
        if h.expiry is not None:
            h.expiry.cancel()
        self.ctx.table.set((PROTOCOL, rid, "hold"), KVPoll.Failed, error=why)
        self.ctx.stats.count(PROTOCOL, "source", False)
        self.ctx.release(h.seq)
        return True

    def release(self, match, why: str) -> int:
        """Free every hold whose request id satisfies `match` (the engine's abort)."""
        return sum(self._drop(rid, why) for rid in [r for r in self.holds if match(r)])

    async def on_release(self, hdr: dict, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        """A decode that will not pull after all (aborted or rejected before its pull) says so,
        as vLLM's NIXL decode notifies its prefill, so the pages go now and not at lease end.
        The hold must match exactly (engine id and block ids): a stale or forged notice can
        never free another request's pages."""
        rid, h = hdr.get("request_id"), self.holds.get(hdr.get("request_id"))
        ok = (h is not None and hdr.get("engine_id") == self.ctx.engine_id
              and hdr.get("block_ids") == h.pages)
        if ok:
            self._drop(rid, "released by the decode")
        await wire.send(writer, {"op": "released" if ok else "error",
                                 "message": "" if ok else f"no matching hold for {rid!r}"})

    async def on_pull(self, hdr: dict, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> None:
        ctx, rid = self.ctx, hdr.get("request_id")
        h = self.holds.get(rid)
        problem = None
        if h is None:
            problem = f"request {rid!r} is not held here (never prefilled, already pulled, or lease expired)"
        elif hdr.get("engine_id") != ctx.engine_id:
            problem = f"engine id {hdr.get('engine_id')!r} is not {ctx.engine_id!r}"
        elif hdr.get("block_ids") != h.pages:
            problem = "block ids do not match the held request"
        elif hdr.get("layout") != ctx.layout:
            problem = f"KV layout mismatch: ours {ctx.layout}, theirs {hdr.get('layout')}"
        if problem:
            await wire.send(writer, {"op": "error", "message": problem})
            return
        del self.holds[rid]
        h.expiry.cancel()
        tkey, tag = (PROTOCOL, rid, "hold"), {"protocol": PROTOCOL, "key": rid, "attempt": hdr.get("attempt")}
        ok = False
        try:
            ctx.table.set(tkey, KVPoll.Transferring)
            await send_kv(ctx, writer, h.pages, hdr.get("dst_pages") or [], tag, hdr.get("data_plane"))
            meta = {"input_len": h.seq.prompt_len, **tag}
            await wire.send(writer, {"op": "done", **tag, "meta": meta})
            ack, _ = await with_timeout(wire.recv(reader, 0), ctx.timeouts.transfer, "waiting for the ack")
            ok = ack["op"] == "ack"
        except (EngineError, wire.WireError, ConnectionError, OSError) as e:
            log.warning("pull of %s failed: %s", rid, e)
        finally:
            ctx.table.set(tkey, KVPoll.Success if ok else KVPoll.Failed)
            ctx.stats.count(PROTOCOL, "source", ok)
            await wire.close(writer)
            ctx.release(h.seq)


REQUIRED = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")


async def pull_receive(ctx: TransferContext, params: dict, seq: Seq) -> int:
    """Sink side: read the held pages into `seq`'s reservation. Returns bytes received."""
    attempt = uuid.uuid4().hex
    rid = params["remote_request_id"]
    tag = {"protocol": PROTOCOL, "key": rid, "attempt": attempt}
    tkey = (PROTOCOL, rid, attempt)
    blocks = list(params["remote_block_ids"])
    if len(blocks) != ctx.pool.pages_for(seq.prompt_len):
        raise EngineError(f"{len(blocks)} remote blocks for a {seq.prompt_len}-token prompt "
                          f"(page size {ctx.pool.page_size})", 500, "kv_transfer_failed")
    dst = seq.pages[:len(blocks)]
    addr = (params["remote_host"], int(params["remote_port"]))
    writer = None
    ctx.table.set(tkey, KVPoll.Bootstrapping, role="sink", rid=seq.rid)
    try:
        reader, writer = await with_timeout(asyncio.open_connection(*addr), ctx.timeouts.bootstrap,
                                            f"connecting to the prefill at {addr}")
        await wire.send(writer, {"op": "pull", "request_id": rid, "attempt": attempt,
                                 "engine_id": params["remote_engine_id"], "block_ids": blocks,
                                 "dst_pages": dst, "layout": ctx.layout, "data_plane": ctx.data_plane()})
        ctx.table.set(tkey, KVPoll.WaitingForInput)

        def first() -> None:
            ctx.table.set(tkey, KVPoll.Transferring)
            ctx.pool.pin(dst, seq)

        meta, nbytes = await recv_kv(ctx, reader, dst, tag, first)
        seq.meta_extra["kv_transfer_seconds"] = round(meta.get("_seconds", 0.0), 6)
        await wire.send(writer, {"op": "ack", **tag})
        ctx.pool.unpin(dst, seq)
        ctx.table.set(tkey, KVPoll.Success)
        ctx.stats.count(PROTOCOL, "sink", True)
        return nbytes
    except BaseException as e:
        ctx.table.set(tkey, KVPoll.Failed, error=str(e) or type(e).__name__)
        ctx.stats.count(PROTOCOL, "sink", False)
        if isinstance(e, OSError):
            raise EngineError(f"cannot reach the prefill at {addr}: {e}", 500, "kv_transfer_failed") from e
        raise
    finally:
        await wire.close(writer)


async def release_remote(ctx: TransferContext, params: dict) -> bool:
    """Decode side: tell the prefill named in `params` to free the blocks it holds for us,
    because this decode will not pull them (it was aborted, rejected, or failed before its
    pull). Best effort within a short deadline: the prefill's lease is the backstop."""
    writer = None
    try:
        addr = (params["remote_host"], int(params["remote_port"]))
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*addr), RELEASE_TIMEOUT)
        await wire.send(writer, {"op": "release", "request_id": params["remote_request_id"],
                                 "engine_id": params["remote_engine_id"],
                                 "block_ids": list(params["remote_block_ids"])})
        reply, _ = await asyncio.wait_for(wire.recv(reader, 0), RELEASE_TIMEOUT)
        return reply.get("op") == "released"
    except (wire.WireError, OSError, asyncio.TimeoutError, KeyError, TypeError, ValueError) as e:
        log.info("could not release %s at the prefill: %s", params.get("remote_request_id"), e)
        return False
    finally:
        await wire.close(writer)


RELEASE_TIMEOUT = 5.0
