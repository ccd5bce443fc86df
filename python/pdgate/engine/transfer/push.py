"""Push transfers: the sink reserves and registers first, the source writes into it.

Used by SGLang bootstrap rooms (key = room; the source waits for the registration BEFORE it
computes, so a prefill never runs ahead of decode memory) and by vLLM Mooncake transfer ids
(key = transfer_id; the source computes first, then waits for the registration).

Each registration carries a fresh attempt id; every frame carries (protocol, key, attempt), so
a late or duplicate frame from another attempt of a reused room is rejected by the sink.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field

from ..sequence import EngineError, Seq
from . import wire
from .context import TransferContext, with_timeout
from .kvio import recv_kv, send_kv
from .states import KVPoll

log = logging.getLogger("pdgate.engine.transfer")


@dataclass
class Registration:
    hdr: dict
    writer: asyncio.StreamWriter
    claimed: asyncio.Event = field(default_factory=asyncio.Event)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    ack: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def tag(self) -> dict:
        return {"protocol": self.hdr["protocol"], "key": self.hdr["key"], "attempt": self.hdr["attempt"]}


class PushSource:
    """Prefill side: registrations and prefill requests meet by (protocol, key)."""

    def __init__(self, ctx: TransferContext):
        self.ctx = ctx
        self.pending: dict[tuple, asyncio.Future] = {}

    async def on_register(self, hdr: dict, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        """Handle a sink's connection: match it to a prefill request, watch it until the end."""
        key = (hdr.get("protocol"), hdr.get("key"))
        try:
            self.ctx.check_layout(hdr.get("layout"))
        except EngineError as e:
            await wire.send(writer, {"op": "error", "message": str(e)})
            return
        fut = self.pending.setdefault(key, asyncio.get_running_loop().create_future())
        if fut.done():
            await wire.send(writer, {"op": "error", "message": f"duplicate registration for {key}"})
            return
        reg = Registration(hdr, writer)
        fut.set_result(reg)
        watch = asyncio.create_task(self._watch(reg, reader))
        claimed = asyncio.ensure_future(reg.claimed.wait())
        try:
            # until a prefill request claims it, the sink leaves, or the bootstrap deadline
            await asyncio.wait({claimed, reg.ack}, timeout=self.ctx.timeouts.bootstrap,
                               return_when=asyncio.FIRST_COMPLETED)
            if reg.claimed.is_set():
                await reg.ended.wait()
            elif not reg.ack.done():
                msg = f"no prefill request for {key} within {self.ctx.timeouts.bootstrap:g}s"
                await _send_error(writer, msg)
        finally:
            claimed.cancel()
            if reg.ack.done() and not reg.ack.cancelled():
                reg.ack.exception()  # retrieved: the sink's end is handled above
            watch.cancel()
            if self.pending.get(key) is fut:
                del self.pending[key]

    async def _watch(self, reg: Registration, reader: asyncio.StreamReader) -> None:
        """Read the sink's frames: its ack, or the end of the connection (the sink is gone)."""
        try:
            hdr, _ = await wire.recv(reader, 0)
            if hdr["op"] == "ack" and not reg.ack.done():
                reg.ack.set_result(hdr)
                return
            err = EngineError(f"sink sent {hdr.get('op')}: {hdr.get('message')}", 500, "kv_transfer_failed")
        except wire.WireError as e:
            err = EngineError(f"decode side disconnected: {e}", 500, "kv_transfer_failed")
        if not reg.ack.done():
            reg.ack.set_exception(err)

    async def run(self, protocol: str, key, seq: Seq, wait_first: bool) -> None:
        """Serve one prefill request: rendezvous, compute, push, wait for the sink's ack."""
        ctx, pkey = self.ctx, (protocol, key)
        fut = self.pending.setdefault(pkey, asyncio.get_running_loop().create_future())
        # One row per request, keyed once: the sink's attempt id is recorded in it, not made a
        # second key (a re-keyed row was left behind as Bootstrapping forever).
        tkey, reg = (protocol, key, seq.rid), None
        ctx.table.set(tkey, KVPoll.Bootstrapping, role="source")
        try:
            if not wait_first:
                await ctx.run_prefill(seq)
            reg = await with_timeout(asyncio.shield(fut), ctx.timeouts.bootstrap,
                                     f"waiting for the decode to register {protocol} {key}")
            reg.claimed.set()
            ctx.table.set(tkey, KVPoll.WaitingForInput, attempt_id=reg.hdr["attempt"], rid=seq.rid)
            if reg.hdr.get("num_tokens") != seq.prompt_len:
                raise EngineError(f"decode expects {reg.hdr.get('num_tokens')} tokens, prompt has "
                                  f"{seq.prompt_len}", 500, "kv_transfer_failed")
            if wait_first:
                await _race(ctx.run_prefill(seq), reg.ack)
            ctx.table.set(tkey, KVPoll.Transferring)
            ctx.pool.pin(seq.pages, seq)
            src = seq.pages[:ctx.pool.pages_for(seq.prompt_len)]
            nbytes = await send_kv(ctx, reg.writer, src, reg.hdr["dst_pages"], reg.tag,
                                   reg.hdr.get("data_plane"))
            await wire.send(reg.writer, {"op": "done", **reg.tag, "meta": _meta(seq, reg, nbytes)})
            await with_timeout(asyncio.shield(reg.ack), ctx.timeouts.transfer, "waiting for the decode's ack")
            ctx.table.set(tkey, KVPoll.Success)
            ctx.stats.count(protocol, "source", True)
            seq.meta_extra["kv_bytes_sent"] = nbytes
        except BaseException as e:
            msg = str(e) or type(e).__name__
            ctx.table.set(tkey, KVPoll.Failed, error=msg)
            ctx.stats.count(protocol, "source", False)
            if reg is not None:
                await _send_error(reg.writer, msg)
            raise
        finally:
            if reg is not None:
                await wire.close(reg.writer)  # drained: now the pages may go
                reg.ended.set()
            elif self.pending.get(pkey) is fut and not fut.done():
                del self.pending[pkey]
            ctx.release(seq)


async def _race(work, ack: asyncio.Future) -> None:
    """Run `work` unless the sink disappears first (then cancel it and raise)."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, ack}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            ack.result()  # raises the sink's failure
        task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def _meta(seq: Seq, reg: Registration, nbytes: int) -> dict:
    return {"first_token": seq.output_ids[0], "first_logprob": seq.output_logprobs[0],
            "first_top": seq.output_top[0], "cached_tokens": seq.cached_tokens,
            "input_len": seq.prompt_len, "bytes": nbytes, **reg.tag}


async def _send_error(writer: asyncio.StreamWriter, msg: str) -> None:
    try:
        await asyncio.wait_for(wire.send(writer, {"op": "error", "message": msg}), 2)
    except (ConnectionError, OSError, asyncio.TimeoutError, RuntimeError):
        pass


async def push_receive(ctx: TransferContext, protocol: str, key, seq: Seq,
                       addr: tuple[str, int]) -> dict:
    """Sink side: register `seq`'s reserved pages with the source at `addr`, receive the KV.

    `seq.pages` must already be reserved. Returns the metadata row. On failure the connection
    is closed (drained) before the caller frees the pages.
    """
    attempt = uuid.uuid4().hex
    tag = {"protocol": protocol, "key": key, "attempt": attempt}
    tkey = (protocol, key, attempt)
    dst = seq.pages[:ctx.pool.pages_for(seq.prompt_len)]
    writer = None
    try:
        reader, writer = await with_timeout(asyncio.open_connection(*addr), ctx.timeouts.bootstrap,
                                            f"connecting to the prefill at {addr}")
        await wire.send(writer, {"op": "register", **tag, "num_tokens": seq.prompt_len,
                                 "dst_pages": dst, "layout": ctx.layout, "data_plane": ctx.data_plane()})
        ctx.table.set(tkey, KVPoll.WaitingForInput, role="sink", rid=seq.rid)

        def first() -> None:
            ctx.table.set(tkey, KVPoll.Transferring)
            ctx.pool.pin(dst, seq)

        meta, nbytes = await recv_kv(ctx, reader, dst, tag, first)
        if meta.get("attempt") != attempt or meta.get("key") != key or meta.get("input_len") != seq.prompt_len:
            raise EngineError(f"metadata row does not match this transfer: {meta}", 500, "kv_transfer_failed")
        await wire.send(writer, {"op": "ack", **tag})
        ctx.pool.unpin(dst, seq)
        ctx.table.set(tkey, KVPoll.Success)
        ctx.stats.count(protocol, "sink", True)
        seq.meta_extra["kv_bytes_received"] = nbytes
        seq.meta_extra["kv_transfer_seconds"] = round(meta.pop("_seconds", 0.0), 6)
        return meta
    except BaseException as e:
        ctx.table.set(tkey, KVPoll.Failed, error=str(e) or type(e).__name__)
        ctx.stats.count(protocol, "sink", False)
        if isinstance(e, OSError):
            raise EngineError(f"cannot reach the prefill at {addr}: {e}", 500, "kv_transfer_failed") from e
        raise
    finally:
        await wire.close(writer)
