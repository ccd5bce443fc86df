"""The mock worker base: an aiohttp server with an engine's HTTP surface, records, fault knobs.

Subclasses add a PD role by overriding `prepare` (the rendezvous before generating) and
`response_extra`. Every generation request is recorded; `pending` counts handlers still running,
so a test can prove that no leg was left waiting after the gateway gave up on a request.
Handlers are cancelled when the peer closes the connection (handler_cancellation), like an engine
that aborts a request whose client went away.
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import ssl
from typing import Any

from aiohttp import web

from . import model
from .model import BadRequest, Item

DEFAULT_KNOBS: dict[str, Any] = {
    "fail_status": None,  # answer every generation request with this HTTP status
    "hang": False,  # accept generation requests and never answer
    "delay_s": 0.0,  # wait this long before answering
    "die_mid_stream": False,  # streams: send two events, then drop the connection
    "healthy": True,  # /health answers 200, else 503
    "rendezvous_timeout_s": 60.0,  # how long a PD leg waits for its peer (engines: 300 s)
}


class LegFailure(Exception):
    """The engine fails the request (HTTP 500), e.g. a KV transfer that cannot complete."""


def bind_socket(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen(512)
    return sock


class MockWorker:
    """A regular OpenAI/SGLang worker; PD roles subclass it."""

    role = "null"  # SGLang's disaggregation_mode
    owned_by = "sglang"
    native_generate = True  # SGLang serves /generate; vLLM does not
    prefill_only = False  # answers one token (a prefill leg)
    logprob_side = "prefill"  # which half of input_token_logprobs this worker knows

    extra_knobs: dict[str, Any] = {}  # role-specific knobs with their defaults

    def __init__(self, *, model_name: str = "mock-model", host: str = "127.0.0.1",
                 ssl_context: ssl.SSLContext | None = None, **knobs: Any) -> None:
        defaults = {**DEFAULT_KNOBS, **self.extra_knobs}
        unknown = set(knobs) - set(defaults)
        if unknown:
            raise TypeError(f"unknown knobs {sorted(unknown)}")
        self.model_name = model_name
        self.host = host
        self.knobs = {**defaults, **knobs}
        self.received: list[dict[str, Any]] = []
        # Serve the engine's HTTP surface over TLS (an https:// worker); side servers such as
        # bootstrap stay plain, as engines serve them.
        self.ssl_context = ssl_context
        # (path, Authorization header or "") of every request, probes included.
        self.authorizations: list[tuple[str, str]] = []
        self.violations: list[str] = []
        self.pending = 0
        self.completed = 0
        self.port = 0
        self._runners: list[web.AppRunner] = []

    # ---- lifecycle -------------------------------------------------------------------------

    def main_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._record_authorization])
        gen = self.generation_handler
        app.router.add_post("/v1/completions", functools.partial(gen, api="completions"))
        app.router.add_post("/v1/chat/completions", functools.partial(gen, api="chat"))
        if self.native_generate:
            app.router.add_post("/generate", functools.partial(gen, api="generate"))
        app.router.add_get("/health", self.health)
        app.router.add_get("/health_generate", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/get_server_info", self.server_info)
        app.router.add_get("/v1/loads", self.loads)
        app.router.add_get("/_mock/state", self.state_handler)
        app.router.add_post("/_mock/config", self.config_handler)
        return app

    @web.middleware
    async def _record_authorization(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.authorizations.append((request.path, request.headers.get("Authorization", "")))
        return await handler(request)

    async def serve(self, app: web.Application, tls: bool = False) -> int:
        """Serve `app` on a fresh loopback port (over TLS when `tls` and the worker has a
        context); returns the port."""
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        sock = bind_socket(self.host)
        await web.SockSite(runner, sock, ssl_context=self.ssl_context if tls else None).start()
        self._runners.append(runner)
        return sock.getsockname()[1]

    async def start(self) -> None:
        self.port = await self.serve(self.main_app(), tls=True)

    async def stop(self) -> None:
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners.clear()

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://{self.host}:{self.port}"

    def describe(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, "url": self.url}

    # ---- introspection ---------------------------------------------------------------------

    def held(self) -> int:
        """KV this worker holds for a peer that has not taken it yet (PD roles override)."""
        return 0

    def state(self) -> dict[str, Any]:
        return {
            "received": self.received,
            "pending": self.pending,
            "held": self.held(),
            "completed": self.completed,
            "violations": self.violations,
            "authorizations": self.authorizations,
            "knobs": self.knobs,
        }

    async def state_handler(self, request: web.Request) -> web.Response:
        return web.json_response(self.state())

    async def config_handler(self, request: web.Request) -> web.Response:
        changes = await request.json()
        unknown = set(changes) - set(self.knobs)
        if unknown:
            return web.json_response({"error": f"unknown knobs {sorted(unknown)}"}, status=400)
        self.knobs.update(changes)
        return web.json_response(self.knobs)

    # ---- engine surface --------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.knobs["healthy"] else 503)

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": self.owned_by}
        return web.json_response({"object": "list", "data": [card]})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.model_name, "disaggregation_mode": self.role})

    async def loads(self, request: web.Request) -> web.Response:
        load = {"num_running_reqs": self.pending, "num_waiting_reqs": 0, "num_used_tokens": 0}
        return web.json_response({"loads": [load]})

    def violation(self, message: str) -> BadRequest:
        """Record a protocol violation by the caller and return the 400 to raise."""
        self.violations.append(message)
        return BadRequest(message)

    # ---- generation ------------------------------------------------------------------------

    async def prepare(self, api: str, body: dict[str, Any], items: list[Item], request: web.Request) -> None:
        """The PD rendezvous before generating; a regular worker has none."""

    def response_extra(self, api: str, body: dict[str, Any], items: list[Item]) -> dict[str, Any]:
        """Top-level fields added to a non-streamed OpenAI response (e.g. kv_transfer_params)."""
        return {}

    async def generation_handler(self, request: web.Request, api: str) -> web.StreamResponse:
        self.pending += 1
        try:
            return await self._generate(request, api)
        finally:
            self.pending -= 1

    async def _generate(self, request: web.Request, api: str) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        headers = {k.lower(): v for k, v in request.headers.items() if k.lower().startswith("x-")}
        self.received.append({"path": request.path, "api": api, "headers": headers, "body": body})
        knobs = self.knobs
        if knobs["delay_s"]:
            await asyncio.sleep(float(knobs["delay_s"]))
        if knobs["hang"]:
            await asyncio.Event().wait()  # until the peer closes the connection
        if knobs["fail_status"]:
            return error_response(int(knobs["fail_status"]), f"injected failure in {type(self).__name__}")
        try:
            items = model.parse_items(api, body)
            await self.prepare(api, body, items, request)
        except BadRequest as exc:
            return error_response(400, str(exc))
        except LegFailure as exc:
            return error_response(500, str(exc))
        if body.get("stream"):
            response = await self.stream(request, api, body, items)
        else:
            response = self.whole(api, body, items)
        self.completed += 1
        return response

    def produced(self, item: Item) -> list[tuple[int, str]]:
        return item.tokens(1 if self.prefill_only else None)

    def whole(self, api: str, body: dict[str, Any], items: list[Item]) -> web.Response:
        if api == "generate":
            rid = model.new_id(api)
            side = self.logprob_side if body.get("return_logprob") else None
            objs = [model.generate_object(i, self.produced(i), True, rid, side, self.prefill_only) for i in items]
            return web.json_response(objs if model.is_batch(api, body) else objs[0])
        choices, total = [], 0
        for item in items:
            toks = self.produced(item)
            total += len(toks)
            choices.append(model.openai_choice(api, item.index, "".join(s for _, s in toks), "length", chunk=False))
        obj = model.openai_object(api, self.model_name, model.new_id(api), choices, chunk=False)
        obj["usage"] = model.usage(items, total)
        obj.update(self.response_extra(api, body, items))
        return web.json_response(obj)

    async def stream(self, request: web.Request, api: str, body: dict[str, Any], items: list[Item]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        sent = 0
        for event in self.events(api, body, items):
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            sent += 1
            if self.knobs["die_mid_stream"] and sent == 2:
                if request.transport is not None:
                    request.transport.abort()  # a crash: no terminating chunk, no [DONE]
                return resp
            await asyncio.sleep(0)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def events(self, api: str, body: dict[str, Any], items: list[Item]) -> list[dict[str, Any]]:
        rid = model.new_id(api)
        out: list[dict[str, Any]] = []
        if api == "generate":
            side = self.logprob_side if body.get("return_logprob") else None
            for item in items:
                toks = self.produced(item)
                for k in range(1, len(toks) + 1):
                    obj = model.generate_object(item, toks[:k], k == len(toks), rid, side, self.prefill_only)
                    obj["index"] = item.index
                    out.append(obj)
            return out
        total = 0
        for item in items:
            toks = self.produced(item)
            total += len(toks)
            for k, (_, text) in enumerate(toks):
                finish = "length" if k == len(toks) - 1 else None
                choice = model.openai_choice(api, item.index, text, finish, chunk=True, first=k == 0)
                out.append(model.openai_object(api, self.model_name, rid, [choice], chunk=True))
        if (body.get("stream_options") or {}).get("include_usage"):
            last = model.openai_object(api, self.model_name, rid, [], chunk=True)
            last["usage"] = model.usage(items, total)
            out.append(last)
        return out


def error_response(status: int, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "internal_error"
    body = {"error": {"message": message, "type": kind, "code": status, "param": None}}
    return web.json_response(body, status=status)
