"""`SubscribeKvEvents` (smg.grpc.common, served by both gRPC services): the engine's KV events
as a gRPC stream, from the batches its ZMQ publisher sends, under the same sequence numbers.

Served when the engine publishes KV events (`--kv-events-config` with events enabled);
otherwise the call ends UNIMPLEMENTED, as before, so a subscriber can tell "not offered".

- `start_sequence_number` N > 0: every batch from N on that the history (the last
  `buffer_steps` batches, as the ZMQ replay socket keeps) still holds, then live batches. When
  the history no longer reaches back to N the stream starts where it does: the subscriber sees
  the gap in the numbers and resynchronises (it resets its view of the worker).
- 0: from the start of the history, which is the engine's whole state while the history still
  holds batch 0. Past that, the blocks stored before the history begins are not sent (no state
  snapshot, `KvSnapshotChunk`, is built): children stored later whose parent is older are
  orphans to the subscriber until the prefix is stored again.
- `load_records_before_first_batch` is accepted and ignored: no load records (`EngineLoad`)
  ride on the stream; load comes from `GetLoads` as before.

A subscriber that cannot keep up (its queue of `QUEUE_BATCHES` is full) has its stream ended
with RESOURCE_EXHAUSTED; it resubscribes from its next sequence number and is served from the
history. Block hashes go out as the signed 64-bit integers the proto carries (the same bits as
the unsigned hashes of the ZMQ payload).
"""

from __future__ import annotations

import asyncio
from collections import deque

import grpc
from smg_grpc_proto.generated import common_pb2

QUEUE_BATCHES = 4096


def signed64(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def event_pb(ev: dict) -> common_pb2.KvCacheEvent:
    kind = ev.get("type")
    if kind == "BlockStored":
        bs, toks = ev["block_size"], ev["token_ids"]
        blocks = [common_pb2.KvBlock(block_hash=signed64(h), token_ids=toks[i * bs:(i + 1) * bs], block_size=bs)
                  for i, h in enumerate(ev["block_hashes"])]
        stored = common_pb2.KvBlocksStored(blocks=blocks, medium=ev.get("medium") or "GPU")
        if ev.get("parent_block_hash") is not None:
            stored.parent_block_hash = signed64(ev["parent_block_hash"])
        return common_pb2.KvCacheEvent(stored=stored)
    if kind == "BlockRemoved":
        return common_pb2.KvCacheEvent(removed=common_pb2.KvBlocksRemoved(
            block_hashes=[signed64(h) for h in ev["block_hashes"]], medium=ev.get("medium") or "GPU"))
    if kind == "AllBlocksCleared":
        return common_pb2.KvCacheEvent(cleared=common_pb2.KvCacheCleared())
    raise ValueError(f"unknown KV event type {kind!r}")


def batch_pb(seq: int, batch: list) -> common_pb2.KvEventBatch:
    ts, events, rank = batch
    return common_pb2.KvEventBatch(sequence_number=seq, timestamp=ts, events=[event_pb(e) for e in events],
                                   dp_rank=rank)


class KvEventFeed:
    """The publisher's batches kept for gRPC subscribers: a bounded history and one queue per
    open stream. Lives on the engine's event loop (the publisher calls it there)."""

    def __init__(self, publisher):
        self.history: deque[tuple[int, list]] = deque(maxlen=publisher.cfg.buffer_steps)
        self.streams: set[asyncio.Queue] = set()
        self.publisher = publisher
        publisher.listeners.append(self._on_batch)

    def _on_batch(self, seq: int, batch: list) -> None:
        self.history.append((seq, batch))
        for q in list(self.streams):
            try:
                q.put_nowait((seq, batch))
            except asyncio.QueueFull:
                self.streams.discard(q)
                q.overflowed = True  # type: ignore[attr-defined]

    async def serve(self, request, context):
        """The stream for one subscriber (see the module doc)."""
        self.publisher.flush()  # events of this loop turn go out numbered before the backlog
        # the call is accepted now, not at the first batch (an idle engine sends none for long)
        await context.send_initial_metadata(())
        q: asyncio.Queue = asyncio.Queue(maxsize=QUEUE_BATCHES)
        q.overflowed = False  # type: ignore[attr-defined]
        self.streams.add(q)
        try:
            start = request.start_sequence_number
            backlog = [(s, b) for s, b in self.history if s >= start]
            last = backlog[-1][0] if backlog else start - 1
            for seq, batch in backlog:
                yield batch_pb(seq, batch)
            while True:
                if q.overflowed and q.empty():  # type: ignore[attr-defined]
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"KV event subscriber too slow ({QUEUE_BATCHES} batches queued)")
                seq, batch = await q.get()
                if seq > last:  # queued while the backlog was sent: already sent
                    last = seq
                    yield batch_pb(seq, batch)
        finally:
            self.streams.discard(q)


def feed_of(engine) -> KvEventFeed | None:
    """The engine's feed, made on first use; None when it publishes no KV events."""
    if engine.kv_events is None:
        return None
    feed = getattr(engine, "_grpc_kv_feed", None)
    if feed is None:
        feed = engine._grpc_kv_feed = KvEventFeed(engine.kv_events)
    return feed


async def subscribe(engine, request, context):
    feed = feed_of(engine)
    if feed is None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "this engine publishes no KV events (start it with --kv-events-config)")
    async for b in feed.serve(request, context):
        yield b
