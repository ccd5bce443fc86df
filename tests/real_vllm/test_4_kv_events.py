"""KV events from real vLLM (`--kv-events-config`, ZMQ) consumed by pdgate's subscriber:
cache-aware routing on those events keeps a multi-turn workload's conversations on the worker
that holds their prefix, so real vLLM's own prefix-cache hit rate beats round robin's.

The two prefills serve colocated requests here (kv_both workers, no kv_transfer_params): two
regular-mode gateways in front of them, one `round_robin`, one `cache_aware --cache-source events`
with the exported tokenizer (`--model-path`), run the same seeded workload after a cache reset."""

from __future__ import annotations

import time

import httpx
import pytest
from openai import OpenAI

from tests.gateway.prefix_routing import conversations
from tests.real_vllm.conftest import DEADLINE_S, MODEL, gateway_metric, wait_until

pytestmark = pytest.mark.timeout(900)


def _gateway(fleet, policy: str, **extra):
    import pdgate

    gw = pdgate.Gateway(port=0, policy=policy, admin_api_open=True, model_path=str(fleet.model_dir),
                        health_check_interval_secs=2, health_check_timeout_secs=5, **extra)
    gw.start()
    for w, (pub, replay) in zip(fleet.prefills, fleet.kv_events):
        gw.add_worker(w.url, "regular", kv_events=f"tcp://127.0.0.1:{pub}", kv_events_replay=f"tcp://127.0.0.1:{replay}")
    wait_until(lambda: httpx.get(gw.url + "/readiness", timeout=5).status_code == 200, 60, f"{policy} gateway ready")
    return gw


def _hit_rate(gw, prompts: list[str]) -> float:
    client = OpenAI(base_url=gw.url + "/v1", api_key="none", timeout=DEADLINE_S, max_retries=0)
    prompt_tokens = cached = 0
    for prompt in prompts:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        prompt_tokens += r.usage.prompt_tokens
        details = r.usage.prompt_tokens_details
        cached += (details.cached_tokens or 0) if details else 0
    return cached / max(1, prompt_tokens)


def _reset(fleet) -> None:
    for w in fleet.prefills:
        assert httpx.post(w.url + "/reset_prefix_cache", timeout=30).status_code == 200


def test_cache_aware_on_real_vllm_events_beats_round_robin(fleet):
    # Long system prompts: vLLM's CPU blocks are large, and only full blocks are cached or published.
    workload = conversations(seed=7, n_conversations=12, turns=4, groups=4, live=4, system_words=70, turn_words=8)
    rates = {}
    for policy, extra in (("round_robin", {}), ("cache_aware", {"cache_source": "events"})):
        _reset(fleet)
        gw = _gateway(fleet, policy, **extra)
        try:
            if policy == "cache_aware":
                wait_until(lambda: gateway_metric(gw.url, "pdgate_kv_events_caught_up_total") >= 2, 30,
                           "subscribed to both prefills' events")
            time.sleep(0.5)
            rates[policy] = _hit_rate(gw, workload.prompts)
            if policy == "cache_aware":
                stored = gateway_metric(gw.url, "pdgate_kv_events_blocks_stored_total")
                assert stored > 0, "no BlockStored event from real vLLM reached the gateway"
                assert gateway_metric(gw.url, "pdgate_kv_events_undecodable_total") == 0
        finally:
            gw.stop()
    assert rates["cache_aware"] > rates["round_robin"] + 0.05, rates
