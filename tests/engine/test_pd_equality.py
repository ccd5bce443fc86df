"""The central invariant: greedy output through every PD protocol equals the colocated output
token for token, the decode reports the prompt as cached, and the transfer counters show exactly
the expected KV bytes. A path that silently recomputed the prompt fails all three checks.

Each protocol runs with the prefix cache on and off (`--disable-radix-cache`). The second half
of the prompts extends the first half's, and runs after it, so with the cache on the prefill
and colocated workers reuse cached pages (the prefill reports exactly how many) while the
output stays the same token for token."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

import engine_router as router
from conftest import _pair, assert_clean, loads, start_all
from pdgate.workers import ReferenceWorker

PAGE = 16
N_PROMPTS = 50


ROUND = N_PROMPTS // 2


def prompts() -> list[list[int]]:
    """50 prompts: lengths around page boundaries, below one page, and several pages long. Prompt
    i of the second half starts with part of prompt i - 25 (a shared prefix)."""
    rng = random.Random(1234)
    lengths = [1, 2, 5, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 65, 100, 127, 128, 129, 200, 257]
    while len(lengths) < N_PROMPTS:
        lengths.append(rng.randint(3, 300))
    out = [[256] + [rng.randrange(256) for _ in range(n - 1)] for n in lengths]
    for i in range(ROUND, N_PROMPTS):
        base, n = out[i - ROUND], len(out[i])
        k = min(len(base), n) * 3 // 4
        out[i] = base[:k] + out[i][k:]
    return out


def expected_prefill_hit(i: int, ps: list[list[int]], cache: str) -> int:
    """Tokens the prefill reuses for prompt i: the full pages it shares with the first-half
    prompt it extends, up to its last token (always computed)."""
    if cache == "off" or i < ROUND:
        return 0
    a, b = ps[i], ps[i - ROUND]
    lcp = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return min(lcp, len(a) - 1) // PAGE * PAGE


@pytest.fixture(scope="session")
def workers_nocache():
    """The `workers` layout with the prefix cache off (no chunked worker)."""
    extra = ["--disable-radix-cache"]
    n = ReferenceWorker(mode="null", extra_args=extra)
    sp, sd = _pair(extra)
    np_, nd = _pair(extra, kv_connector="NixlConnector")
    mp, md = _pair(extra, kv_connector="MooncakeConnector")
    ws = start_all(n, sp, sd, np_, nd, mp, md)
    try:
        yield {"null": n, "sglang": (sp, sd), "nixl": (np_, nd), "mooncake": (mp, md)}
    finally:
        for w in ws:
            w.stop()


@pytest.fixture(params=["on", "off"], ids=["cache_on", "cache_off"])
def pd_workers(request):
    return request.param, request.getfixturevalue("workers" if request.param == "on" else "workers_nocache")


def max_new(i: int) -> int:
    return 4 + i % 7


def pages(n: int) -> int:
    return -(-n // PAGE)


async def _bounded(coros, limit: int = 8):
    sem = asyncio.Semaphore(limit)

    async def one(c):
        async with sem:
            return await c
    return await asyncio.gather(*(one(c) for c in coros))


async def _rounds(make):
    """`make(i, ids)` for every prompt: the first half, then the second (which reuses it)."""
    ps = prompts()
    first = await _bounded([make(i, ids) for i, ids in enumerate(ps[:ROUND])])
    return first + await _bounded([make(i, ids) for i, ids in enumerate(ps) if i >= ROUND])


def _gen_body(ids: list[int], i: int) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new(i), "temperature": 0,
                                                  "ignore_eos": True}}


def _cmpl_body(ids: list[int], i: int) -> dict:
    return {"model": "tiny", "prompt": ids, "max_tokens": max_new(i), "temperature": 0,
            "ignore_eos": True, "logprobs": 0}


def _tokens(choice: dict) -> list[str]:
    return choice["logprobs"]["tokens"]


async def _colocated(c, url, path, make):
    resps = await _rounds(lambda i, ids: c.post(url + path, json=make(ids, i)))
    assert all(r.status_code == 200 for r in resps), [r.text for r in resps if r.status_code != 200]
    return [r.json() for r in resps]


def _counters(p, d) -> tuple[int, int, int]:
    lp, ld = loads(p)["disaggregation"], loads(d)["disaggregation"]
    return lp["kv_bytes_sent"], ld["kv_bytes_received"], lp["kv_page_bytes"]


@pytest.mark.timeout(180)
def test_bootstrap_equals_colocated(pd_workers):
    cache, workers = pd_workers
    p, d = workers["sglang"]
    ps = prompts()

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            ref = await _colocated(c, workers["null"].url, "/generate", _gen_body)
            rng = random.Random(7)
            pairs = await _rounds(lambda i, ids: router.bootstrap(c, p, d, "/generate", _gen_body(ids, i), rng))
            return ref, pairs

    sent0, recv0, page_bytes = _counters(p, d)
    totals0 = loads(d)["disaggregation"]["kv_transfer_totals"]
    ref, pairs = asyncio.run(run())
    for i, (ids, want, (rp, rd)) in enumerate(zip(ps, ref, pairs)):
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        pre, dec = rp.json(), rd.json()
        assert pre["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        assert pre["output_ids"] == want["output_ids"][:1]
        assert pre["meta_info"]["cached_tokens"] == expected_prefill_hit(i, ps, cache), f"prompt {i}"
        assert dec["output_ids"] == want["output_ids"], f"prompt {i} (len {len(ids)}) diverged"
        assert dec["meta_info"]["cached_tokens"] == len(ids) == dec["meta_info"]["prompt_tokens"]
        assert dec["meta_info"]["kv_bytes_received"] == pages(len(ids)) * page_bytes
    sent1, recv1, _ = _counters(p, d)
    expected = sum(pages(len(ids)) for ids in ps) * page_bytes
    assert sent1 - sent0 == expected and recv1 - recv0 == expected
    # The cumulative transfer totals the gateway's transfer fit reads: one per request.
    totals1 = loads(d)["disaggregation"]["kv_transfer_totals"]
    assert totals1["count"] - totals0["count"] == len(ps)
    assert totals1["bytes"] - totals0["bytes"] == expected and totals1["seconds"] >= totals0["seconds"]
    assert_clean(p, d)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("protocol", ["nixl", "mooncake"])
def test_vllm_protocols_equal_colocated(pd_workers, protocol):
    cache, workers = pd_workers
    p, d = workers[protocol]
    leg = getattr(router, protocol)
    ps = prompts()

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            ref = await _colocated(c, workers["null"].url, "/v1/completions", _cmpl_body)
            pairs = await _rounds(lambda i, ids: leg(c, p, d, "/v1/completions", _cmpl_body(ids, i)))
            return ref, pairs

    sent0, recv0, page_bytes = _counters(p, d)
    ref, pairs = asyncio.run(run())
    for i, (ids, want, (rp, rd)) in enumerate(zip(ps, ref, pairs)):
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        got = rd.json()
        assert rp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == expected_prefill_hit(i, ps, cache)
        assert _tokens(got["choices"][0]) == _tokens(want["choices"][0]), f"prompt {i} diverged"
        assert got["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            want["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4)
        # vLLM counts the prompt minus the last token as cached: the decode recomputes that one
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1
        assert got["usage"]["prompt_tokens"] == len(ids)
    sent1, recv1, _ = _counters(p, d)
    expected = sum(pages(len(ids)) for ids in ps) * page_bytes
    assert sent1 - sent0 == expected and recv1 - recv0 == expected
    assert loads(d)["disaggregation"]["local_recompute"] == 0
    assert_clean(p, d)


@pytest.mark.timeout(120)
def test_chunked_prefill_equals_whole_prefill(workers):
    """Colocated with --chunked-prefill-size 24: long prompts run in chunks interleaved with
    other requests' decodes, and the output is unchanged."""
    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            return (await _colocated(c, workers["null"].url, "/generate", _gen_body),
                    await _colocated(c, workers["chunked"].url, "/generate", _gen_body))

    whole, chunked = asyncio.run(run())
    assert [r["output_ids"] for r in chunked] == [r["output_ids"] for r in whole]
    assert_clean(workers["chunked"])
