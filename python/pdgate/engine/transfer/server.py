"""The TCP side channel every engine listens on; the first frame's `op` picks the handler."""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

from . import wire

log = logging.getLogger("pdgate.engine.transfer")
Handler = Callable[[dict, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class TransferServer:
    def __init__(self, handlers: dict[str, Handler]):
        self.handlers = handlers
        self.server: asyncio.AbstractServer | None = None
        self.tasks: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        self.server = await asyncio.start_server(self._handle, host, port)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.tasks.add(task)
        try:
            hdr, _ = await asyncio.wait_for(wire.recv(reader, 0), 30)
            handler = self.handlers.get(hdr["op"])
            if handler is None:
                await wire.send(writer, {"op": "error", "message": f"unknown op {hdr['op']!r}"})
            else:
                await handler(hdr, reader, writer)
        except (wire.WireError, asyncio.TimeoutError, ConnectionError, OSError) as e:
            log.info("side channel connection ended: %s", e)
        except Exception:
            log.exception("side channel handler failed")
        finally:
            self.tasks.discard(task)
            await wire.close(writer)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for t in list(self.tasks):
            t.cancel()
