"""vLLM NixlConnector mocks (docs/protocols.md §2): prefill publishes blocks, decode pulls them.

The prefill holds its blocks until a decode pulls them with exactly the params it returned (a
side channel checks engine id, request id and block ids), so a gateway that drops or alters a
field fails. The decode also checks that both legs carried the same X-Request-Id.
"""

from __future__ import annotations

import uuid
from typing import Any

import aiohttp
from aiohttp import web

from .core import LegFailure, MockWorker
from .model import Item

PULL_FIELDS = ("remote_block_ids", "remote_engine_id", "remote_request_id", "remote_host", "remote_port")
DROPPED_FIELDS = ("stream_options", "min_tokens", "min_completion_tokens")


def check_prefill_leg(worker: MockWorker, api: str, body: dict[str, Any]) -> dict[str, Any]:
    """The prefill-leg rewrite both vLLM connectors expect; returns kv_transfer_params."""
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict) or params.get("do_remote_decode") is not True or params.get("do_remote_prefill") is not False:
        raise worker.violation(f"prefill leg needs kv_transfer_params with do_remote_decode=true, got {params!r}")
    if body.get("stream"):
        raise worker.violation("prefill leg must not stream")
    if body.get("max_tokens") != 1 or (api == "chat" and body.get("max_completion_tokens") not in (None, 1)):
        raise worker.violation(f"prefill leg needs max_tokens=1, got {body.get('max_tokens')!r}")
    present = [k for k in DROPPED_FIELDS if k in body]
    if present:
        raise worker.violation(f"prefill leg must not carry {present}")
    return params


class NixlPrefill(MockWorker):
    role = "prefill"
    owned_by = "vllm"
    native_generate = False
    prefill_only = True
    # omit_kv_params: answer without kv_transfer_params, like a prefill without a connector
    extra_knobs = {"omit_kv_params": False}

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.engine_id = f"nixl-engine-{uuid.uuid4().hex[:8]}"
        self.side_port = 0
        self.published: dict[str, dict[str, Any]] = {}  # remote_request_id -> published blocks

    async def start(self) -> None:
        await super().start()
        app = web.Application()
        app.router.add_post("/pull", self.pull)
        self.side_port = await self.serve(app)

    def held(self) -> int:
        return len(self.published)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "engine_id": self.engine_id, "side_port": self.side_port}

    async def prepare(self, api: str, body: dict[str, Any], items: list[Item], request: web.Request) -> None:
        params = check_prefill_leg(self, api, body)
        for k in ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port"):
            if params.get(k) is not None:
                raise self.violation(f"prefill leg kv_transfer_params.{k} must be null")
        x_request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        request_id = f"cmpl-{x_request_id}-0"
        blocks = [hash((request_id, i)) % 100000 for i in range(1 + len(items[0].prompt_ids) // 4)]
        self.published[request_id] = {"blocks": blocks, "x_request_id": request.headers.get("X-Request-Id"), "items": items}
        items[0].extra["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": blocks,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.host,
            "remote_port": self.side_port,
            "tp_size": 1,
        }

    def response_extra(self, api: str, body: dict[str, Any], items: list[Item]) -> dict[str, Any]:
        if self.knobs["omit_kv_params"]:
            return {}
        return {"kv_transfer_params": items[0].extra["kv_transfer_params"]}

    async def pull(self, request: web.Request) -> web.Response:
        want = await request.json()
        if want.get("engine_id") != self.engine_id:
            return web.json_response({"error": "unknown engine id"}, status=404)
        held = self.published.get(want.get("request_id"))
        if held is None or held["blocks"] != want.get("block_ids"):
            return web.json_response({"error": "no such blocks"}, status=404)
        del self.published[want["request_id"]]
        return web.json_response({"x_request_id": held["x_request_id"], "num_blocks": len(held["blocks"])})


class NixlDecode(MockWorker):
    role = "decode"
    owned_by = "vllm"
    native_generate = False

    def __init__(self, *, on_missing_params: str = "fail", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # "fail" makes a dropped field visible to tests; "recompute" is what vLLM does.
        self.on_missing_params = on_missing_params
        self.recomputed = 0

    async def prepare(self, api: str, body: dict[str, Any], items: list[Item], request: web.Request) -> None:
        params = body.get("kv_transfer_params")
        missing = [k for k in PULL_FIELDS if not isinstance(params, dict) or params.get(k) is None]
        if missing or not params.get("do_remote_prefill"):
            if self.on_missing_params == "recompute":
                self.recomputed += 1
                return  # correct output, nothing cached: the silent failure
            raise self.violation(f"decode leg kv_transfer_params lacks {missing or ['do_remote_prefill']}")
        pull = {"engine_id": params["remote_engine_id"], "request_id": params["remote_request_id"], "block_ids": params["remote_block_ids"]}
        url = f"http://{params['remote_host']}:{params['remote_port']}/pull"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
                async with session.post(url, json=pull) as resp:
                    if resp.status != 200:
                        raise LegFailure(f"KV pull failed: {resp.status} {await resp.text()}")
                    got = await resp.json()
        except aiohttp.ClientError as exc:
            raise LegFailure(f"KV pull from {url} failed: {exc}") from None
        if not got["x_request_id"] or got["x_request_id"] != request.headers.get("X-Request-Id"):
            raise self.violation(f"X-Request-Id differs between legs: {got['x_request_id']!r} vs {request.headers.get('X-Request-Id')!r}")
        for item in items:
            item.cached_tokens = len(item.prompt_ids)
