"""What the transfer code shares with the engine: the pool, timeouts, counters, identity."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from ..kv import KVPool
from ..sequence import EngineError, Seq  # noqa: F401
from .states import KVPoll, TransferTable


@dataclass
class Timeouts:
    bootstrap: float = 300.0  # a peer must register / the prefill must be found within this
    waiting: float = 300.0    # after registering, the first KV byte must arrive within this
    transfer: float = 60.0    # no progress for this long during a transfer fails it
    lease: float = 480.0      # a pull source holds pages this long at most


@dataclass
class TransferStats:
    bytes_sent: int = 0
    bytes_received: int = 0
    pages_sent: int = 0
    pages_received: int = 0
    backend_bytes: int = 0  # of the above, bytes moved by the optional backend (Mooncake TE)
    results: dict = field(default_factory=dict)  # (protocol, role, ok|failed) -> count
    # Whole transfers received (the sink's view, first KV frame to `done`): cumulative totals
    # the gateway's placement fits transfer = setup + bytes / bandwidth from.
    transfers_in: int = 0
    transfer_bytes_in: int = 0
    transfer_seconds_in: float = 0.0

    def transferred(self, nbytes: int, seconds: float) -> None:
        self.transfers_in += 1
        self.transfer_bytes_in += nbytes
        self.transfer_seconds_in += seconds

    def count(self, protocol: str, role: str, ok: bool) -> None:
        key = (protocol, role, "ok" if ok else "failed")
        self.results[key] = self.results.get(key, 0) + 1


@dataclass
class TransferContext:
    pool: KVPool
    layout: dict                        # must match between the two sides, byte for byte
    engine_id: str
    host: str
    timeouts: Timeouts
    reserve: Callable[[int, float], Awaitable[list[int]]]
    run_prefill: Callable[["Seq"], Awaitable[None]]  # reserve, compute, keep the pages
    release: Callable[["Seq"], None]                   # free a sequence's pages (idempotent)
    port: int = 0                       # the TCP side channel, known once it listens
    backend: object | None = None       # optional data plane (MooncakeBackend) or None
    # Test-only faults: a pause before each KV frame and pages per frame (0: by size), so a
    # source can be killed mid-transfer.
    fault_send_delay: float = 0.0
    fault_frame_pages: int = 0

    def data_plane(self) -> dict | None:
        return self.backend.describe() if self.backend is not None else None
    table: TransferTable = field(default_factory=TransferTable)
    stats: TransferStats = field(default_factory=TransferStats)

    def check_layout(self, theirs: dict | None) -> None:
        if theirs != self.layout:
            raise EngineError(
                f"KV layout mismatch: ours {self.layout}, theirs {theirs}", 500, "kv_layout_mismatch")


def fail(ctx: TransferContext, key: tuple, msg: str) -> EngineError:
    ctx.table.set(key, KVPoll.Failed, error=msg)
    return EngineError(msg, 500, "kv_transfer_failed")


async def with_timeout(aw, seconds: float, what: str):
    """`aw` within `seconds`, else `kv_transfer_timeout`; a cancellation always propagates.

    Not `asyncio.wait_for`: before Python 3.12 it returns the inner result, swallowing the
    cancellation, when the inner work ends in the same loop step as the cancel arrives (an
    aborted decode whose bootstrap lookup answered just then went on to register with the
    prefill and wait there for KV that never came, its request no longer live, so nothing
    could abort it again). Here the work is cancelled and awaited, and what it returned in
    that step is closed (a stream connection) and dropped."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        await _cancel_and_drop(task)
        raise
    if not done:
        await _cancel_and_drop(task)
        raise EngineError(f"timed out after {seconds:g}s {what}", 500, "kv_transfer_timeout")
    return task.result()


async def _cancel_and_drop(task: asyncio.Future) -> None:
    """Cancel `task` and wait until it has ended (shielded: a second cancel of the caller
    propagates, and the task still ends on its own); a stream connection it opened in its last
    step is closed, whenever that step was."""
    task.add_done_callback(_close_opened)
    task.cancel()
    await asyncio.shield(asyncio.gather(task, return_exceptions=True))


def _close_opened(task: asyncio.Future) -> None:
    if not task.cancelled() and task.exception() is None:
        result = task.result()
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], asyncio.StreamWriter):
            result[1].close()
