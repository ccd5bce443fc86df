"""Which path an item takes, and the decode-side glue after KV arrives.

| request carries                                   | prefill engine            | decode engine               |
|---------------------------------------------------|---------------------------|-----------------------------|
| bootstrap_host/port/room                          | wait for D, compute, push | reserve, register, receive  |
| bootstrap_host "2.2.2.2"                          | compute, no transfer      | compute locally             |
| kv_transfer_params do_remote_decode (+transfer_id)| compute, push (Mooncake)  |                             |
| kv_transfer_params do_remote_decode               | compute, hold (NIXL)      |                             |
| kv_transfer_params do_remote_prefill (+transfer_id)|                          | reserve, register, receive  |
| kv_transfer_params do_remote_prefill (remote_*)   |                           | reserve, pull               |
| nothing of the above                              | compute locally           | compute locally (counted)   |
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import aiohttp

from .items import GenItem
from .sequence import EngineError, Seq
from .transfer.context import with_timeout
from .transfer.pull import REQUIRED, duplicate_request_id, pull_receive, release_remote
from .transfer.push import push_receive

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("pdgate.engine")
DEFAULT_BOOTSTRAP_PORT = 8998


class PDDriver:
    def __init__(self, engine: "Engine"):
        self.e = engine
        self._notices: set[asyncio.Task] = set()

    def _spawn(self, coro) -> None:
        """Run a notice in the background (it outlives the request it is about)."""
        task = asyncio.ensure_future(coro)
        self._notices.add(task)
        task.add_done_callback(self._notices.discard)

    def is_prefill_leg(self, item: GenItem) -> bool:
        if self.e.mode == "prefill" and item.has_bootstrap:
            return True
        p = item.kv_transfer_params or {}
        return bool(p.get("do_remote_decode"))

    async def drive(self, item: GenItem, seq: Seq) -> None:
        e, p = self.e, item.kv_transfer_params or {}
        if item.has_bootstrap and e.mode in ("prefill", "decode"):
            if e.is_fake_host(item):
                return await self._fake(seq)
            if e.mode == "prefill":
                await e.push.run("bootstrap", item.bootstrap_room, seq, wait_first=True)
                return self._finish_prefill(seq)
            return await self._receive(seq, "bootstrap", item.bootstrap_room,
                                       lambda: self._route(item))
        if p.get("do_remote_decode"):
            if p.get("transfer_id"):
                await e.push.run("mooncake", str(p["transfer_id"]), seq, wait_first=False)
                seq.kv_transfer_params = {"do_remote_prefill": True, "do_remote_decode": False,
                                          "transfer_id": p["transfer_id"],
                                          "remote_engine_id": e.engine_id}
            else:
                if seq.rid in e.pull.holds:  # refuse before computing; hold() re-checks after
                    raise duplicate_request_id(seq.rid)
                await e.run_prefill(seq)
                seq.kv_transfer_params = e.pull.hold(seq)
            return self._finish_prefill(seq)
        if p.get("do_remote_prefill"):
            if p.get("transfer_id") and p.get("remote_bootstrap_addr"):
                return await self._receive(seq, "mooncake", str(p["transfer_id"]),
                                           lambda: self._query(p))
            if all(p.get(k) is not None for k in REQUIRED):
                return await self._pull(seq, p)
        if e.mode != "null":
            e.counters["local_recompute"] += 1
        await e.start_local(seq)

    # ---- prefill side --------------------------------------------------------------------
    def _finish_prefill(self, seq: Seq) -> None:
        seq.finish({"type": "length", "length": 0})

    async def _fake(self, seq: Seq) -> None:
        if seq.prefill_only:
            try:
                await self.e.run_prefill(seq)
            finally:
                self.e.release(seq)
            return self._finish_prefill(seq)
        await self.e.start_local(seq)

    # ---- decode side ---------------------------------------------------------------------
    async def _receive(self, seq: Seq, protocol: str, key, resolve) -> None:
        e = self.e
        seq.pages = await e.reserve(e.pages_for_generation(seq), e.ctx.timeouts.bootstrap)
        try:
            addr = await resolve()
            meta = await push_receive(e.ctx, protocol, key, seq, addr)
        except EngineError:
            e.release(seq)
            if protocol == "mooncake" and e.config.kv_load_failure_policy == "recompute":
                return await self._recompute(seq)
            raise
        except BaseException:
            e.release(seq)
            raise
        n = seq.prompt_len
        seq.committed = e.pool.pages_for(n)
        if protocol == "bootstrap":
            seq.computed, seq.cached_tokens = n, n
            seq.input_logprobs, seq.input_top = [], []  # they live on the prefill side
            seq.push_token(int(meta["first_token"]), float(meta["first_logprob"]),
                           [tuple(x) for x in meta.get("first_top") or []])
            reason = e.scheduler.stop_reason(seq)
            if reason is not None:
                seq.finish(reason)
                e.release(seq)
                return
            seq.notify()
        else:  # vLLM: recompute the last prompt token, sample the first token here
            seq.computed, seq.cached_tokens = n - 1, n - 1
        e.scheduler.add(seq)

    async def _pull(self, seq: Seq, params: dict) -> None:
        e = self.e
        try:
            seq.pages = await e.reserve(e.pages_for_generation(seq), e.ctx.timeouts.bootstrap)
            nbytes = await pull_receive(e.ctx, params, seq)
        except BaseException as err:
            e.release(seq)
            # This decode will not pull (again): let the prefill free its blocks now. A pull
            # that reached the prefill has already ended its hold; the notice is then a no-op.
            self._spawn(release_remote(e.ctx, params))
            if isinstance(err, EngineError) and e.config.kv_load_failure_policy == "recompute":
                return await self._recompute(seq)
            raise
        seq.meta_extra["kv_bytes_received"] = nbytes
        seq.committed = e.pool.pages_for(seq.prompt_len)
        seq.computed = seq.cached_tokens = seq.prompt_len - 1
        e.scheduler.add(seq)

    async def _recompute(self, seq: Seq) -> None:
        log.warning("KV load failed for %s; recomputing locally (kv_load_failure_policy)", seq.rid)
        self.e.counters["local_recompute"] += 1
        await self.e.start_local(seq)

    async def _route(self, item: GenItem) -> tuple[str, int]:
        """SGLang: find the prefill rank's side channel through its bootstrap server."""
        return await self.route(item.bootstrap_host, item.bootstrap_port)

    async def route(self, host: str, port: int | None) -> tuple[str, int]:
        """The side channel of the data source (a prefill, or an EPD encode worker) whose
        bootstrap server is at host:port."""
        port = port or DEFAULT_BOOTSTRAP_PORT
        base = f"http://{host}:{port}/route"
        params = {"engine_rank": "0", "target_dp_group": "0", "target_pp_rank": "0"}
        info = await self._get_json(base, params, f"bootstrap server {host}:{port}")
        return info["rank_ip"], int(info["rank_port"])

    async def _query(self, p: dict) -> tuple[str, int]:
        """Mooncake: `GET /query` on the prefill's bootstrap server names its engine and address."""
        base = str(p["remote_bootstrap_addr"]).rstrip("/")
        if "://" not in base:
            base = "http://" + base
        table = await self._get_json(base + "/query", {}, f"bootstrap server {base}")
        want = p.get("remote_engine_id")
        for entry in table.values():
            if want is None or entry.get("engine_id") == want:
                addr = entry.get("worker_addr") or {}
                return addr["host"], int(addr["port"])
        raise EngineError(f"engine {want!r} is not registered at {base}", 500, "kv_transfer_failed")

    async def _get_json(self, url: str, params: dict, what: str) -> dict:
        """GET with retries until the bootstrap timeout (the prefill may still be starting)."""
        async def attempt() -> dict:
            while True:
                try:
                    async with self.e.http.get(url, params=params) as r:
                        if r.status == 200:
                            return await r.json(content_type=None)
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    pass
                await asyncio.sleep(0.1)
        return await with_timeout(attempt(), self.e.ctx.timeouts.bootstrap, f"reaching {what}")
