"""Faults on real vLLM: a decode SIGKILLed mid-stream is resumed on the other decode with the
exact greedy continuation; a SIGKILLed prefill is retried on the other; nothing hangs past its
deadline; and the surviving workers' own state (running requests, KV usage) returns to idle.
Each test revives what it killed, so the fleet is whole for the next."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.real_vllm.conftest import MODEL, gateway_metric, metric, wait_until

pytestmark = pytest.mark.timeout(900)


def _idle(worker) -> bool:
    return (metric(worker, "vllm:num_requests_running") == 0 and metric(worker, "vllm:num_requests_waiting") == 0
            and metric(worker, "vllm:kv_cache_usage_perc") < 0.01)


def _route_part(route: str, key: str) -> str:
    return route.split(key + "=")[1].split(";")[0]


def test_a_decode_killed_mid_stream_is_resumed_on_the_other_with_the_exact_continuation(fleet):
    # 1024 tokens, killed at the first event: a 64-token answer was measured wholly produced (and
    # buffered in the socket) before the eighth event was read, and with NIXL's progress thread
    # no longer spinning (docs/engine.md, "In CI") 256 tokens were done by the second event.
    body = {"model": MODEL, "prompt": "A decode that dies halfway:", "max_tokens": 1024, "temperature": 0,
            "ignore_eos": True}
    expected = httpx.post(fleet.colocated.url + "/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
    text, events, killed = [], [], None
    started = time.monotonic()
    with httpx.Client(timeout=300) as client, client.stream("POST", fleet.url + "/v1/completions",
                                                           json={**body, "stream": True}) as r:
        assert r.status_code == 200
        first = fleet.by_url(_route_part(r.headers["x-pdgate-route"], "decode"))
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(event)
            assert "error" not in event, event
            text.append(event["choices"][0]["text"] if event.get("choices") else "")
            if killed is None and len(events) == 1:
                first.kill()
                killed = first
    try:
        assert killed is not None, "the stream ended before the decode could be killed"
        assert "".join(text) == expected, "the resumed stream lost, repeated or changed text"
        assert len({e["id"] for e in events}) == 1, "one response id across the resume"
        assert time.monotonic() - started < 300
        assert gateway_metric(fleet.url, "pdgate_resumes_total", result="resumed") >= 1, \
            "no resume: the decode had sent the whole answer before the kill landed"
        survivors = [w for w in fleet.all() if w is not killed]
        wait_until(lambda: all(_idle(w) for w in survivors), 20, "the surviving workers idle again")
    finally:
        fleet.revive(first)


def test_a_killed_prefill_is_retried_on_the_other_and_nothing_hangs(fleet):
    victim = fleet.prefills[0]
    victim.kill()
    try:
        started = time.monotonic()
        for i in range(4):  # round robin: at least one lands on the dead prefill before health sees it
            body = {"model": MODEL, "prompt": f"retry {i}", "max_tokens": 6, "temperature": 0}
            r = httpx.post(fleet.url + "/v1/completions", json=body, timeout=150)
            assert r.status_code == 200, r.text
            assert _route_part(r.headers["x-pdgate-route"], "prefill") == fleet.prefills[1].url
            expected = httpx.post(fleet.colocated.url + "/v1/completions", json=body, timeout=300).json()
            assert r.json()["choices"][0]["text"] == expected["choices"][0]["text"]
        assert time.monotonic() - started < 4 * 150
        wait_until(lambda: all(_idle(w) for w in fleet.all() if w is not victim), 20, "the live workers idle again")
    finally:
        fleet.revive(victim)


def test_a_nixl_prefill_whose_decode_died_before_pulling_frees_its_blocks(fleet):
    """A decode that dies between its prefill's answer and its pull: the request is sent again
    on a new pair (nothing reached the client), and the first prefill, whose blocks no decode
    will read, frees them when vLLM's NIXL lease runs out (`kv_lease_duration` in the connector's
    extra config, 30 s by default, renewed by the decode's heartbeats: vllm/distributed/
    kv_transfer/kv_connector/v1/nixl/base_scheduler.py). No call of a gateway frees them sooner;
    the gateway's part is not to hang and not to leave the client without its answer."""
    victim = fleet.decodes[0]
    body = {"model": MODEL, "prompt": "orphaned blocks", "max_tokens": 8, "temperature": 0}
    expected = httpx.post(fleet.colocated.url + "/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]
    wait_until(lambda: all(metric(p, "vllm:kv_cache_usage_perc") == 0 for p in fleet.prefills), 60, "the prefills hold no blocks")

    # Prefills seen holding blocks with nothing running: blocks waiting for a decode's pull.
    seen: set[str] = set()

    def watch() -> None:
        seen.update(p.url for p in fleet.prefills
                    if metric(p, "vllm:kv_cache_usage_perc") > 0 and metric(p, "vllm:num_requests_running") == 0)

    def at_victim() -> bool:
        # vLLM PD sends the decode leg once the prefill has answered: in flight there means
        # the prefill's blocks wait for the stopped decode (a pull to the other would end).
        return gateway_metric(fleet.url, "pdgate_worker_inflight", worker=victim.url, role="decode") >= 1

    # Its API server stopped: it takes the request into its socket's backlog and does nothing
    # with it, so it neither pulls nor sends a heartbeat until it is killed.
    os.kill(victim.proc.pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(2) as ex:
            # Both placed at once, before the gateway's health rounds can see the stop (two missed
            # rounds: seconds, while one request takes 10-15 s on a slow machine): round robin
            # gives one pair each decode, so one request surely meets the stopped decode.
            answers = [ex.submit(httpx.post, fleet.url + "/v1/completions", json=body, timeout=300) for _ in range(2)]
            wait_until(lambda: at_victim() or all(a.done() for a in answers), 120,
                       "the decode leg at the stopped decode")
            assert at_victim(), "no request went to the stopped decode"
            # The other request's pair answers meanwhile; watch the prefills all along (vLLM
            # frees unread blocks when its lease runs out: 30 s).
            wait_until(lambda: watch() or any(a.done() for a in answers), 300, "the request on the live decode answered")
            done = next(a for a in answers if a.done())
            other = done.result()
            assert other.status_code == 200, other.text
            assert other.json()["choices"][0]["text"] == expected
            # Round robin gave the two requests different prefills: the other one's is held.
            other_prefill = _route_part(other.headers["x-pdgate-route"], "prefill")
            held = next(p for p in fleet.prefills if p.url != other_prefill)
            wait_until(lambda: watch() or held.url in seen, 60, "the stopped decode's prefill holding its blocks")
            victim.kill()  # SIGKILL reaches a stopped process
            r = next(a for a in answers if a is not done).result()
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        # Sent again on a new pair: nothing had reached the client.
        assert _route_part(r.headers["x-pdgate-route"], "decode") == fleet.decodes[1].url
        wait_until(lambda: metric(held, "vllm:kv_cache_usage_perc") == 0, 30 + 60, "the orphaned blocks freed by the lease")
    finally:
        fleet.revive(victim)
