"""The HTTP server: the surface of an SGLang worker (and a vLLM one) on aiohttp.

aiohttp because one dependency gives the server, the client (bootstrap lookups) and streaming,
and its handler cancellation turns a client disconnect into an abort of the request.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import numpy as np
from aiohttp import web

from . import api_encode, api_native, api_openai, metrics
from .engine import Engine
from .engine_config import EngineConfig
from .errors import EngineStartError
from .http_common import error_body, error_response, read_json
from .items import GenItem
from .kv_events import config_dict
from .sampling import BadRequest, params_from_dict
from .sequence import EngineError

log = logging.getLogger("pdgate.engine")


def engine_app(engine: Engine) -> web.Application:
    app = web.Application(client_max_size=256 << 20, middlewares=[_errors])
    app["engine"] = engine
    r = app.router
    r.add_post("/generate", api_native.generate)
    r.add_post("/v1/completions", api_openai.completions)
    r.add_post("/v1/chat/completions", api_openai.chat_completions)
    r.add_get("/v1/models", api_openai.models)
    r.add_get("/health", health)
    r.add_get("/health_generate", health_generate)
    if not engine.config.vllm_endpoints_only:
        # SGLang's own endpoints; a real vLLM server has none of them.
        r.add_get("/server_info", server_info)
        r.add_get("/get_server_info", server_info)
        r.add_get("/model_info", model_info)
        r.add_get("/get_model_info", model_info)
        r.add_get("/v1/loads", loads)
    r.add_get("/metrics", metrics_handler)
    r.add_post("/abort_request", abort_request)
    r.add_get("/debug/kv_transfers", debug_transfers)
    r.add_route("*", "/flush_cache", flush_cache)
    r.add_post("/reset_prefix_cache", flush_cache)
    if engine.encoder_only:
        r.add_post("/encode", api_encode.encode)
    return app


@web.middleware
async def _errors(request: web.Request, handler):
    """No request ever ends in an HTML 500: unknown paths and failures become JSON errors."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return web.json_response(error_body(e.reason, "invalid_request_error" if e.status < 500
                                            else "server_error", e.status), status=e.status)
    except (BadRequest, EngineError) as e:
        return error_response(e)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as e:
        log.exception("handler failed")
        return error_response(e)


async def health(request: web.Request) -> web.Response:
    e: Engine = request.app["engine"]
    if not e.ready:
        return web.json_response(error_body("starting", "server_error", 503), status=503)
    # --fault-slow-health: once the engine has taken a generation request, its checks stall as a
    # busy real engine's do (before, they answer, so a gateway counts it up); generations are not
    # slowed.
    slow = e.config.fault_slow_health
    if slow > 0 and e.counters["requests"] > 0:
        await asyncio.sleep(slow)
    return web.Response(text="")


async def health_generate(request: web.Request) -> web.Response:
    e: Engine = request.app["engine"]
    if not e.ready:
        return web.json_response(error_body("starting", "server_error", 503), status=503)
    if e.encoder_only or e.ec_encode_only:  # an encoder's check is one real encode (SGLang's encoder /health encodes)
        e.images.tower.forward(np.zeros((3, e.images.tower.vc.image_size, e.images.tower.vc.image_size),
                                        dtype=np.float32))
        return web.Response(text="")
    item = GenItem(rid=f"health-{time.monotonic_ns()}", input_ids=e.tokenizer.encode("hi"),
                   params=params_from_dict({"max_new_tokens": 1, "temperature": 0}))
    seq = e.submit(item)
    try:
        await asyncio.wait_for(asyncio.shield(seq.done), 20)
    except asyncio.TimeoutError:
        e.abort(seq)
        return web.json_response(error_body("generation timed out", "server_error", 503), status=503)
    if seq.error is not None:
        return web.json_response(error_body(str(seq.error), "server_error", 503), status=503)
    return web.Response(text="")


def info_dict(e: Engine) -> dict:
    a = e.config
    d = {k: v for k, v in vars(a).items() if not callable(v)}
    d.update({
        "model_path": a.model, "served_model_name": e.served_name, "tokenizer_path": a.model,
        "disaggregation_mode": e.mode, "disaggregation_bootstrap_port": a.disaggregation_bootstrap_port,
        "disaggregation_transfer_backend": a.disaggregation_transfer_backend,
        "kv_transfer_config": e.kv_transfer_config, "engine_id": e.engine_id,
        "page_size": a.page_size, "max_total_num_tokens": e.pool.num_pages * a.page_size,
        "chunked_prefill_size": a.chunked_prefill_size, "tp_size": 1, "dp_size": 1, "pp_size": 1,
        "context_length": e.cfg.max_position, "kv_side_channel_port": e.ctx.port,
        "kv_layout": e.ctx.layout, "engine": "pdgate-reference", "version": "0.1.0",
        "encoder_only": e.encoder_only, "is_multimodal": e.images is not None,
        "disable_radix_cache": not a.enable_prefix_caching, "kv_events_config": config_dict(a.kv_events_config),
    })
    return d


async def server_info(request: web.Request) -> web.Response:
    return web.json_response(info_dict(request.app["engine"]))


async def model_info(request: web.Request) -> web.Response:
    e: Engine = request.app["engine"]
    c = e.cfg
    return web.json_response({
        "model_path": e.config.model, "tokenizer_path": e.config.model, "is_generation": True,
        "preferred_sampling_params": None, "weight_version": e.ctx.layout["fingerprint"],
        "has_image_understanding": e.images is not None, "has_audio_understanding": False,
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "num_parameters": c.num_params(), "num_layers": c.num_layers, "hidden_size": c.hidden_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "vocab_size": c.vocab_size, "max_position": c.max_position})


def loads_dict(e: Engine) -> dict:
    pool = e.pool.counters()
    used_pages = pool["total"] - pool["free"] - pool["cached"]  # cached pages are evictable
    total_tokens = pool["total"] * e.pool.page_size
    st = e.ctx.stats
    return {"loads": [{
        "dp_rank": 0,
        "num_running_reqs": len(e.scheduler.running),
        "num_waiting_reqs": e.scheduler.num_waiting,
        "num_waiting_uncached_tokens": e.scheduler.waiting_prompt_tokens,
        "num_live_reqs": len(e.live),
        "num_used_tokens": used_pages * e.pool.page_size,
        "num_total_tokens": used_pages * e.pool.page_size + e.scheduler.waiting_prompt_tokens,
        "max_total_num_tokens": total_tokens,
        "token_usage": round(used_pages / pool["total"], 6),
        "kv_pages": pool,
        "prefix_cache": e.prefix_cache_stats(),
        "multimodal": (dict(e.images.stats(), embeddings_waiting_for_prefill=e.embeds.pending,
                            embedding_staging=(e.embed_plane.stats(time.monotonic())
                                               if e.embed_plane is not None else None),
                            ec_connector=e.ec.stats() if e.ec is not None else None)
                       if e.images is not None else None),
        "disaggregation": {
            "mode": e.mode, "transfer_backend": e.config.disaggregation_transfer_backend,
            "kv_connector": (e.kv_transfer_config or {}).get("kv_connector"),
            "transfers_in_flight": e.ctx.table.live_counts(),
            "transfers_finished": dict(e.ctx.table.totals),
            "held_for_pull": len(e.pull.holds),
            "pending_registrations": len(e.push.pending),
            "kv_bytes_sent": st.bytes_sent, "kv_bytes_received": st.bytes_received,
            # pdgate's own field (the gateway's transfer fit reads it): whole transfers received.
            "kv_transfer_totals": {"count": st.transfers_in, "bytes": st.transfer_bytes_in,
                                   "seconds": round(st.transfer_seconds_in, 6)},
            "kv_pages_sent": st.pages_sent, "kv_pages_received": st.pages_received,
            "kv_page_bytes": e.pool.page_bytes,
            "kv_bytes_via_backend": st.backend_bytes,
            "data_plane": (e.ctx.backend.name if e.ctx.backend is not None else "tcp"),
            "local_recompute": e.counters["local_recompute"],
        },
    }]}


async def loads(request: web.Request) -> web.Response:
    return web.json_response(loads_dict(request.app["engine"]))


async def metrics_handler(request: web.Request) -> web.Response:
    body = metrics.render(request.app["engine"])
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


async def abort_request(request: web.Request) -> web.Response:
    """SGLang's `POST /abort_request {"rid": ..., "abort_all": false}`: rid matches by prefix.

    SGLang answers an empty 200; the JSON body here is extra (how many were aborted)."""
    body = await read_json(request)
    e: Engine = request.app["engine"]
    abort_all = bool(body.get("abort_all"))
    rid = body.get("rid", "")
    if not isinstance(rid, str) or not (rid or abort_all):
        raise BadRequest("rid (a non-empty string) or abort_all is required", "rid")
    n = e.abort_matching(rid, abort_all)
    return web.json_response({"aborted": n > 0, "count": n})


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang's `/flush_cache` and vLLM's `POST /reset_prefix_cache`: empty the prefix cache
    (KV event AllBlocksCleared). Refused with 400 while a request holds pages, as SGLang does."""
    if request.method not in ("GET", "POST"):
        raise web.HTTPMethodNotAllowed(request.method, ["GET", "POST"])
    if not request.app["engine"].flush_cache():
        return web.json_response(error_body("Cache not flushed: requests are holding KV pages",
                                            "invalid_request_error", "cache_busy"), status=400)
    return web.Response(text="Cache flushed.\n")


async def debug_transfers(request: web.Request) -> web.Response:
    return web.json_response({"transfers": request.app["engine"].ctx.table.snapshot()})


async def serve(config: EngineConfig) -> int:
    """Run until SIGINT/SIGTERM. /health answers 503 until the engine is ready. Raises
    `EngineConfigError` / `EngineStartError` when the worker cannot start."""
    engine = Engine(config)
    args = engine.config
    app = engine_app(engine)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    grpc_service = args.grpc_service
    http_port = args.port
    if grpc_service:
        from .grpc_server import sidecar_port

        http_port = sidecar_port(args)
    try:
        await web.TCPSite(runner, args.host, http_port).start()
    except OSError as e:
        await runner.cleanup()
        raise EngineStartError(f"cannot listen on http://{args.host}:{http_port} ({e})") from None
    log.info("listening on http://%s:%d", args.host, http_port)
    grpc_server = None
    if grpc_service:  # bound before the engine is ready, so a healthy sidecar means gRPC is up
        from .grpc_server import start_grpc

        grpc_server = await start_grpc(engine, grpc_service, args.host, args.port)
    await engine.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if grpc_server is not None:
        await grpc_server.stop(grace=1.0)
    await engine.stop()
    await runner.cleanup()
    return 0
