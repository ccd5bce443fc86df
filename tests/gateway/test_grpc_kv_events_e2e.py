"""cache_aware on KV events from gRPC workers: the gateway subscribes to each gRPC worker's
`SubscribeKvEvents` by itself (no `kv_events` registration), feeds the same index as the ZMQ
events, and routes conversations to the worker that holds their prefix.

Two gRPC reference engines (one SGLang service, one vLLM service: both serve the stream) behind
pdgate, a small seeded multi-turn workload (the one of test_cache_source_e2e.py), the hit rate
from the engines' own `cached_tokens`. `--seed` fixes the gateway's tie-breaks."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from pdgate.workers import ReferenceWorker
from tests.gateway.harness import launch
from tests.gateway.prefix_routing import _metric, conversations, export_tokenizer, run

pytest.importorskip("zmq")
pytest.importorskip("smg_grpc_proto")
pytestmark = pytest.mark.timeout(300)

# 40 pages of 16 tokens: a worker holds two or three conversations, so the caches evict.
CACHE_TOKENS = 640
WORKLOAD = {"n_conversations": 12, "turns": 4, "groups": 2, "live": 4}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def grpc_engines() -> Iterator[list[ReferenceWorker]]:
    # the ZMQ side binds a random port nobody reads: the gateway takes the gRPC stream
    cfg = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"})
    workers = [ReferenceWorker(mode="null", grpc_service=service, extra_args=["--max-total-tokens", str(CACHE_TOKENS), "--kv-events-config", cfg])
               for service in ("sglang", "vllm")]
    try:
        for w in workers:
            w.start(90)
        yield workers
    finally:
        for w in workers:
            w.stop()


def reset_caches(workers: list[ReferenceWorker]) -> None:
    for w in workers:
        assert httpx.post(w.url + "/reset_prefix_cache", timeout=10).status_code == 200


def wait_streams(gw, n: int) -> str:
    """Until the gateway's gRPC streams to all `n` workers are open; returns /metrics."""
    deadline = time.monotonic() + 30
    text = ""
    while time.monotonic() < deadline:
        text = httpx.get(gw.url + "/metrics", timeout=5).text
        if _metric(text, "pdgate_kv_events_subscriptions") >= n:
            return text
        time.sleep(0.1)
    raise AssertionError(f"gRPC KV event streams not open after 30 s:\n{text[-2000:]}")


def hit_rate(processes, workers, tokenizer_dir: Path, policy: str) -> tuple[float, str]:
    reset_caches(workers)
    urls = [w.grpc_url for w in workers]
    gw = launch(processes, ["--policy", policy, "--cache-source", "events", "--model-path", str(tokenizer_dir), "--seed", "7",
                            "--health-check-interval-secs", "1", "--health-success-threshold", "1", "--worker-urls", *urls])
    try:
        gw.wait_ready()
        if policy == "cache_aware":
            wait_streams(gw, len(workers))
        r = run([gw], conversations(seed=16, **WORKLOAD))
        return r.hit_rate, httpx.get(gw.url + "/metrics", timeout=5).text
    finally:
        gw.stop()


def test_cache_aware_routes_grpc_workers_on_their_subscribed_kv_events(processes, grpc_engines, tokenizer_dir):
    events, metrics = hit_rate(processes, grpc_engines, tokenizer_dir, "cache_aware")
    rr, _ = hit_rate(processes, grpc_engines, tokenizer_dir, "round_robin")
    print(f"hit rates: cache_aware/events {events:.3f}, round_robin {rr:.3f}")
    # the events reached the index over gRPC: blocks stored, no orphan, nothing undecodable
    assert _metric(metrics, "pdgate_kv_events_blocks_stored_total") > 0, metrics
    assert _metric(metrics, "pdgate_kv_events_undecodable_total") == 0, metrics
    assert _metric(metrics, "pdgate_kv_events_orphans_total") == 0, metrics
    assert events > rr + 0.1, (events, rr)


def test_a_grpc_engine_without_kv_events_is_not_counted_as_publishing(processes, tokenizer_dir):
    w = ReferenceWorker(mode="null", grpc_service="sglang")
    w.start(90)
    try:
        gw = launch(processes, ["--policy", "cache_aware", "--cache-source", "auto", "--model-path", str(tokenizer_dir), "--worker-urls", w.grpc_url])
        try:
            gw.wait_ready()
            client_ok = httpx.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "hello there", "max_tokens": 2}, timeout=60)
            assert client_ok.status_code == 200, client_ok.text
            deadline = time.monotonic() + 20  # the gateway asked and was refused
            while not any("does not offer SubscribeKvEvents" in line for line in gw.output) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert any("does not offer SubscribeKvEvents" in line for line in gw.output), "".join(gw.output)
            text = httpx.get(gw.url + "/metrics", timeout=5).text
            assert "pdgate_kv_events_subscriptions" not in text, text  # no publisher: no KV event rows
        finally:
            gw.stop()
    finally:
        w.stop()
