#!/usr/bin/env python3
"""Gateway CPU per streamed request on `/v1/responses` against the same request on
`/v1/chat/completions` (issue 29 item 7: the translation may add at most 10 %). Not a test: a
benchmark, meaningful on a quiet machine only.

One gateway (`pdgate launch`, the installed build) in front of one regular worker, a small
aiohttp mock in its own process that streams 16 chat content chunks and the usage chunk. Rounds
alternate the route; N streamed requests each from an async httpx client at a fixed concurrency.
The gateway process's CPU (utime + stime from /proc/PID/stat) over the measured requests, divided
by their number, is the cost per request. The chat requests ask for the usage chunk, as the
translated Responses request does, so both routes relay the same worker stream.

    python bench/gateway/responses_cpu.py --requests 2000 --concurrency 16 --rounds 3
    python bench/gateway/responses_cpu.py --requests 200 --concurrency 4 --rounds 1   # CI's smoke

Exits 1 after its summary when any measured request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from accounting_cpu import cpu_seconds, free_port, wait_ready  # noqa: E402

CHUNKS = 16
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": CHUNKS,
        "stream": True, "stream_options": {"include_usage": True}}
RESPONSES = {"model": "m", "input": "hello there", "max_output_tokens": CHUNKS, "stream": True}


def serve_mock(port: int) -> None:
    from aiohttp import web

    def chunk(i: int) -> bytes:
        ev = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m",
              "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": None}]}
        return f"data: {json.dumps(ev)}\n\n".encode()

    chunks = [chunk(i) for i in range(CHUNKS)]
    usage = {"prompt_tokens": 12, "completion_tokens": CHUNKS, "total_tokens": 12 + CHUNKS}
    tail = f"data: {json.dumps({'id': 'chatcmpl-1', 'object': 'chat.completion.chunk', 'choices': [], 'usage': usage})}\n\n"

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for c in chunks:
            await resp.write(c)
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(tail.encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


async def drive(url: str, path: str, n: int, concurrency: int) -> int:
    import httpx

    body = CHAT if path == "/v1/chat/completions" else RESPONSES
    end = b"data: [DONE]\n\n" if path == "/v1/chat/completions" else b"event: response.completed\n"
    done = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        left = n

        async def worker() -> None:
            nonlocal done, left
            while left > 0:
                left -= 1
                r = await client.post(url + path, json=body)
                if r.status_code == 200 and end in r.content:
                    done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve-mock", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_mock:
        serve_mock(args.serve_mock)
        return
    mock_port, port = free_port(), free_port()
    mock = subprocess.Popen([sys.executable, __file__, "--serve-mock", str(mock_port)])
    time.sleep(1.5)
    cmd = [sys.executable, "-m", "pdgate.cli", "launch", "--host", "127.0.0.1", "--port", str(port), "--log-level",
           "warn", "--worker-urls", f"http://127.0.0.1:{mock_port}"]
    gw = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    results: dict[str, list[float]] = {"/v1/chat/completions": [], "/v1/responses": []}
    short: list[str] = []  # runs where a request failed: their figure is not a result
    try:
        wait_ready(url, gw)
        for path in results:  # warm-up
            asyncio.run(drive(url, path, 200, args.concurrency))
        for r in range(args.rounds):
            order = list(results) if r % 2 == 0 else list(reversed(results))
            for path in order:
                before = cpu_seconds(gw.pid)
                ok = asyncio.run(drive(url, path, args.requests, args.concurrency))
                us = (cpu_seconds(gw.pid) - before) / max(ok, 1) * 1e6
                results[path].append(us)
                if ok != args.requests:
                    short.append(f"round {r + 1} {path}: {ok}/{args.requests} ok")
                print(f"round {r + 1} {path:>22}: {us:7.1f} us/request ({ok}/{args.requests} ok)", flush=True)
    finally:
        for p in (gw, mock):
            p.terminate()
            p.wait(timeout=10)
    print(f"\nstreamed ({CHUNKS} chunks), {args.requests} requests x {args.rounds} rounds, "
          f"concurrency {args.concurrency}, load {os.getloadavg()[0]:.1f}")
    means = {k: sum(v) / len(v) for k, v in results.items()}
    for path, values in results.items():
        print(f"{path:>22}: mean {means[path]:7.1f} us/request  runs {', '.join(f'{v:.1f}' for v in values)}")
    if means["/v1/chat/completions"] > 0:
        print(f"responses / chat: {means['/v1/responses'] / means['/v1/chat/completions']:.3f}")
    else:  # the clock counts 10 ms ticks: a few requests may cost none
        print("responses / chat: no ratio (chat's CPU below one clock tick: run more requests)")
    if short:
        raise SystemExit("failed requests: " + "; ".join(short))


if __name__ == "__main__":
    main()
