"""The HTTP surface of a worker: SGLang native, OpenAI, info, loads, metrics, errors; and the
PD variants a router uses (batches with room lists, streaming legs, logprob stitching)."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
from openai import OpenAI

import engine_router as router
from conftest import assert_clean
from pdgate.workers import ReferenceWorker

pytestmark = pytest.mark.timeout(60)
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def sse_events(r: httpx.Response) -> list:
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: "):
            data = line[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_generate_single_batch_and_logprobs(colocated):
    u = colocated.url
    one = httpx.post(u + "/generate", json={"text": "hello", "sampling_params": GREEDY,
                                            "return_logprob": True, "top_logprobs_num": 2}).json()
    m = one["meta_info"]
    assert len(one["output_ids"]) == 8 and m["completion_tokens"] == 8
    assert m["prompt_tokens"] == 6 and m["cached_tokens"] == 0
    assert m["finish_reason"] == {"type": "length", "length": 8}
    assert len(m["input_token_logprobs"]) == 6 and m["input_token_logprobs"][0][0] is None
    assert [x[1] for x in m["output_token_logprobs"]] == one["output_ids"]
    assert len(m["output_top_logprobs"][0]) == 2
    batch = httpx.post(u + "/generate", json={"text": ["hello", "a"], "sampling_params": GREEDY}).json()
    assert isinstance(batch, list) and batch[0]["output_ids"] == one["output_ids"]
    ids = httpx.post(u + "/generate", json={"input_ids": [256] + list(b"hello"), "sampling_params": GREEDY}).json()
    assert ids["output_ids"] == one["output_ids"]


def test_generate_stream_and_stop_strings(colocated):
    r = httpx.post(colocated.url + "/generate", json={"text": "hi", "sampling_params": GREEDY, "stream": True})
    ev = sse_events(r)
    assert ev[-1] == "[DONE]" and len(ev) >= 3
    final = ev[-2]
    full = httpx.post(colocated.url + "/generate", json={"text": "hi", "sampling_params": GREEDY}).json()
    assert final["output_ids"] == full["output_ids"] and final["text"] == full["text"]
    stop_tok = full["output_ids"][3]
    stopped = httpx.post(colocated.url + "/generate", json={
        "text": "hi", "sampling_params": dict(GREEDY, stop_token_ids=[stop_tok])}).json()
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert stopped["output_ids"] == full["output_ids"][:full["output_ids"].index(stop_tok) + 1]


def test_seeded_sampling_is_reproducible(colocated):
    b = {"text": "x", "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "seed": 9, "ignore_eos": True}}
    a1 = httpx.post(colocated.url + "/generate", json=b).json()["output_ids"]
    assert a1 == httpx.post(colocated.url + "/generate", json=b).json()["output_ids"]


def test_openai_client_completions_and_chat(colocated):
    client = OpenAI(base_url=colocated.url + "/v1", api_key="none", max_retries=0)
    c = client.completions.create(model="tiny", prompt=["hi", "yo"], max_tokens=5, temperature=0, n=2)
    assert len(c.choices) == 4 and c.usage.completion_tokens == 20
    assert c.usage.prompt_tokens == 6 and c.usage.prompt_tokens_details.cached_tokens == 0
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
    assert len(chat.choices[0].logprobs.content) == 4
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []
    assert [m.owned_by for m in client.models.list().data] == ["sglang"]


@pytest.mark.parametrize("path,bad", [
    ("/generate", {}), ("/generate", {"text": 3}), ("/generate", {"input_ids": [1, "a"]}),
    ("/generate", {"text": "x", "sampling_params": {"temperature": -1}}),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": "many"}}),
    ("/generate", {"input_ids": [999999]}), ("/generate", {"input_ids": [256] * 5000}),
    ("/generate", {"text": "x", "bootstrap_room": "r", "bootstrap_host": "h"}),
    ("/v1/completions", {"prompt": None}), ("/v1/completions", {"prompt": "x", "n": 0}),
    ("/v1/completions", {"prompt": "x", "top_p": 0}), ("/v1/completions", {"prompt": "x", "max_tokens": -2}),
    ("/v1/chat/completions", {"messages": "hi"}), ("/v1/chat/completions", {"messages": []}),
    ("/generate", {"text": "x", "sampling_params": "hot"}), ("/generate", {"text": "x", "top_logprobs_num": -1}),
    ("/generate", {"text": "x", "sampling_params": {"seed": "a"}}),
    ("/generate", {"text": "x", "sampling_params": {"stop": 5}}),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}), ("/v1/completions", {"prompt": "x", "logprobs": 99}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": "a"}),
    ("/v1/completions", {"prompt": "x", "kv_transfer_params": [1]}),
    ("/generate", {"text": ["a", "b"], "bootstrap_room": [1], "bootstrap_host": "h"}),
])
def test_bad_input_is_a_400_json_error(colocated, path, bad):
    r = httpx.post(colocated.url + path, json=bad)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "code", "param"} and err["type"] == "invalid_request_error"


def test_not_json_and_unknown_path(colocated):
    r = httpx.post(colocated.url + "/generate", content=b"{nope")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert httpx.get(colocated.url + "/nope").json()["error"]["code"] == 404


def test_info_loads_metrics_health(workers):
    p, _ = workers["sglang"]
    info = httpx.get(p.url + "/server_info").json()
    assert info["disaggregation_mode"] == "prefill"
    assert info["disaggregation_bootstrap_port"] == p.bootstrap_port
    assert info["disaggregation_transfer_backend"] == "tcp" and info["model_path"] == "tiny"
    assert httpx.get(p.url + "/get_server_info").json()["page_size"] == 16
    assert httpx.get(p.url + "/model_info").json()["is_generation"] is True
    ld = httpx.get(p.url + "/v1/loads").json()["loads"][0]
    for k in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens", "max_total_num_tokens", "token_usage"):
        assert k in ld
    assert set(ld["kv_pages"]) >= {"free", "reserved", "in_use", "pinned", "total"}
    assert httpx.get(workers["null"].url + "/health_generate").status_code == 200
    assert httpx.get(f"http://127.0.0.1:{p.bootstrap_port}/health").status_code == 200
    route = httpx.get(f"http://127.0.0.1:{p.bootstrap_port}/route", params={"engine_rank": -1}).json()
    assert route["prefill_dp_size"] == 1
    m = httpx.get(workers["null"].url + "/metrics").text
    assert 'pdgate_engine_kv_pages{state="free"}' in m and "pdgate_engine_generation_tokens_total" in m
    nixl_p, _ = workers["nixl"]
    assert httpx.get(nixl_p.url + "/server_info").json()["kv_transfer_config"]["kv_connector"] == "NixlConnector"


def test_load_reports_in_each_flavor(workers):
    """The load a gateway scrapes: SGLang's `/v1/loads` token fields, and the gauges in SGLang's
    names (no --kv-transfer-config) or vLLM's (with it), as those engines spell them."""
    p, _ = workers["sglang"]
    ld = httpx.get(p.url + "/v1/loads").json()["loads"][0]
    assert ld["num_waiting_uncached_tokens"] == 0 and ld["num_total_tokens"] == ld["num_used_tokens"]
    m = httpx.get(p.url + "/metrics").text
    assert 'sglang:cache_config_info{num_pages="4096",page_size="16"} 1.0' in m, m
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:max_total_num_tokens"):
        assert f'{name}{{model_name="tiny"}}' in m, name
    # KV transfers received, as SGLang's histograms (count and sum; the gateway's transfer fit).
    for name in ("sglang:kv_transfer_latency_ms_count", "sglang:kv_transfer_latency_ms_sum", "sglang:kv_transfer_total_mb_sum"):
        assert f'{name}{{model_name="tiny"}}' in m, name
    assert set(ld["disaggregation"]["kv_transfer_totals"]) == {"count", "bytes", "seconds"}
    assert "vllm:" not in m
    nixl_p, _ = workers["nixl"]
    m = httpx.get(nixl_p.url + "/metrics").text
    assert 'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="4096"} 1.0' in m, m
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:nixl_xfer_time_seconds_count", "vllm:nixl_xfer_time_seconds_sum", "vllm:nixl_bytes_transferred_sum"):
        assert f'{name}{{engine="0",model_name="tiny"}}' in m, name
    assert "sglang:" not in m


def test_bootstrap_batch_stream_chat_and_logprob_stitching(workers):
    """Room lists for a batch, a scalar room (R+i), streaming legs, chat, logprobs P + D."""
    p, d = workers["sglang"]
    u = workers["null"].url
    texts = ["first prompt that is long enough to span pages", "second"]
    body = {"text": texts, "sampling_params": GREEDY, "return_logprob": True}
    ref = httpx.post(u + "/generate", json=body).json()

    async def run():
        async with httpx.AsyncClient(timeout=30) as c:
            out = []
            for room in ([101, 202], 303):
                b = router.bootstrap_body(body, p, room)
                out.append(await asyncio.gather(c.post(p.url + "/generate", json=b), c.post(d.url + "/generate", json=b)))
            sb = router.bootstrap_body({"text": texts[0], "sampling_params": GREEDY, "stream": True}, p, 404)
            out.append(await asyncio.gather(c.post(p.url + "/generate", json=sb), c.post(d.url + "/generate", json=sb)))
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            out.append(await router.bootstrap(c, p, d, "/v1/chat/completions", chat, random.Random(1)))
            refchat = await c.post(u + "/v1/chat/completions", json=dict(chat, stream=False))
            return out, refchat.json()

    (batch1, batch2, stream, chat), refchat = asyncio.run(run())
    for rp, rd in (batch1, batch2):
        pre, dec = rp.json(), rd.json()
        for i in range(2):
            assert dec[i]["output_ids"] == ref[i]["output_ids"]
            stitched = pre[i]["meta_info"]["input_token_logprobs"] + dec[i]["meta_info"]["input_token_logprobs"]
            assert [x[1] for x in stitched] == [x[1] for x in ref[i]["meta_info"]["input_token_logprobs"]]
            assert dec[i]["meta_info"]["output_token_logprobs"][0][0] == pytest.approx(
                ref[i]["meta_info"]["output_token_logprobs"][0][0], abs=1e-4)
    ev_p, ev_d = sse_events(stream[0]), sse_events(stream[1])
    assert ev_p[-1] == ev_d[-1] == "[DONE]"
    assert ev_p[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert ev_d[-2]["output_ids"] == ref[0]["output_ids"]
    ev = sse_events(chat[1])
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in ev[:-1] if e["choices"])
    assert text == refchat["choices"][0]["message"]["content"]
    assert ev[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == ev[-2]["usage"]["prompt_tokens"]
    assert_clean(p, d)


def test_abort_request(colocated):
    async def run():
        async with httpx.AsyncClient(timeout=30) as c:
            t = asyncio.ensure_future(c.post(colocated.url + "/generate", json={
                "text": "x", "rid": "to-abort", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}))
            for _ in range(200):
                await asyncio.sleep(0.02)
                if (await c.post(colocated.url + "/abort_request", json={"rid": "to-abort"})).json()["aborted"]:
                    break
            return await t
    r = asyncio.run(run())
    assert r.status_code == 499 and r.json()["error"]["code"] == "aborted"
    assert_clean(colocated)


def test_out_of_kv_memory_is_rejected_or_queued():
    """A request larger than the whole pool is a 400; requests that fit only one at a time queue."""
    with ReferenceWorker(mode="null", extra_args=["--max-total-tokens", "256", "--page-size", "16"]) as w:
        big = httpx.post(w.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 1000}})
        assert big.status_code == 400 and big.json()["error"]["code"] == "context_length_exceeded"

        async def run():
            b = {"input_ids": [256] * 100, "sampling_params": dict(GREEDY, max_new_tokens=60)}  # 11 of 16 pages
            async with httpx.AsyncClient(timeout=30) as c:
                return await asyncio.gather(*(c.post(w.url + "/generate", json=b) for _ in range(3)))
        rs = asyncio.run(run())
        assert [r.status_code for r in rs] == [200] * 3
        assert len({tuple(r.json()["output_ids"]) for r in rs}) == 1
        assert_clean(w)


def test_stream_client_disconnect_aborts(colocated):
    b = {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with httpx.stream("POST", colocated.url + "/generate", json=b, timeout=30) as r:
        lines = r.iter_lines()
        first = [next(lines) for _ in range(3)]
    assert any(x.startswith("data: ") for x in first)
    assert_clean(colocated)
