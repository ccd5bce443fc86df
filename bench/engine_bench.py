"""Benchmarks of the pdgate reference engine. One run measures everything:

  model     prefill and decode tokens/s of `tiny` and `small` (in-process, 1 BLAS thread)
  transfer  KV transfer GB/s through the engine's SGLang bootstrap path (two worker processes)
            per data plane (built-in TCP; Mooncake TE and NIXL when installed), each next to raw
            loopback between two processes through the same library (best of 5), in the same
            run; the engine figure is the median of 5 transfers after a first one that also
            sets up the connection (recorded as *_first_GBps)
  itl       inter-token latency of in-flight decodes while long prompts arrive: colocated with
            chunked prefill vs disaggregated (prefill on another worker)

Usage: PYTHONPATH=python python bench/engine_bench.py [model|transfer|itl|all] [--json out.json]
           [--svg itl.svg] [--smoke]

--smoke (CI's smoke of this script: `all --smoke --json F --svg G`) runs every stage at a toy size
(the tiny model only, short prompts, a few steps and tokens): its figures mean nothing, it only
proves the path still runs. --svg: where the ITL plot goes (default bench/engine_itl.svg).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import random  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from pdgate.engine.config import PRESETS  # noqa: E402
from pdgate.engine.kv import KVPool  # noqa: E402
from pdgate.engine.model import Model, Segment  # noqa: E402
from pdgate.engine.weights import random_weights  # noqa: E402
from pdgate.workers import ReferenceWorker  # noqa: E402


# ---- model throughput ----------------------------------------------------------------------
def bench_model(name: str, prompt_len: int, batch: int, ctx: int, steps: int) -> dict:
    cfg = PRESETS[name]
    model, page = Model(cfg, random_weights(cfg, 0)), 16
    pool = KVPool((prompt_len + batch * (ctx + steps)) // page + batch + 8, page,
                  cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    rng = np.random.default_rng(0)
    best = float("inf")
    for _ in range(2):
        pages = pool.reserve(pool.pages_for(prompt_len))
        toks = rng.integers(0, 256, prompt_len).tolist()
        t0 = time.perf_counter()
        model.forward(pool, [Segment(pages, 0, toks)])
        best = min(best, time.perf_counter() - t0)
        pool.free(pages)
    seqs = []
    for _ in range(batch):
        pages = pool.reserve(pool.pages_for(ctx + steps))
        model.forward(pool, [Segment(pages, 0, rng.integers(0, 256, ctx).tolist())])
        seqs.append(pages)
    t0 = time.perf_counter()
    for s in range(steps):
        model.forward(pool, [Segment(p, ctx + s, [1]) for p in seqs])
    dt = time.perf_counter() - t0
    return {"model": name, "params_M": round(cfg.num_params() / 1e6, 1),
            "prefill_tokens": prompt_len, "prefill_tok_s": round(prompt_len / best),
            "decode_batch": batch, "decode_ctx": ctx, "decode_tok_s": round(batch * steps / dt),
            "decode_step_ms": round(dt / steps * 1e3, 2)}


# ---- raw loopback ------------------------------------------------------------------------
def _asyncio_sink(port_q, nbytes: int) -> None:
    async def main():
        done = asyncio.Event()

        async def handle(reader, writer):
            left = nbytes
            while left:
                chunk = await reader.read(min(left, 1 << 22))
                left -= len(chunk)
            writer.write(b"k")
            await writer.drain()
            writer.close()
            done.set()
        srv = await asyncio.start_server(handle, "127.0.0.1", 0)
        port_q.put(srv.sockets[0].getsockname()[1])
        await done.wait()
    asyncio.run(main())


def _socket_sink(port_q, nbytes: int) -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    port_q.put(s.getsockname()[1])
    c, _ = s.accept()
    buf, left = bytearray(1 << 22), nbytes
    view = memoryview(buf)
    while left:
        left -= c.recv_into(view[:min(left, len(buf))])
    c.sendall(b"k")
    c.close()


def _mooncake_sink(q, done, nbytes: int) -> None:
    from mooncake.engine import TransferEngine
    te = TransferEngine()
    te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    buf = np.zeros(nbytes, dtype=np.uint8)
    te.register_memory(buf.ctypes.data, buf.nbytes)
    q.put((f"127.0.0.1:{te.get_rpc_port()}", buf.ctypes.data))
    done.wait(120)


def raw_mooncake(nbytes: int) -> float:
    """GB/s of one Mooncake TE (TCP) write of nbytes into another process; best of 5."""
    from mooncake.engine import TransferEngine
    te = TransferEngine()
    te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    src = np.ones(nbytes, dtype=np.uint8)
    te.register_memory(src.ctypes.data, src.nbytes)
    spawn = mp.get_context("spawn")
    q, done = spawn.Queue(), spawn.Event()
    proc = spawn.Process(target=_mooncake_sink, args=(q, done, nbytes))
    proc.start()
    session, addr = q.get(timeout=60)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        rc = te.transfer_sync_write(session, src.ctypes.data, addr, nbytes)
        best = min(best, time.perf_counter() - t0)
        assert rc == 0, rc
    done.set()
    proc.join(30)
    return nbytes / best / 1e9


def _nixl_sink(q, done, nbytes: int) -> None:
    from pdgate.engine.transfer.nixl_dp import make_agent
    ag = make_agent("bench-sink", progress_thread=True)
    buf = np.zeros(nbytes, dtype=np.uint8)
    ag.register_memory([(buf.ctypes.data, nbytes, 0, "")], "DRAM")
    q.put((ag.get_agent_metadata(), buf.ctypes.data))
    done.wait(120)


def raw_nixl(nbytes: int) -> float:
    """GB/s of one NIXL (UCX) WRITE of nbytes into another process; best of 5. The agents are
    configured as the engine's (the writer without a progress thread: faster, see nixl_dp)."""
    from pdgate.engine.transfer.nixl_dp import make_agent
    spawn = mp.get_context("spawn")
    q, done = spawn.Queue(), spawn.Event()
    proc = spawn.Process(target=_nixl_sink, args=(q, done, nbytes))
    proc.start()  # before this process creates its agent: UCX state must not be forked
    ag = make_agent("bench-src", progress_thread=False)
    src = np.ones(nbytes, dtype=np.uint8)
    ag.register_memory([(src.ctypes.data, nbytes, 0, "")], "DRAM")
    meta, addr = q.get(timeout=120)
    name = ag.add_remote_agent(meta)
    best = float("inf")
    for _ in range(5):
        h = ag.initialize_xfer("WRITE", ag.get_xfer_descs([(src.ctypes.data, nbytes, 0)], "DRAM"),
                               ag.get_xfer_descs([(addr, nbytes, 0)], "DRAM"), name, b"b")
        t0 = time.perf_counter()
        state = ag.transfer(h)
        while state not in ("DONE", "ERR"):
            state = ag.check_xfer_state(h)
        best = min(best, time.perf_counter() - t0)
        ag.release_xfer_handle(h)
        assert state == "DONE"
    done.set()
    proc.join(30)
    return nbytes / best / 1e9


def raw_loopback(nbytes: int, kind: str) -> float:
    """GB/s moving nbytes to another process over loopback TCP; best of 5."""
    best = float("inf")
    payload = np.ones(1 << 22, dtype=np.uint8).tobytes()
    for _ in range(5):
        q = mp.Queue()
        proc = mp.Process(target=_asyncio_sink if kind == "asyncio" else _socket_sink, args=(q, nbytes))
        proc.start()
        port = q.get(timeout=30)
        if kind == "asyncio":
            async def send():
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                t0 = time.perf_counter()
                for _ in range(nbytes // len(payload)):
                    writer.write(payload)
                    await writer.drain()
                await reader.readexactly(1)
                writer.close()
                return time.perf_counter() - t0
            dt = asyncio.run(send())
        else:
            s = socket.create_connection(("127.0.0.1", port))
            t0 = time.perf_counter()
            for _ in range(nbytes // len(payload)):
                s.sendall(payload)
            s.recv(1)
            dt = time.perf_counter() - t0
            s.close()
        proc.join(10)
        best = min(best, dt)
    return nbytes / best / 1e9


def _engine_transfer(backend: str, prompt_len: int, model: str = "small") -> tuple[int, list[float]]:
    """GB/s of each transfer through the bootstrap path between two workers (`small` by default), the first
    (which also sets up the connection to this peer) first; returns (bytes, [GB/s, ...])."""
    import threading
    kw = {"model": model, "transfer_backend": backend}
    with ReferenceWorker("prefill", **kw) as p, ReferenceWorker("decode", **kw) as d:
        rng = random.Random(0)
        results = []
        with httpx.Client(timeout=300) as c, httpx.Client(timeout=300) as c2:
            for i in range(6):
                b = {"input_ids": [256] + [rng.randrange(256) for _ in range(prompt_len - 1)],
                     "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                     "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port,
                     "bootstrap_room": i}
                t = threading.Thread(target=lambda: c2.post(p.url + "/generate", json=b))
                t.start()
                m = c.post(d.url + "/generate", json=b).json()["meta_info"]
                t.join()
                results.append((m["kv_bytes_received"], m["kv_transfer_seconds"]))
    return results[0][0], [round(n / s / 1e9, 3) for n, s in results]


def _engine_row(out: dict, name: str, runs: list[float]) -> float:
    """Median of the transfers after the first (which warms the connection up), all recorded."""
    got = statistics.median(runs[1:])
    out[f"engine_{name}_GBps"] = round(got, 3)
    out[f"engine_{name}_runs_GBps"] = runs[1:]
    out[f"engine_{name}_first_GBps"] = runs[0]
    return got


def bench_transfer(prompt_len: int = 2048, model: str = "small") -> dict:
    nbytes, runs = _engine_transfer("tcp", prompt_len, model)
    raw = max(1 << 22, nbytes - nbytes % (1 << 22))  # whole 4 MiB sends (at least one: --smoke)
    out: dict = {"kv_bytes": nbytes}
    tcp = _engine_row(out, "tcp", runs)
    out["raw_asyncio_GBps"] = round(raw_loopback(raw, "asyncio"), 3)
    out["raw_socket_GBps"] = round(raw_loopback(raw, "socket"), 3)
    out["engine_tcp_vs_raw_asyncio"] = round(tcp / out["raw_asyncio_GBps"], 2)
    import importlib.util
    for name, raw_fn, mods in (("mooncake", raw_mooncake, ("mooncake",)),
                               ("nixl", raw_nixl, ("nixl", "nixl_cu12"))):
        if not any(importlib.util.find_spec(m) for m in mods):
            out[name] = "not installed"
            continue
        got = _engine_row(out, name, _engine_transfer(name, prompt_len, model)[1])
        out[f"raw_{name}_GBps"] = round(raw_fn(nbytes), 3)
        out[f"engine_{name}_vs_raw"] = round(got / out[f"raw_{name}_GBps"], 2)
    return out


# ---- inter-token latency -----------------------------------------------------------------
async def _stream(c, url, body, arrivals: list) -> None:
    async with c.stream("POST", url, json=dict(body, stream=True)) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())


async def _itl_run(decode_url, prefill=None, long_len=2000, n_streams=4, n_long=2, max_new=400) -> list[float]:
    rng = random.Random(1)
    streams = [[] for _ in range(n_streams)]
    room = iter(range(10**6))

    def body(n, max_new):
        b = {"input_ids": [256] + [rng.randrange(256) for _ in range(n - 1)],
             "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
        if prefill is not None:
            b.update(bootstrap_host="127.0.0.1", bootstrap_port=prefill.bootstrap_port, bootstrap_room=next(room))
        return b

    async def send(b, stream_to=None):
        if prefill is not None:
            legs = [c.post(prefill.url + "/generate", json=b)]
        else:
            legs = []
        if stream_to is not None:
            legs.append(_stream(c, decode_url + "/generate", b, stream_to))
        else:
            legs.append(c.post(decode_url + "/generate", json=b))
        await asyncio.gather(*legs)

    async with httpx.AsyncClient(timeout=600) as c:
        decodes = [asyncio.ensure_future(send(body(32, max_new), s)) for s in streams]
        await asyncio.sleep(1.0)
        for _ in range(n_long):
            await send(body(long_len, 1))
            await asyncio.sleep(0.3)
        await asyncio.gather(*decodes)
    return [(b - a) * 1e3 for s in streams for a, b in zip(s[1:], s[2:])]


def _summary(itl: list[float]) -> dict:
    q = np.percentile(itl, [50, 90, 99]) if itl else [0, 0, 0]
    return {"n": len(itl), "p50_ms": round(q[0], 2), "p90_ms": round(q[1], 2),
            "p99_ms": round(q[2], 2), "max_ms": round(max(itl), 2) if itl else 0}


def bench_itl(chunk: int = 512, model: str = "small", **run) -> dict:
    """`run`: _itl_run's sizes (long_len, n_streams, n_long, max_new), its defaults unless given."""
    with ReferenceWorker("null", model=model, extra_args=["--chunked-prefill-size", str(chunk)]) as n:
        colo = asyncio.run(_itl_run(n.url, **run))
    with ReferenceWorker("prefill", model=model, extra_args=["--chunked-prefill-size", str(chunk)]) as p, \
            ReferenceWorker("decode", model=model) as d:
        disagg = asyncio.run(_itl_run(d.url, prefill=p, **run))
    return {"chunked_prefill_size": chunk, "colocated": _summary(colo), "disaggregated": _summary(disagg),
            "colocated_itl_ms": [round(x, 3) for x in colo], "disaggregated_itl_ms": [round(x, 3) for x in disagg]}


def histogram(values: list[float], edges: list[float]) -> list[int]:
    return np.histogram(values, bins=edges)[0].tolist()


def itl_svg(data: dict, path: str) -> None:
    """Two ITL histograms (log-spaced bins) as a dependency-free SVG."""
    edges = [2 ** (i / 2) for i in range(4, 24)]  # 4 ms .. ~2.9 s
    w, h, pad, bar = 760, 260, 40, 0
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{2 * h}" font-family="sans-serif" font-size="11">']
    for row, key in enumerate(("colocated", "disaggregated")):
        counts = histogram(data[f"{key}_itl_ms"], edges)
        top, peak = row * h, max(counts) or 1
        bar = (w - 2 * pad) / len(counts)
        s = data[key]
        parts.append(f'<text x="{pad}" y="{top + 18}" font-size="13">{key}: p50 {s["p50_ms"]} ms, '
                     f'p99 {s["p99_ms"]} ms, max {s["max_ms"]} ms (n={s["n"]})</text>')
        for i, c in enumerate(counts):
            bh = (h - 2 * pad - 10) * c / peak
            x, y = pad + i * bar, top + h - pad - bh
            parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar - 2:.1f}" height="{bh:.1f}" fill="#4a7ab5"/>')
            if c:
                parts.append(f'<text x="{x:.1f}" y="{y - 2:.1f}">{c}</text>')
            if i % 2 == 0:
                parts.append(f'<text x="{x:.1f}" y="{top + h - pad + 14}">{edges[i]:.0f}</text>')
        parts.append(f'<text x="{w - pad - 120}" y="{top + h - pad + 28}">inter-token latency, ms (log bins)</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="?", default="all", choices=["model", "transfer", "itl", "all"])
    ap.add_argument("--json", default=None)
    ap.add_argument("--svg", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_itl.svg"))
    ap.add_argument("--smoke", action="store_true", help="every stage at a toy size (CI): proves the path, measures nothing")
    args = ap.parse_args()
    out: dict = {"cpu_count": os.cpu_count(), "blas_threads": os.environ.get("OPENBLAS_NUM_THREADS"), "smoke": args.smoke}
    if args.what in ("model", "all"):
        sizes = [("tiny", 64, 2, 16, 2)] if args.smoke else [("tiny", 2048, 16, 256, 32), ("small", 2048, 16, 256, 16)]
        out["model"] = [bench_model(*s) for s in sizes]
        print(json.dumps(out["model"], indent=1))
    if args.what in ("transfer", "all"):
        out["transfer"] = bench_transfer(64, "tiny") if args.smoke else bench_transfer()
        print(json.dumps(out["transfer"], indent=1))
    if args.what in ("itl", "all"):
        toy = dict(chunk=32, model="tiny", long_len=64, n_streams=2, n_long=1, max_new=8)
        out["itl"] = bench_itl(**toy) if args.smoke else bench_itl()
        print(json.dumps({k: v for k, v in out["itl"].items() if not k.endswith("_itl_ms")}, indent=1))
        edges = [0, 5, 10, 20, 40, 80, 160, 320, 640, 1280, 5000]
        for k in ("colocated", "disaggregated"):
            print(k, list(zip(edges[:-1], histogram(out["itl"][f"{k}_itl_ms"], edges))))
        itl_svg(out["itl"], args.svg)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
