"""What pdgate reads from vLLM, checked against vLLM itself: the /metrics series its load
polling and pairing parse, the prefix-cache counters, what the gateway learned from them, and
vLLM's own state after an abort (a client that goes away mid-stream)."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.real_vllm.conftest import DEADLINE_S, MODEL, metric, wait_until

pytestmark = pytest.mark.timeout(600)

# The series pdgate-protocol's engine_load.rs reads from a vLLM /metrics page.
READ_BY_PDGATE = ["vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                  "vllm:cache_config_info", "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_xfer_time_seconds_sum",
                  "vllm:nixl_bytes_transferred_sum"]
# The prefix-cache counters an operator reads to see what cache-aware routing buys.
PREFIX_CACHE = ["vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"]


def test_the_series_pdgate_reads_exist_on_real_vllm(fleet):
    # One PD request first: the NIXL histograms appear once a transfer happened.
    httpx.post(fleet.url + "/v1/completions", timeout=DEADLINE_S,
               json={"model": MODEL, "prompt": "series", "max_tokens": 2, "temperature": 0}).raise_for_status()
    decode_names = {k.partition("{")[0] for d in fleet.decodes for k in d.metrics()}
    missing = [n for n in READ_BY_PDGATE + PREFIX_CACHE if n not in decode_names]
    assert not missing, f"real vLLM has no {missing}"
    info = [k for k in fleet.decodes[0].metrics() if k.startswith("vllm:cache_config_info{")]
    assert info and 'block_size="' in info[0] and 'num_gpu_blocks="' in info[0] and 'cache_dtype="' in info[0]


def test_the_gateway_learned_models_load_and_pairing_from_vllm(fleet):
    def rows_now() -> list[dict]:
        return httpx.get(fleet.url + "/workers", timeout=10).json()["workers"]

    # Load comes from the gateway's periodic poll of each worker's /metrics: the first round may
    # not have reached every worker yet when this test runs first (alone, or with -k).
    wait_until(lambda: all(isinstance(r["load"], (int, float)) for r in rows_now()), 30, "a load for every worker")
    rows = rows_now()
    assert len(rows) == len(fleet.all())
    for row in rows:
        assert row["models"] == [MODEL], row
        assert row["healthy"] and isinstance(row["load"], (int, float)), row
        block = metric(fleet.by_url(row["url"]), "vllm:cache_config_info")
        assert block == 1.0  # an info series: value 1, the facts in its labels
        assert "page_size" in str(row["pd_pairing"]), row


def _idle(worker) -> bool:
    return (metric(worker, "vllm:num_requests_running") == 0 and metric(worker, "vllm:num_requests_waiting") == 0
            and metric(worker, "vllm:kv_cache_usage_perc") < 0.01)


def test_a_client_that_disconnects_mid_stream_leaves_vllm_idle(fleet):
    wait_until(lambda: all(_idle(w) for w in fleet.all()), 30, "fleet idle before the test")
    generated_before = {w.url: metric(w, "vllm:generation_tokens_total") for w in fleet.decodes}
    body = {"model": MODEL, "prompt": "a long answer nobody reads to the end", "max_tokens": 1500,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=DEADLINE_S) as client, client.stream("POST", fleet.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        decode = fleet.by_url(r.headers["x-pdgate-route"].split("decode=")[1].split(";")[0])
        # Held in a name: a `for ... break` over r.iter_lines() drops the generator, and closing it
        # closes httpx's connection, so the client would leave here rather than at the `with`'s end.
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert metric(decode, "vllm:num_requests_running") == 1, "the decode is serving the stream"
    closed = time.monotonic()
    # The gateway closed its stream to the decode (vLLM's abort for HTTP): vLLM frees the request.
    wait_until(lambda: all(_idle(w) for w in fleet.all()), 15, "vLLM idle again after the client left")
    assert time.monotonic() - closed < 15
    # The decode stopped generating: far fewer than max_tokens, and no more after it went idle.
    generated = metric(decode, "vllm:generation_tokens_total") - generated_before[decode.url]
    assert 0 < generated < 1500, generated
    time.sleep(2)
    assert metric(decode, "vllm:generation_tokens_total") - generated_before[decode.url] == generated

def test_vllm_sends_the_prompt_again_after_prompt_ids_that_end_inside_a_character(fleet):
    """The fact pdgate's resume is built around (pdgate-protocol resume.rs, `continuation`): vLLM
    primes its detokenizer with the prompt's ids, and when their text ends in U+FFFD the first
    text it sends is the whole prompt's. So a continuation never ends inside a character.
    tiny64's tokenizer is byte-level: ids 0-255 are the bytes, 256 is BOS."""
    words = "A prompt that ends inside é".encode()
    held, clean = [256] + list(words[:-1]), [256] + list(words)

    def text(prompt: list[int]) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        return httpx.post(fleet.colocated.url + "/v1/completions", json=body, timeout=DEADLINE_S).json()["choices"][0]["text"]

    assert text(held).startswith("A prompt that ends inside "), "vLLM no longer repeats such a prompt: resume.rs can continue from every id"
    assert not text(clean).startswith("A prompt"), "a prompt that ends whole is not repeated"
