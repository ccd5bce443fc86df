"""The prefix cache in real worker processes: hits reported as cached tokens, output unchanged
with the cache on or off, eviction under memory pressure, pages a transfer holds never evicted,
and every page back to idle (free or cached) after requests and aborts."""

from __future__ import annotations

import random
import uuid

import httpx
import pytest

import engine_router as router
from conftest import assert_clean, loads, start_all, wait_until
from pdgate.workers import ReferenceWorker

pytestmark = pytest.mark.timeout(120)
PAGE = 16


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [256] + [rng.randrange(256) for _ in range(n - 1)]


def generate(w: ReferenceWorker, prompt: list[int], max_new: int = 4, **extra) -> dict:
    r = httpx.post(w.url + "/generate", json={"input_ids": prompt, "sampling_params": {
        "max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def cache_stats(w: ReferenceWorker) -> dict:
    return loads(w)["prefix_cache"]


@pytest.fixture(scope="module")
def pair_on_off():
    on = ReferenceWorker(mode="null")
    off = ReferenceWorker(mode="null", extra_args=["--disable-radix-cache"])
    start_all(on, off)
    try:
        yield on, off
    finally:
        on.stop()
        off.stop()


def test_hits_are_reported_as_cached_tokens_and_change_no_token(pair_on_off):
    on, off = pair_on_off
    base = ids(40, 1)
    first = generate(on, base)
    assert first["meta_info"]["cached_tokens"] == 0
    # a follow-up turn: the first two full pages (32 tokens) are reused
    turn = base + first["output_ids"] + ids(30, 2)[1:]
    got = generate(on, turn, max_new=8)
    assert got["meta_info"]["cached_tokens"] == 32
    assert got["output_ids"] == generate(off, turn, max_new=8)["output_ids"]
    # OpenAI usage carries the same number; 48 tokens can reuse one page only (the last token
    # is always computed); a prompt sharing nothing reuses nothing
    r = httpx.post(on.url + "/v1/completions", json={"prompt": base[:33], "max_tokens": 2, "temperature": 0},
                   timeout=60).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert generate(on, base[:32])["meta_info"]["cached_tokens"] == 16
    assert generate(on, ids(40, 3))["meta_info"]["cached_tokens"] == 0
    # the worker without a cache never reports a hit
    assert generate(off, turn)["meta_info"]["cached_tokens"] == 0
    assert cache_stats(off) == {"enabled": False, "kv_events": {"enabled": False}}
    st = cache_stats(on)
    assert st["enabled"] and st["hit_tokens"] >= 32 + 32 + 16 and st["cached_pages"] > 0
    # input logprobs need every position's logits: such a request skips the lookup
    lp = generate(on, turn, max_new=2, return_logprob=True)
    assert lp["meta_info"]["cached_tokens"] == 0 and len(lp["meta_info"]["input_token_logprobs"]) == len(turn)
    assert_clean(on, off)


def test_many_requests_sharing_prefixes_equal_the_uncached_worker(pair_on_off):
    on, off = pair_on_off
    system = ids(70, 10)
    prompts = [system + ids(5 + 7 * i, 100 + i)[1:] for i in range(12)]

    def run(w):
        with httpx.Client(timeout=60) as c:
            return [c.post(w.url + "/generate", json={"input_ids": p, "sampling_params": {
                "max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}).json() for p in prompts]

    got, want = run(on), run(off)
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert all(g["meta_info"]["cached_tokens"] == 64 for g in got[1:])  # 70 shared tokens: 4 pages
    assert_clean(on, off)


def test_an_abort_frees_its_pages_and_keeps_the_shared_prefix_cached(pair_on_off):
    on, _ = pair_on_off
    base = ids(50, 20)
    generate(on, base, max_new=1)
    rid = f"long-{uuid.uuid4().hex}"
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", on.url + "/generate", json={
                "input_ids": base + [5, 6, 7], "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}}) as r:
            lines = r.iter_lines()  # kept open: leaving the iterator would disconnect
            while not next(lines).startswith("data: {"):
                pass  # the first token is out: decoding, holding the shared pages and its own
            assert loads(on)["kv_pages"]["in_use"] > 3
            assert httpx.post(on.url + "/abort_request", json={"rid": rid}, timeout=10).json()["count"] == 1
    assert_clean(on)
    assert generate(on, base + [9])["meta_info"]["cached_tokens"] == 48


@pytest.fixture
def small_nixl_pair():
    """A NIXL-style pair whose prefill has 16 pages of 16 tokens, so a few requests fill it."""
    p = ReferenceWorker(mode="prefill", kv_connector="NixlConnector", extra_args=["--max-total-tokens", "256"])
    d = ReferenceWorker(mode="decode", kv_connector="NixlConnector")
    start_all(p, d)
    try:
        yield p, d
    finally:
        p.stop()
        d.stop()


def test_eviction_under_pressure_never_takes_pages_a_transfer_holds(small_nixl_pair, pair_on_off):
    p, d = small_nixl_pair
    on, _ = pair_on_off
    held = ids(70, 30)  # 5 pages, pinned on the prefill until the decode pulls them
    body = {"prompt": held, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    hdr = {"X-Request-Id": uuid.uuid4().hex}
    rp = httpx.post(p.url + "/v1/completions", json=router._prefill_leg(body, dict(router.NIXL_PREFILL_PARAMS)),
                    headers=hdr, timeout=60)
    assert rp.status_code == 200, rp.text
    params = rp.json()["kv_transfer_params"]
    assert loads(p)["kv_pages"]["pinned"] == 5
    # while the hold is there the cache cannot be flushed (the engines refuse as well)
    r = httpx.post(p.url + "/flush_cache", timeout=10)
    assert r.status_code == 400 and r.json()["error"]["code"] == "cache_busy"
    # pressure: 11 pages left, each of these needs 7, so earlier ones' cached pages are evicted
    for i in range(4):
        out = generate(p, ids(100, 40 + i), max_new=1)
        assert out["meta_info"]["cached_tokens"] == 0
        assert loads(p)["kv_pages"]["pinned"] == 5
    assert cache_stats(p)["evicted_pages"] > 0
    # the held pages were neither evicted nor rewritten: the decode's output is the colocated one
    rd = httpx.post(d.url + "/v1/completions", json=dict(body, kv_transfer_params=params, return_token_ids=True), headers=hdr, timeout=60)
    assert rd.status_code == 200, rd.text
    want = httpx.post(on.url + "/v1/completions", json=dict(body, return_token_ids=True), timeout=60).json()
    # Compared by ids: random byte ids can end inside a character, after which the vLLM-flavour
    # decode sends the prompt's text again as vLLM does (docs/engine.md), the colocated one not.
    assert rd.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert rd.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(held) - 1
    assert_clean(p, d)
    # after the pull the held prompt's full pages are cached on the prefill
    assert generate(p, held + [1], max_new=1)["meta_info"]["cached_tokens"] == 64
    assert httpx.post(p.url + "/flush_cache", timeout=10).status_code == 200
    assert loads(p)["kv_pages"]["cached"] == 0 and cache_stats(p)["cached_pages"] == 0
    wait_until(lambda: loads(p)["kv_pages"]["free"] == loads(p)["kv_pages"]["total"], 5, "the flush")


def _series(w: ReferenceWorker, name: str) -> float:
    for line in httpx.get(w.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rpartition(" ")[2])
    raise AssertionError(f"{name} not in {w.url}/metrics")


def test_prefix_cache_lookups_are_exported_in_the_engines_names(pair_on_off):
    """vLLM's `vllm:prefix_cache_queries` / `vllm:prefix_cache_hits` (prompt tokens looked up /
    found), SGLang's `sglang:cache_hit_rate`: what an operator reads to see what cache-aware
    routing buys on the prefill side."""
    on, _ = pair_on_off
    vllm = ReferenceWorker(mode="null", extra_args=["--api-flavor", "vllm"])
    with vllm:
        prompt = ids(3 * PAGE + 5, seed=41)
        before = (_series(vllm, "vllm:prefix_cache_queries_total"), _series(vllm, "vllm:prefix_cache_hits_total"))
        first, second = generate(vllm, prompt), generate(vllm, prompt)
        after = (_series(vllm, "vllm:prefix_cache_queries_total"), _series(vllm, "vllm:prefix_cache_hits_total"))
        assert after[0] - before[0] == 2 * len(prompt)
        assert after[1] - before[1] == second["meta_info"]["cached_tokens"] == 3 * PAGE
        assert first["meta_info"]["cached_tokens"] == 0
    prompt = ids(2 * PAGE + 3, seed=42)
    generate(on, prompt)
    generate(on, prompt)
    assert 0 < _series(on, "sglang:cache_hit_rate") < 1
