"""Load in tokens and KV, end to end through the gateway to reference engines.

- `--prefill-policy least_tokens` sends short prompts to the idle prefill while a long prompt is
  being prefilled on the other (round robin would alternate and hit the busy one).
- `--pd-pairing-mode strict` accepts vLLM-flavoured reference workers that, like real vLLM, have
  no `/server_info`: their runtime and KV layout come from the `/metrics` scrape
  (`vllm:cache_config_info`).
- The free KV the router sees is the engines' report (SGLang `/v1/loads` page counters).

The reference engine's byte-level tokenizer makes one UTF-8 byte one token, hence
`--chars-per-token 1`.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import httpx
import pytest

import pdgate
from pdgate.workers import ReferenceWorker
from tests.gateway.harness import wait_status

pytestmark = pytest.mark.timeout(300)
LONG_PROMPT = 4000  # tokens; prefilled 8 at a time, it takes seconds on the reference engine
SHORT_PROMPT = 8


def start_all(workers: list[ReferenceWorker]) -> None:
    with ThreadPoolExecutor(len(workers)) as pool:
        list(pool.map(lambda w: w.start(timeout=90), workers))


@pytest.fixture
def fleet(request: pytest.FixtureRequest) -> Iterator[list[ReferenceWorker]]:
    """Two prefills and a decode: bootstrap, or NIXL in vLLM's clothes (no SGLang endpoints)."""
    connector, extra = request.param
    workers = [ReferenceWorker(mode=m, model="tiny", kv_connector=connector, extra_args=extra) for m in ("prefill", "prefill", "decode")]
    start_all(workers)
    try:
        yield workers
    finally:
        for w in workers:
            w.stop()


def gauge(url: str, name: str, worker: str) -> float | None:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf'^{name}{{[^}}]*worker="{re.escape(worker)}"[^}}]*}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.mark.parametrize("fleet", [(None, ["--chunked-prefill-size", "8"])], indirect=True)
def test_least_tokens_sends_short_prompts_to_the_idle_prefill(fleet: list[ReferenceWorker]) -> None:
    p1, p2, d = fleet
    options = dict(pd_disaggregation=True, port=0, prefill=[[p.url, p.bootstrap_port] for p in (p1, p2)], decode=[d.url],
                   prefill_policy="least_tokens", chars_per_token=1.0, health_check_interval_secs=1, health_success_threshold=1)
    with pdgate.Gateway(**options) as gw:
        assert wait_status(gw.url + "/readiness", 200) == 200
        # Idle engines: the free KV the router sees is the engines' own page counters.
        wait_for(lambda: gauge(gw.url, "pdgate_worker_free_kv_tokens", d.url) == 65536, 15, "the decode's free KV report")
        done = threading.Event()

        def long_request() -> None:
            try:
                r = httpx.post(gw.url + "/v1/completions", timeout=240, json={"model": "tiny", "prompt": "L" * LONG_PROMPT, "max_tokens": 1})
                assert r.status_code == 200, r.text
            finally:
                done.set()

        threading.Thread(target=long_request, daemon=True).start()
        busy = {}
        wait_for(lambda: busy.update({p.url: gauge(gw.url, "pdgate_worker_prompt_tokens", p.url) or 0 for p in (p1, p2)}) or max(busy.values()) >= LONG_PROMPT,
                 30, "the long prompt queued on a prefill")
        busy_url = max(busy, key=busy.get)
        idle_url = p2.url if busy_url == p1.url else p1.url
        valid = []
        while not done.is_set() and len(valid) < 3:
            r = httpx.post(gw.url + "/v1/completions", timeout=60, json={"model": "tiny", "prompt": "s" * SHORT_PROMPT, "max_tokens": 1})
            assert r.status_code == 200, r.text
            if not done.is_set():  # the long prefill was in flight for the whole short request
                valid.append(r.headers["x-pdgate-route"])
        assert len(valid) >= 2, f"the long prefill ended before two short requests could run beside it: {valid}"
        for route in valid:
            assert f"prefill={idle_url}" in route, f"short prompt sent to the busy prefill {busy_url}: {route}"
            assert "least_tokens queued=0" in route, route
        wait_for(done.is_set, 240, "the long request")


VLLM_LIKE = ("NixlConnector", ["--vllm-endpoints-only"])


@pytest.mark.parametrize("fleet", [VLLM_LIKE], indirect=True)
def test_strict_pairing_accepts_vllm_workers_by_their_scraped_keys(fleet: list[ReferenceWorker]) -> None:
    p1, p2, d = fleet
    assert httpx.get(p1.url + "/server_info", timeout=10).status_code == 404, "no /server_info, as real vLLM"
    options = dict(pd_disaggregation=True, port=0, kv_connector="nixl", prefill=[[p.url, p.bootstrap_port] for p in (p1, p2)], decode=[d.url], pd_pairing_mode="strict",
                   load_poll_interval_secs=1, admin_api_open=True, chars_per_token=1.0, health_check_interval_secs=1, health_success_threshold=1)
    with pdgate.Gateway(**options) as gw:
        assert wait_status(gw.url + "/readiness", 200, timeout=30) == 200, "strict pairing never found a pair"
        for w in httpx.get(gw.url + "/workers", timeout=10).json()["workers"]:
            key = w["pd_pairing"]
            assert (key["runtime"], key["kv_layout"]["page_size"], key["kv_layout"]["kv_dtype"]) == ("vllm", 16, "auto"), w
        r = httpx.post(gw.url + "/v1/completions", timeout=60, json={"model": "tiny", "prompt": "hello there", "max_tokens": 4})
        assert r.status_code == 200, r.text
        wait_for(lambda: gauge(gw.url, "pdgate_worker_free_kv_tokens", d.url) == 65536, 15, "the decode's free KV from vllm:cache_config_info")
