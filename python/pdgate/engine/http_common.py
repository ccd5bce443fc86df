"""HTTP helpers shared by the API modules: error bodies, SSE, watching sequences."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from typing import AsyncIterator

from aiohttp import web

from .sampling import BadRequest
from .sequence import EngineError, Seq


def error_body(message: str, type_: str, code, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


def error_response(err: Exception) -> web.Response:
    """The one place an exception becomes an HTTP error (OpenAI shape)."""
    if isinstance(err, BadRequest):
        return web.json_response(error_body(str(err), "invalid_request_error", err.code, err.param),
                                 status=400)
    if isinstance(err, EngineError):
        type_ = "invalid_request_error" if err.status == 400 else "server_error"
        return web.json_response(error_body(str(err), type_, err.code, err.param), status=err.status)
    return web.json_response(error_body(f"internal error: {err}", "server_error", "internal"), status=500)


async def read_json(request: web.Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise BadRequest("the body is not valid JSON", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object", None, "invalid_json")
    return body


class SSE:
    """An SSE response opened lazily, so a failure before the first event is a plain error."""

    def __init__(self, request: web.Request):
        self.request = request
        self.resp: web.StreamResponse | None = None

    async def send(self, data) -> None:
        if self.resp is None:
            self.resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                    "Cache-Control": "no-cache"})
            await self.resp.prepare(self.request)
        payload = data if isinstance(data, str) else json.dumps(data)
        await self.resp.write(f"data: {payload}\n\n".encode())

    async def finish(self) -> web.StreamResponse:
        await self.send("[DONE]")
        await self.resp.write_eof()
        return self.resp


async def watch(seqs: list[Seq]) -> AsyncIterator[int]:
    """Yield the index of a sequence each time it changed, until each was yielded finished.

    A sequence is dropped only if it had finished before it was yielded: one that finishes
    while the consumer still awaits its previous update (a slow client's write) is yielded
    once more, so its last tokens and its finish are sent."""
    pending = set(range(len(seqs)))
    while pending:
        waiters = {asyncio.ensure_future(seqs[i].changed.wait()): i for i in pending}
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in waiters:
                t.cancel()
        for i in sorted(pending):
            s = seqs[i]
            if s.changed.is_set():
                s.changed.clear()
                seen_finished = s.finished
                yield i
                if seen_finished:
                    pending.discard(i)


async def wait_all(seqs: list[Seq]) -> None:
    await asyncio.gather(*(asyncio.shield(s.done) for s in seqs))


def first_error(seqs: list[Seq]) -> EngineError | None:
    return next((s.error for s in seqs if s.error is not None), None)


def fault_kill_point(engine, seqs: list[Seq], request: web.Request | None = None) -> None:
    """`--fault-kill-after-tokens N`: dies like a SIGKILLed engine (no cleanup, no last bytes)
    once a sequence has N output tokens out. A deterministic mid-answer death for tests.
    `--fault-drop-after-tokens N`: the same moment, on every request, the connection is closed
    instead (the engine lives on and aborts the request): a decode that dies mid-answer on
    every request, for breaker tests."""
    n = engine.config.fault_kill_after_tokens
    if n and any(len(s.output_ids) >= n for s in seqs):
        os.kill(os.getpid(), signal.SIGKILL)
    d = engine.config.fault_drop_after_tokens
    if d and request is not None and any(len(s.output_ids) >= d for s in seqs):
        if request.transport is not None:
            request.transport.close()
        raise ConnectionResetError("--fault-drop-after-tokens: the connection was dropped mid-answer")
