"""/metrics counts what happened, including PD requests that succeeded without moving KV."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import Processes
from tests.gateway.stacks import pd_stack, regular_stack
from tests.mock_workers import MockHost


def samples(url: str, name: str) -> list:
    text = httpx.get(url + "/metrics", timeout=5).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples if s.name == name]


def total(url: str, name: str) -> float:
    return sum(s.value for s in samples(url, name))


def test_requests_are_counted_by_status(mocks: MockHost, processes: Processes) -> None:
    stack = regular_stack(mocks, processes)
    for _ in range(3):
        httpx.post(stack.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1}, timeout=10)
    httpx.post(stack.url + "/v1/completions", content=b"{", timeout=10)
    counted = samples(stack.url, "pdgate_requests_total")
    assert sum(s.value for s in counted if s.labels.get("status") == "200") >= 3
    assert sum(s.value for s in counted if s.labels.get("status", "").startswith("4")) >= 1


def test_nixl_silent_recompute_is_counted(mocks: MockHost, processes: Processes) -> None:
    stack = pd_stack(mocks, processes, "nixl", decode_knobs=None)
    # A decode that recomputes when no params arrive (vLLM's behaviour), a prefill that sends none.
    stack.decode.on_missing_params = "recompute"
    mocks.set_knobs(stack.prefill, omit_kv_params=True)
    before = total(stack.url, "pdgate_pd_silent_recompute_total")
    resp = httpx.post(stack.url + "/v1/completions", json={"model": "m", "prompt": "a b c", "max_tokens": 3}, timeout=10)
    assert resp.status_code == 200, resp.text  # the request still succeeds
    assert resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert total(stack.url, "pdgate_pd_silent_recompute_total") == before + 1
