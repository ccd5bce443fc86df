"""The optional data planes, Mooncake Transfer Engine and NIXL/UCX (each skipped where it is not
installed): the same equality and byte-count checks as test_pd_equality, with every KV byte
moved by the library, and mixed pairs falling back to TCP frames."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

import engine_router as router
from conftest import assert_clean, loads, start_all
from pdgate.workers import ReferenceWorker

pytestmark = pytest.mark.timeout(180)


def _installed(backend: str) -> bool:
    import importlib.util
    if backend == "mooncake":
        return importlib.util.find_spec("mooncake") is not None
    return any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu12"))


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def mc_workers(request):
    if not _installed(request.param):
        pytest.skip(f"{request.param} is not installed")
    kw = {"transfer_backend": request.param}
    ws = {"sglang": (ReferenceWorker("prefill", **kw), ReferenceWorker("decode", **kw)),
          "nixl": (ReferenceWorker("prefill", kv_connector="NixlConnector", **kw),
                   ReferenceWorker("decode", kv_connector="NixlConnector", **kw)),
          "mixed": (ReferenceWorker("prefill", **kw), ReferenceWorker("decode"))}
    flat = [w for pair in ws.values() for w in pair]
    start_all(*flat)
    yield ws
    for w in flat:
        w.stop()


def _prompts():
    rng = random.Random(99)
    return [[256] + [rng.randrange(256) for _ in range(n - 1)] for n in (1, 15, 16, 17, 33, 64, 100, 257)]


def _body(ids):
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}


@pytest.mark.parametrize("pair,via_backend", [("sglang", True), ("mixed", False)])
def test_bootstrap_over_backend(mc_workers, colocated, pair, via_backend):
    p, d = mc_workers[pair]
    ps = _prompts()

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            ref = [(await c.post(colocated.url + "/generate", json=_body(ids))).json() for ids in ps]
            rng = random.Random(3)
            got = [await router.bootstrap(c, p, d, "/generate", _body(ids), rng) for ids in ps]
            return ref, got

    before = loads(d)["disaggregation"]
    ref, got = asyncio.run(run())
    page_bytes = before["kv_page_bytes"]
    for ids, want, (rp, rd) in zip(ps, ref, got):
        assert rp.status_code == rd.status_code == 200, (rp.text, rd.text)
        assert rd.json()["output_ids"] == want["output_ids"]
        assert rd.json()["meta_info"]["cached_tokens"] == len(ids)
    after = loads(d)["disaggregation"]
    expected = sum(-(-len(ids) // 16) for ids in ps) * page_bytes
    assert after["kv_bytes_received"] - before["kv_bytes_received"] == expected
    moved = after["kv_bytes_via_backend"] - before["kv_bytes_via_backend"]
    assert moved == (expected if via_backend else 0)
    assert_clean(p, d)


def test_nixl_pull_over_backend(mc_workers, colocated):
    p, d = mc_workers["nixl"]
    ps = _prompts()

    async def run():
        async with httpx.AsyncClient(timeout=60) as c:
            out = []
            for ids in ps:
                b = {"prompt": ids, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0}
                ref = (await c.post(colocated.url + "/v1/completions", json=b)).json()
                out.append((ref, await router.nixl(c, p, d, "/v1/completions", b)))
            return out

    before = loads(d)["disaggregation"]["kv_bytes_via_backend"]
    for ref, (rp, rd) in asyncio.run(run()):
        assert rd.status_code == 200, rd.text
        assert rd.json()["choices"][0]["logprobs"]["tokens"] == ref["choices"][0]["logprobs"]["tokens"]
    assert loads(d)["disaggregation"]["kv_bytes_via_backend"] > before
    assert_clean(p, d)


_DELAY_PROBE = """
import json, os, sys
from pdgate.engine.transfer import nixl_dp
nixl_agent, _ = nixl_dp._import_nixl()
bindings = sys.modules[nixl_agent.__module__].nixlBind
native, seen = bindings.nixlAgent, []
def recorder(name, config):
    seen.append([config.useProgThread, config.pthrDelay])
    return native(name, config)
bindings.nixlAgent = recorder
nixl_dp.make_agent("pdgate-test-delay", progress_thread=True)
print(json.dumps({"seen": seen, "delay": nixl_dp.PROGRESS_DELAY_US, "restored": bindings.nixlAgent is recorder}))
sys.stdout.flush()
os._exit(0)  # a NIXL agent with a progress thread crashes the interpreter's shutdown (nixl-cu12 1.5.1)
"""


@pytest.mark.skipif(not _installed("nixl"), reason="needs nixl-cu12")
def test_nixl_sink_progress_thread_polls_instead_of_spinning():
    """The wrapper builds every agent with pthrDelay = 0 (a busy loop: a whole core per idle
    decode engine); make_agent must hand the native constructor our delay, then put it back.
    In a child process: the agent must not live in the test runner (see _DELAY_PROBE)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _DELAY_PROBE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["delay"] > 0 and got["seen"] == [[True, got["delay"]]] and got["restored"]


@pytest.mark.skipif(not _installed("nixl"), reason="needs nixl-cu12")
def test_nixl_engine_stops_cleanly():
    """SIGTERM (what Kubernetes sends) ends a NIXL engine with exit code 0, not the SIGSEGV
    nixl-cu12 causes in the interpreter's teardown; a supervisor must not see a crash."""
    w = ReferenceWorker("decode", kv_connector="NixlConnector", transfer_backend="nixl")
    start_all(w)
    proc = w.proc
    w.stop()
    assert proc.returncode == 0
