"""pdgate's gRPC worker client against real vLLM's gRPC service (smg-grpc-servicer): regular
(colocated) and PD over NIXL, completions and chat, streamed and not, each answer equal token for
token to vLLM's own HTTP server on the same weights; the PD pair moved KV (the decode logged NIXL
transfers) and pdgate counted no silent recompute."""

from __future__ import annotations

import httpx
import pytest

from tests.real_vllm.conftest import MODEL, gateway_metric, wait_until
from tests.real_vllm.test_1_equality import _client, _complete

pytestmark = pytest.mark.timeout(900)

PROMPTS = [
    "The capital of France is", "hello", "def fibonacci(n):", "Über straße ß café", "1 2 3 4 5 6 7",
    "Once upon a time, in a land far away,", "SELECT * FROM users WHERE id =", "Dear Sir or Madam,",
    "The quick brown fox jumps over the lazy dog", "{\"key\": \"value\",", "In 1492, Columbus", "x",
]
# vLLM's periodic stats line (loggers.py): what it is running and how much KV it holds.
RUNNING_ONE = "Running: 1 reqs"
IDLE = "Running: 0 reqs, Waiting: 0 reqs, CPU KV cache usage: 0.0%"
WAYS = [(False, False), (False, True), (True, False), (True, True)]  # (chat, stream)


def _gateway(**kwargs):
    import pdgate

    gw = pdgate.Gateway(port=0, policy="round_robin", request_timeout_secs=180, **kwargs)
    gw.start()
    wait_until(lambda: httpx.get(gw.url + "/readiness", timeout=5).status_code == 200, 120, "gateway ready")
    return gw


def _cases() -> list[tuple[str, bool, bool]]:
    return [(p, *WAYS[i % len(WAYS)]) for i, p in enumerate(PROMPTS)]


def _expected(grpc_fleet, cases) -> list[str]:
    colocated = _client(grpc_fleet.http.url)
    return [_complete(colocated, *c) for c in cases]


def test_regular_over_grpc_equals_vllm_http(grpc_fleet):
    cases = _cases()
    expected = _expected(grpc_fleet, cases)
    gw = _gateway(worker_urls=[grpc_fleet.prefill.url], model_path=str(grpc_fleet.model_dir))
    try:
        got = [_complete(_client(gw.url), *c) for c in cases]
        r = httpx.post(gw.url + "/v1/completions", timeout=180,
                       json={"model": MODEL, "prompt": "route", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert f"worker={grpc_fleet.prefill.url}" in r.headers["x-pdgate-route"]
    finally:
        gw.stop()
    differ = [(c, e, g) for c, e, g in zip(cases, expected, got) if e != g]
    assert not differ, f"{len(differ)} of {len(cases)} answers differ, first: {differ[:3]}"
    assert all(len(e) > 0 for e in expected)


def test_pd_nixl_over_grpc_equals_vllm_http_and_the_kv_moved(grpc_fleet):
    cases = _cases()
    expected = _expected(grpc_fleet, cases)
    gw = _gateway(pd_disaggregation=True, kv_connector="nixl", prefill=[(grpc_fleet.prefill.url, None)],
                  decode=[grpc_fleet.decode.url], model_path=str(grpc_fleet.model_dir))
    try:
        before = grpc_fleet.transfers()
        got = []
        for c in cases:
            got.append(_complete(_client(gw.url), *c))
        r = httpx.post(gw.url + "/v1/completions", timeout=180,
                       json={"model": MODEL, "prompt": "route", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        route = r.headers["x-pdgate-route"]
        assert "protocol=nixl" in route and f"prefill={grpc_fleet.prefill.url}" in route, route
        assert f"decode={grpc_fleet.decode.url}" in route, route
        # A gRPC worker serves no /metrics; its connector's stats reach only the log, where the
        # periodic line does not cover every transfer (seen: 7 lines for 13 requests), so the
        # log proves that the pair moves KV over NIXL, not a count per request (the HTTP suite,
        # tests/real_vllm/test_1_equality.py, counts them from /metrics).
        wait_until(lambda: grpc_fleet.transfers() > before, 30, "the decode logged a NIXL transfer")
        assert gateway_metric(gw.url, "pdgate_pd_silent_recompute_total") == 0
    finally:
        gw.stop()
    differ = [(c, e, g) for c, e, g in zip(cases, expected, got) if e != g]
    assert not differ, f"{len(differ)} of {len(cases)} answers differ, first: {differ[:3]}"


def test_a_client_that_leaves_a_grpc_pd_stream_leaves_vllm_idle(grpc_fleet):
    """The gateway drops the decode's gRPC call when the client goes: vLLM frees the request (its
    once-a-second stats line, the gRPC worker's only view of its state, reads idle again)."""
    gw = _gateway(pd_disaggregation=True, kv_connector="nixl", prefill=[(grpc_fleet.prefill.url, None)],
                  decode=[grpc_fleet.decode.url], model_path=str(grpc_fleet.model_dir))
    try:
        body = {"model": MODEL, "prompt": "an answer nobody reads", "max_tokens": 2000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=180) as client, client.stream("POST", gw.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            # Held in a name: a `for ... break` over r.iter_lines() drops the generator, and closing it
            # closes httpx's connection, so the client would leave here rather than at the `with`'s end.
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            mark = len(grpc_fleet.decode.log_text())
            wait_until(lambda: RUNNING_ONE in grpc_fleet.decode.log_text()[mark:], 15, "the decode reports the stream running")
        closed = len(grpc_fleet.decode.log_text())
        wait_until(lambda: IDLE in grpc_fleet.decode.log_text()[closed:], 15, "the decode idle after the client left")
    finally:
        gw.stop()
