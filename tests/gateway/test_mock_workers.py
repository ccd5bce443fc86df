"""The mocks must enforce the PD protocols, or the end-to-end tests prove nothing.

Each protocol is driven by a tiny fake router: the correct one passes, and the usual mistakes
(legs sent one after the other, a dropped field, a wrong engine id) fail.
"""

from __future__ import annotations

import concurrent.futures
import copy
import random
import uuid

import httpx

from tests.mock_workers import (
    BootstrapDecode,
    BootstrapPrefill,
    MockHost,
    MockWorker,
    MooncakeDecode,
    MooncakePrefill,
    NixlDecode,
    NixlPrefill,
)

BODY = {"model": "mock-model", "prompt": "the quick brown fox", "max_tokens": 5}


def bootstrap_body(prefill: BootstrapPrefill, body: dict) -> dict:
    room = random.randrange(2**63)
    return {**body, "bootstrap_host": prefill.host, "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": room}


def test_regular_worker_is_deterministic(mocks: MockHost) -> None:
    worker = mocks.start(MockWorker())
    a = httpx.post(worker.url + "/v1/completions", json=BODY, timeout=5).json()
    b = httpx.post(worker.url + "/v1/completions", json=BODY, timeout=5).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert len(a["choices"][0]["text"].split()) == 5
    assert mocks.state(worker)["pending"] == 0


def test_bootstrap_concurrent_legs_pass(mocks: MockHost) -> None:
    prefill = mocks.start(BootstrapPrefill())
    decode = mocks.start(BootstrapDecode())
    regular = mocks.start(MockWorker())
    body = bootstrap_body(prefill, BODY)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        p = pool.submit(httpx.post, prefill.url + "/v1/completions", json=body, timeout=10)
        d = pool.submit(httpx.post, decode.url + "/v1/completions", json=body, timeout=10)
        p_resp, d_resp = p.result(), d.result()
    assert p_resp.status_code == 200 and d_resp.status_code == 200
    expected = httpx.post(regular.url + "/v1/completions", json=BODY, timeout=5).json()
    assert d_resp.json()["choices"][0]["text"] == expected["choices"][0]["text"]
    assert d_resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
    assert mocks.state(prefill)["held"] == 0


def test_bootstrap_sequential_legs_fail(mocks: MockHost) -> None:
    prefill = mocks.start(BootstrapPrefill(rendezvous_timeout_s=0.5))
    decode = mocks.start(BootstrapDecode())
    body = bootstrap_body(prefill, BODY)
    p_resp = httpx.post(prefill.url + "/v1/completions", json=body, timeout=10)
    assert p_resp.status_code == 500
    assert "bootstrap timeout" in p_resp.json()["error"]["message"]


def test_bootstrap_batch_needs_one_room_per_item(mocks: MockHost) -> None:
    prefill = mocks.start(BootstrapPrefill())
    body = {"text": ["a b", "c d"], "sampling_params": {"max_new_tokens": 3}}
    body = {**body, "bootstrap_host": [prefill.host] * 2, "bootstrap_port": [prefill.bootstrap_port], "bootstrap_room": [1, 2]}
    resp = httpx.post(prefill.url + "/generate", json=body, timeout=5)
    assert resp.status_code == 400
    assert mocks.state(prefill)["violations"]


def test_bootstrap_decode_rejects_missing_fields(mocks: MockHost) -> None:
    decode = mocks.start(BootstrapDecode())
    resp = httpx.post(decode.url + "/generate", json={"text": "hi"}, timeout=5)
    assert resp.status_code == 400
    assert "missing bootstrap fields" in mocks.state(decode)["violations"][0]


def nixl_prefill_body(body: dict) -> dict:
    leg = {**body, "max_tokens": 1, "stream": False}
    leg["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
    return leg


def test_nixl_relayed_params_pass_and_dropped_field_fails(mocks: MockHost) -> None:
    prefill = mocks.start(NixlPrefill())
    decode = mocks.start(NixlDecode())
    headers = {"X-Request-Id": uuid.uuid4().hex}
    p = httpx.post(prefill.url + "/v1/completions", json=nixl_prefill_body(BODY), headers=headers, timeout=5).json()
    params = p["kv_transfer_params"]
    broken = copy.deepcopy(params)
    del broken["remote_block_ids"]
    bad = httpx.post(decode.url + "/v1/completions", json={**BODY, "kv_transfer_params": broken}, headers=headers, timeout=5)
    assert bad.status_code == 400
    ok = httpx.post(decode.url + "/v1/completions", json={**BODY, "kv_transfer_params": params}, headers=headers, timeout=5)
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
    assert mocks.state(prefill)["held"] == 0


def test_nixl_request_id_must_match(mocks: MockHost) -> None:
    prefill = mocks.start(NixlPrefill())
    decode = mocks.start(NixlDecode())
    p = httpx.post(prefill.url + "/v1/completions", json=nixl_prefill_body(BODY), headers={"X-Request-Id": "a"}, timeout=5)
    body = {**BODY, "kv_transfer_params": p.json()["kv_transfer_params"]}
    resp = httpx.post(decode.url + "/v1/completions", json=body, headers={"X-Request-Id": "b"}, timeout=5)
    assert resp.status_code == 400
    assert "X-Request-Id" in mocks.state(decode)["violations"][0]


def test_nixl_prefill_rejects_unrewritten_leg(mocks: MockHost) -> None:
    prefill = mocks.start(NixlPrefill())
    resp = httpx.post(prefill.url + "/v1/completions", json={**BODY, "stream": True}, timeout=5)
    assert resp.status_code == 400


def test_mooncake_push_with_engine_id(mocks: MockHost) -> None:
    prefill = mocks.start(MooncakePrefill())
    decode = mocks.start(MooncakeDecode())
    engine_id = httpx.get(f"http://{prefill.host}:{prefill.bootstrap_port}/query", timeout=5).json()["0"]["engine_id"]
    transfer_id = f"xfer-{uuid.uuid4()}"
    p_leg = {**BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": transfer_id}}
    d_params = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": transfer_id,
                "remote_engine_id": engine_id, "remote_bootstrap_addr": f"http://{prefill.host}:{prefill.bootstrap_port}"}
    wrong = {**d_params, "remote_engine_id": "someone-else"}
    assert httpx.post(decode.url + "/v1/completions", json={**BODY, "kv_transfer_params": wrong}, timeout=5).status_code == 400
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        d = pool.submit(httpx.post, decode.url + "/v1/completions", json={**BODY, "kv_transfer_params": d_params}, timeout=10)
        p = pool.submit(httpx.post, prefill.url + "/v1/completions", json=p_leg, timeout=10)
        assert p.result().status_code == 200
        assert d.result().status_code == 200, d.result().text
    assert d.result().json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 4


def test_fault_knobs_and_pending(mocks: MockHost) -> None:
    worker = mocks.start(MockWorker(fail_status=500))
    assert httpx.post(worker.url + "/v1/completions", json=BODY, timeout=5).status_code == 500
    mocks.set_knobs(worker, fail_status=None, hang=True)
    try:
        httpx.post(worker.url + "/v1/completions", json=BODY, timeout=0.3)
        raise AssertionError("a hanging worker answered")
    except httpx.TimeoutException:
        pass
    # The client gave up and closed the connection: the handler is cancelled, nothing waits.
    assert mocks.wait_idle(worker, timeout=5)
    mocks.set_knobs(worker, hang=False, die_mid_stream=True)
    with httpx.stream("POST", worker.url + "/v1/completions", json={**BODY, "stream": True}, timeout=5) as resp:
        try:
            text = "".join(resp.iter_text())
        except httpx.HTTPError:
            text = ""
    assert "[DONE]" not in text


def test_streaming_generate_and_chat(mocks: MockHost) -> None:
    worker = mocks.start(MockWorker())
    with httpx.stream("POST", worker.url + "/generate", json={"text": "a b c", "stream": True, "sampling_params": {"max_new_tokens": 3}}, timeout=5) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data:")]
    assert lines[-1] == "data: [DONE]" and len(lines) == 4
    chat = {"model": "mock-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    resp = httpx.post(worker.url + "/v1/chat/completions", json=chat, timeout=5).json()
    assert resp["choices"][0]["message"]["role"] == "assistant"


def test_mock_runs_as_a_process(processes) -> None:  # type: ignore[no-untyped-def]
    import json
    import subprocess
    import sys

    proc = processes.popen([sys.executable, "-m", "tests.mock_workers", "bootstrap-prefill", "--knob", "delay_s=0.01"],
                           stdout=subprocess.PIPE, text=True)
    info = json.loads(proc.stdout.readline())  # printed once serving
    assert info["bootstrap_port"]
    assert httpx.get(info["url"] + "/health", timeout=5).status_code == 200
    state = httpx.get(info["url"] + "/_mock/state", timeout=5).json()
    assert state["knobs"]["delay_s"] == 0.01 and state["pending"] == 0
    proc.terminate()
    assert proc.wait(timeout=10) == 0
