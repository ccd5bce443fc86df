#!/usr/bin/env python3
"""Gateway CPU per request with the latency accounting (issue 13 item 1) against another build.
Not a test: a benchmark, meaningful on a quiet machine only.

Each gateway binary serves the same load, one after the other and alternating the order: N
requests (streamed by default, 16 content chunks each, with the usage chunk the engine sends when
asked) from an async httpx client at a fixed concurrency, through one regular worker, a small
aiohttp mock in its own process. The gateway's CPU (utime + stime of its process, from
/proc/PID/stat) over the measured requests, divided by their number, is its cost per request.
Needs no wrk or nginx (bench/gateway/standalone_cpu.sh does the non-streamed load with them).

    cargo build --release -p pdgate-gateway --bin pdgate-gateway     # this build
    python bench/gateway/accounting_cpu.py --gateway new=target/release/pdgate-gateway \
        --gateway new+log=target/release/pdgate-gateway:--request-log=/tmp/requests.jsonl \
        --gateway base=/path/to/older/pdgate-gateway --requests 2000 --concurrency 16 --rounds 2

With `--pd-mocks`, two more mocks stand in for a prefill and a decode worker (they answer
`/health` only) and `{prefill}` / `{decode}` in a gateway's flags become their URLs, so a
PD-mode gateway with `--pd-placement conditional` runs its placement decision on every request
and, the regular worker being idle, places each one colocated on it (the same worker and answer
as the regular-mode runs):

    --gateway 'conditional=BINARY:--pd-disaggregation,--prefill={prefill},--decode={decode},--pd-placement=conditional'

CI's smoke: `--requests 20 --concurrency 4 --rounds 1 --pd-mocks` with a regular and a conditional
gateway. Exits 1 after its summary when any measured request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time

CHUNKS = 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_mock(port: int) -> None:
    """A regular OpenAI worker that answers at once: 16 text chunks, usage when asked."""
    from aiohttp import web

    def chunk(i: int) -> bytes:
        ev = {"id": "cmpl-1", "object": "text_completion", "model": "m",
              "choices": [{"index": 0, "text": f" tok{i}", "logprobs": None, "finish_reason": None}]}
        return f"data: {json.dumps(ev)}\n\n".encode()

    body_chunks = [chunk(i) for i in range(CHUNKS)]
    usage = {"prompt_tokens": 12, "completion_tokens": CHUNKS, "total_tokens": 12 + CHUNKS}
    usage_chunk = f"data: {json.dumps({'id': 'cmpl-1', 'choices': [], 'usage': usage})}\n\n".encode()
    whole = json.dumps({"id": "cmpl-1", "object": "text_completion", "model": "m", "usage": usage,
                        "choices": [{"index": 0, "text": "x" * CHUNKS, "finish_reason": "length"}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.Response(text=whole, content_type="application/json")
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for c in body_chunks:
            await resp.write(c)
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(usage_chunk)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def drive(url: str, n: int, concurrency: int, stream: bool) -> int:
    import httpx

    body = {"model": "m", "prompt": "hello there", "max_tokens": CHUNKS, "stream": stream}
    done = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(n):
            queue.put_nowait(i)

        async def worker() -> None:
            nonlocal done
            while not queue.empty():
                queue.get_nowait()
                r = await client.post(url + "/v1/completions", json=body)
                if r.status_code == 200 and (not stream or r.text.endswith("data: [DONE]\n\n")):
                    done += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    import httpx

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"gateway exited: {proc.stdout.read() if proc.stdout else ''}")
        try:
            if httpx.get(url + "/readiness", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"gateway {url} never became ready")


def measure(binary: str, extra: list[str], worker: str, args: argparse.Namespace) -> tuple[float, int]:
    port = free_port()
    cmd = [binary, "--port", str(port), "--log-level", "warn", "--worker-urls", worker, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
        asyncio.run(drive(url, min(200, args.requests), args.concurrency, not args.no_stream))  # warm-up
        before = cpu_seconds(proc.pid)
        ok = asyncio.run(drive(url, args.requests, args.concurrency, not args.no_stream))
        used = cpu_seconds(proc.pid) - before
        import httpx

        # Which placements the decisions made (PD mode), so a run shows it took the path meant.
        placed = [line for line in httpx.get(url + "/metrics", timeout=5).text.splitlines()
                  if line.startswith("pdgate_placement_total{") and not line.endswith(" 0")]
        if placed:
            print("   ", "; ".join(placed), flush=True)
        return used / max(ok, 1) * 1e6, ok
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gateway", action="append", required=True,
                    help="NAME=BINARY[:EXTRA-FLAG,...] (flags as --flag=value), repeatable")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--pd-mocks", action="store_true", help="start a prefill and a decode mock for {prefill}/{decode}")
    ap.add_argument("--serve-mock", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_mock:
        serve_mock(args.serve_mock)
        return
    ports = [free_port() for _ in range(3 if args.pd_mocks else 1)]
    mocks = [subprocess.Popen([sys.executable, __file__, "--gateway", "x=x", "--serve-mock", str(p)]) for p in ports]
    mock = mocks[0]
    worker = f"http://127.0.0.1:{ports[0]}"
    urls = {"{prefill}": f"http://127.0.0.1:{ports[1]}", "{decode}": f"http://127.0.0.1:{ports[2]}"} if args.pd_mocks else {}
    gateways = []
    for spec in args.gateway:
        name, _, rest = spec.partition("=")
        binary, _, flags = rest.partition(":")
        extra = [urls.get(p, p) for f in flags.split(",") if f for p in f.split("=", 1)]
        gateways.append((name, binary, extra))
    results: dict[str, list[float]] = {name: [] for name, _, _ in gateways}
    short: list[str] = []  # runs where a request failed: their figure is not a result
    try:
        time.sleep(1.5)
        for r in range(args.rounds):
            order = gateways if r % 2 == 0 else list(reversed(gateways))
            for name, binary, extra in order:
                us, ok = measure(binary, extra, worker, args)
                results[name].append(us)
                if ok != args.requests:
                    short.append(f"round {r + 1} {name}: {ok}/{args.requests} ok")
                print(f"round {r + 1} {name:>12}: {us:7.1f} us/request ({ok}/{args.requests} ok)", flush=True)
    finally:
        for m in mocks:
            m.terminate()
            m.wait(timeout=10)
    load = os.getloadavg()[0]
    kind = "non-streamed" if args.no_stream else f"streamed ({CHUNKS} chunks)"
    print(f"\n{kind}, {args.requests} requests x {args.rounds} rounds, concurrency {args.concurrency}, load {load:.1f}")
    for name, values in results.items():
        print(f"{name:>12}: mean {sum(values) / len(values):7.1f} us/request  runs {', '.join(f'{v:.1f}' for v in values)}")
    if short:
        raise SystemExit("failed requests: " + "; ".join(short))


if __name__ == "__main__":
    main()
