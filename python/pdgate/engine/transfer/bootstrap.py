"""The prefill's bootstrap HTTP server (default port 8998).

SGLang: prefill ranks register with `PUT /route`; a decode asks `GET /route?engine_rank=-1` for
the prefill's parallel layout and `GET /route?engine_rank=R&target_dp_group=G&target_pp_rank=P`
for the rank's side-channel address. vLLM Mooncake: workers `POST /register`; decodes and
gateways read `GET /query` -> `{dp_rank: {"engine_id": ..., "worker_addr": {...}}}`.
"""

from __future__ import annotations

from aiohttp import web


class BootstrapServer:
    def __init__(self, page_size: int):
        self.page_size = page_size
        self.ranks: dict[tuple[int, int, int], dict] = {}
        self.engines: dict[str, dict] = {}
        self.app = web.Application()
        self.app.router.add_put("/route", self.put_route)
        self.app.router.add_get("/route", self.get_route)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_post("/register", self.register)
        self.app.router.add_get("/query", self.query)
        self.runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> None:
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, host, port).start()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def health(self, _req: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def put_route(self, req: web.Request) -> web.Response:
        try:
            d = await req.json()
            key = (int(d.get("attn_tp_rank", 0)), int(d.get("attn_dp_rank", 0)), int(d.get("pp_rank", 0)))
            _ = d["rank_ip"], int(d["rank_port"])
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"bad registration: {e}"}, status=400)
        self.ranks[key] = d
        return web.Response(text="OK")

    async def get_route(self, req: web.Request) -> web.Response:
        q = req.query
        try:
            rank = int(q.get("engine_rank", "-1"))
            dp, pp = int(q.get("target_dp_group", "0")), int(q.get("target_pp_rank", "0"))
        except ValueError:
            return web.json_response({"error": "bad query"}, status=400)
        if rank == -1:
            if not self.ranks:
                return web.json_response({"error": "no prefill rank registered yet"}, status=503)
            return web.json_response({"prefill_attn_tp_size": 1, "prefill_dp_size": 1,
                                      "prefill_pp_size": 1, "prefill_page_size": self.page_size})
        info = self.ranks.get((rank, dp, pp))
        if info is None:
            return web.json_response({"error": f"rank {rank} dp {dp} pp {pp} not registered"}, status=404)
        return web.json_response({"rank_ip": info["rank_ip"], "rank_port": info["rank_port"]})

    async def register(self, req: web.Request) -> web.Response:
        try:
            d = await req.json()
            dp_rank = str(int(d.get("dp_rank", 0)))
            entry = {"engine_id": str(d["engine_id"]), "worker_addr": d.get("worker_addr") or {}}
        except (ValueError, KeyError, TypeError) as e:
            return web.json_response({"error": f"bad registration: {e}"}, status=400)
        self.engines[dp_rank] = entry
        return web.json_response({"status": "ok"})

    async def query(self, _req: web.Request) -> web.Response:
        return web.json_response(self.engines)
