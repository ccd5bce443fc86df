"""vLLM MooncakeConnector mocks (docs/protocols.md §3): a shared transfer_id, the prefill pushes.

The prefill's bootstrap server answers `GET /query` with its engine id; the decode checks that
the gateway relayed that id and the bootstrap address, then receives the KV the prefill pushed
for the `transfer_id` (waiting for it, so the legs may run in either order or concurrently).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import aiohttp
from aiohttp import web

from .core import LegFailure, MockWorker
from .model import Item
from .nixl import check_prefill_leg


class MooncakePrefill(MockWorker):
    role = "prefill"
    owned_by = "vllm"
    native_generate = False
    prefill_only = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.engine_id = f"mooncake-engine-{uuid.uuid4().hex[:8]}"
        self.bootstrap_port = 0
        self.queries = 0
        self.pushed: dict[str, asyncio.Future] = {}  # transfer_id -> KV, until received

    async def start(self) -> None:
        await super().start()
        app = web.Application()
        app.router.add_get("/query", self.query)
        app.router.add_post("/recv", self.recv)
        self.bootstrap_port = await self.serve(app)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "bootstrap_port": self.bootstrap_port, "engine_id": self.engine_id}

    def held(self) -> int:
        return sum(1 for f in self.pushed.values() if f.done())

    def slot(self, transfer_id: str) -> asyncio.Future:
        return self.pushed.setdefault(transfer_id, asyncio.get_running_loop().create_future())

    async def query(self, request: web.Request) -> web.Response:
        self.queries += 1
        worker = {"host": self.host, "port": self.port}
        return web.json_response({"0": {"engine_id": self.engine_id, "worker_addr": worker}})

    async def prepare(self, api: str, body: dict[str, Any], items: list[Item], request: web.Request) -> None:
        params = check_prefill_leg(self, api, body)
        transfer_id = params.get("transfer_id")
        if not isinstance(transfer_id, str) or not transfer_id.startswith("xfer-"):
            raise self.violation(f"prefill leg needs transfer_id 'xfer-<uuid>', got {transfer_id!r}")
        slot = self.slot(transfer_id)
        if not slot.done():
            slot.set_result({"cached_tokens": [len(i.prompt_ids) for i in items]})

    async def recv(self, request: web.Request) -> web.Response:
        want = await request.json()
        if want.get("engine_id") != self.engine_id:
            return web.json_response({"error": "wrong engine id"}, status=404)
        transfer_id = want["transfer_id"]
        try:
            kv = await asyncio.wait_for(asyncio.shield(self.slot(transfer_id)), float(self.knobs["rendezvous_timeout_s"]))
        except asyncio.TimeoutError:
            return web.json_response({"error": "nothing pushed for this transfer_id"}, status=504)
        self.pushed.pop(transfer_id, None)
        return web.json_response(kv)


class MooncakeDecode(MockWorker):
    role = "decode"
    owned_by = "vllm"
    native_generate = False

    async def prepare(self, api: str, body: dict[str, Any], items: list[Item], request: web.Request) -> None:
        params = body.get("kv_transfer_params")
        need = ("transfer_id", "remote_engine_id", "remote_bootstrap_addr")
        if not isinstance(params, dict) or params.get("do_remote_prefill") is not True or params.get("do_remote_decode") is not False:
            raise self.violation(f"decode leg needs do_remote_prefill=true, do_remote_decode=false, got {params!r}")
        missing = [k for k in need if not params.get(k)]
        if missing:
            raise self.violation(f"decode leg kv_transfer_params lacks {missing}")
        base = str(params["remote_bootstrap_addr"]).rstrip("/")
        timeout = aiohttp.ClientTimeout(total=float(self.knobs["rendezvous_timeout_s"]) + 5)
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                async with session.get(f"{base}/query") as resp:
                    engine_id = (await resp.json())["0"]["engine_id"]
                if engine_id != params["remote_engine_id"]:
                    raise self.violation(f"remote_engine_id {params['remote_engine_id']!r} is not the prefill's {engine_id!r}")
                recv = {"engine_id": engine_id, "transfer_id": params["transfer_id"]}
                async with session.post(f"{base}/recv", json=recv) as resp:
                    if resp.status != 200:
                        raise LegFailure(f"KV receive failed: {resp.status}")
                    kv = await resp.json()
        except aiohttp.ClientError as exc:
            raise LegFailure(f"cannot reach the prefill bootstrap {base}: {exc}") from None
        for item, cached in zip(items, kv["cached_tokens"]):
            item.cached_tokens = cached
