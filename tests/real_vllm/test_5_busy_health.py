"""Issue 32 on real vLLM: a second gateway with pdgate's default health settings (checks every
5 s, 3 s timeout, out after 3) in front of the same NIXL workers, under a concurrent load long
enough for several health rounds while the decodes work. vLLM answers `/health` from the busy
API-server process; no request may be refused for health while the decodes serve."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import APIStatusError, OpenAI

from tests.real_vllm.conftest import MODEL, gateway_metric, wait_until

pytestmark = pytest.mark.timeout(900)


def test_no_request_is_refused_for_health_while_the_decodes_serve(fleet):
    import pdgate

    gw = pdgate.Gateway(pd_disaggregation=True, kv_connector="nixl", port=0, policy="round_robin",
                        prefill=[(p.url, None) for p in fleet.prefills], decode=[d.url for d in fleet.decodes],
                        request_timeout_secs=300)
    gw.start()
    try:
        wait_until(lambda: httpx.get(gw.url + "/readiness", timeout=5).status_code == 200, 60, "default-health gateway ready")
        client = OpenAI(base_url=gw.url + "/v1", api_key="none", timeout=300, max_retries=0)

        def one(i: int) -> int:
            try:
                client.completions.create(model=MODEL, prompt=f"busy decode {i}: " + "word " * 40,
                                          max_tokens=96, temperature=0, extra_body={"ignore_eos": True})
                return 200
            except APIStatusError as e:
                return e.status_code

        started = time.monotonic()
        with ThreadPoolExecutor(6) as ex:
            statuses = list(ex.map(one, range(24)))
        took = time.monotonic() - started
        refused = [s for s in statuses if s != 200]
        unanswered = sum(gateway_metric(gw.url, "pdgate_health_unanswered_while_serving_total", role=r) for r in ("prefill", "decode"))
        panics = sum(gateway_metric(gw.url, "pdgate_health_panic_total", role=r) for r in ("prefill", "decode"))
        print(f"24 requests in {took:.0f} s; unanswered checks while serving: {unanswered:.0f}; panic episodes: {panics:.0f}")
        assert not refused, f"{len(refused)} of 24 refused: {refused}"
    finally:
        gw.stop()
