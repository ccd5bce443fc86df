"""Framing of the built-in TCP transport.

A frame is `!IQ` (header length, payload length), a JSON header, then raw payload bytes.
KV payloads are a run of pages in the pool's own layout, float32,
[page, K|V, layer, slot, kv_head, dim] (`KVPool.read_pages`), so a run of consecutive pages is
sent straight from the pool without a copy.
The sink validates every frame against its own reservation, so a source can never write outside
the pages the sink reserved, and the final `done` frame carries the metadata row (first token,
its logprob, cached tokens, the room or transfer id, the attempt key) that the sink checks
before it exposes anything to decode.
"""

from __future__ import annotations

import asyncio
import json
import struct

_HDR = struct.Struct("!IQ")
MAX_HEADER = 1 << 20
FRAME_BYTES = 4 << 20  # payload bytes per KV frame: bounds memory and lets aborts cut in


class WireError(Exception):
    """The peer broke the framing or closed the connection."""


async def send(writer: asyncio.StreamWriter, header: dict, payload: bytes | memoryview = b"") -> None:
    h = json.dumps(header).encode()
    writer.write(_HDR.pack(len(h), len(payload)) + h)
    if payload:
        writer.write(payload)
    await writer.drain()


async def recv(reader: asyncio.StreamReader, max_payload: int) -> tuple[dict, bytes]:
    try:
        raw = await reader.readexactly(_HDR.size)
        hlen, plen = _HDR.unpack(raw)
        if hlen > MAX_HEADER or plen > max_payload:
            raise WireError(f"frame too large (header {hlen}, payload {plen})")
        header = json.loads(await reader.readexactly(hlen))
        payload = await reader.readexactly(plen) if plen else b""
    except asyncio.IncompleteReadError as e:
        raise WireError("peer closed the connection") from e
    except (ConnectionError, json.JSONDecodeError) as e:
        raise WireError(f"bad frame: {e}") from e
    if not isinstance(header, dict) or "op" not in header:
        raise WireError("frame without op")
    return header, payload


async def close(writer: asyncio.StreamWriter | None) -> None:
    """Close and wait until the transport is gone: after this no byte can land in a page."""
    if writer is None:
        return
    try:
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), 5)
    except (ConnectionError, asyncio.TimeoutError, OSError):
        pass


def pages_per_frame(page_bytes: int) -> int:
    return max(1, FRAME_BYTES // max(1, page_bytes))
