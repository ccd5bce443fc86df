"""End to end through `pdgate launch` to reference-engine processes: conditional placement sends
short prompts to the colocated worker and long ones to the prefill/decode pair (the header says
so), and early rejection answers 429 at once instead of letting requests time out.

The cost model's priors are pinned (a prior worth 100,000 observations, no forgetting), so the
decisions follow the configured numbers, not this machine's speed; the decisions themselves are
unit-tested in pdgate-core."""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from pdgate.workers import ReferenceWorker
from tests.conftest import Processes
from tests.gateway.harness import GatewayProcess, launch
from tests.gateway.stacks import FAST_HEALTH

PINNED = ["--chars-per-token", "1", "--placement-prior-weight", "100000", "--placement-forgetting", "1.0"]


@pytest.fixture
def engines() -> Iterator[dict[str, ReferenceWorker]]:
    workers = {"prefill": ReferenceWorker(mode="prefill"), "decode": ReferenceWorker(mode="decode"), "colocated": ReferenceWorker(mode="null")}
    try:
        for w in workers.values():
            w.start(timeout=60)
        yield workers
    finally:
        for w in workers.values():
            w.stop()


def _gateway(processes: Processes, engines: dict[str, ReferenceWorker], *args: str, colocated: bool = True) -> GatewayProcess:
    p, d = engines["prefill"], engines["decode"]
    extra = ["--worker-urls", engines["colocated"].url] if colocated else []
    gw = launch(processes, ["--pd-disaggregation", "--prefill", p.url, str(p.bootstrap_port), "--decode", d.url, *extra, *PINNED, *FAST_HEALTH, *args])
    gw.wait_ready(timeout=60)
    return gw


def _complete(url: str, tokens: int, timeout: float = 60.0, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"prompt": "a" * tokens, "max_tokens": 16, **body}, headers=headers, timeout=timeout)


def _metric(url: str, pattern: str) -> float | None:
    m = re.search(pattern + r" (\S+)", httpx.get(url + "/metrics", timeout=10).text)
    return float(m.group(1)) if m else None


def test_conditional_places_short_prompts_colocated_and_long_ones_on_the_pair(processes: Processes, engines: Any) -> None:
    gw = _gateway(processes, engines, "--pd-placement", "conditional")
    # A long stream on the colocated worker, left unread so it stays in flight: the running
    # decode that a long local prefill would stall (TPOT 45 + prefill / 16 > 50 from ~1,700 tokens).
    with httpx.Client(timeout=60) as client:
        body = {"prompt": "hold", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with client.stream("POST", gw.url + "/v1/completions", json=body) as held:
            assert held.status_code == 200
            assert "placement=colocated; reason=local_ttft_lower" in held.headers["x-pdgate-route"]
            short = _complete(gw.url, 100)
            long = _complete(gw.url, 3000)
    assert short.status_code == 200 and long.status_code == 200, (short.text, long.text)
    short_route, long_route = short.headers["x-pdgate-route"], long.headers["x-pdgate-route"]
    assert short_route.startswith("protocol=regular") and engines["colocated"].url in short_route, short_route
    assert "placement=colocated; reason=local_ttft_lower" in short_route
    assert long_route.startswith("protocol=bootstrap") and "placement=disaggregated; reason=local_stall_breaks_tpot" in long_route, long_route
    # The pair really moved the KV: the decode reports the prompt as cached.
    usage = long.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - 1 > 0, usage
    metrics = httpx.get(gw.url + "/metrics", timeout=10).text
    observed = re.search(r'pdgate_placement_model\{param="prefill_observations"\} (\d+)', metrics)
    assert observed and int(observed.group(1)) >= 1, "the prefill leg fed the cost model"


def test_the_engines_transfer_counters_feed_the_transfer_fit(processes: Processes, engines: Any) -> None:
    gw = _gateway(processes, engines, "--load-poll-interval-secs", "1", colocated=False)
    param = r'pdgate_placement_model\{param="%s"\}'
    assert _metric(gw.url, param % "transfer_observations") == 0
    assert _metric(gw.url, param % "link_setup_ms") == 12, "the prior"
    r = _complete(gw.url, 2000)
    assert r.status_code == 200, r.text
    # The decode's cumulative counters, polled every second: the transfer since the last poll is
    # one observation within a few polls.
    deadline = time.monotonic() + 20
    while (_metric(gw.url, param % "transfer_observations") or 0) < 1:
        assert time.monotonic() < deadline, "no transfer observation from the engines' reports"
        time.sleep(0.2)
    assert _metric(gw.url, param % "link_setup_ms") != 12, "the fit moved off its prior"


def test_overload_is_answered_429_at_once_and_admitted_requests_finish(processes: Processes, engines: Any, tmp_path: Path) -> None:
    # TTFT objective 50 ms, no slack: 2,000 tokens predict 1 + 70 ms of prefill alone.
    log = tmp_path / "requests.jsonl"
    gw = _gateway(processes, engines, "--slo-ttft-ms", "50", "--admission-slack", "1", "--placement-prefill-base-ms", "1",
                  "--placement-decode-step-ms", "1", "--request-timeout-secs", "30", "--request-log", str(log), colocated=False)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        long = list(pool.map(lambda _: _complete(gw.url, 2000), range(16)))
        short = list(pool.map(lambda _: _complete(gw.url, 10), range(8)))
    for r in long:
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "overloaded"
        assert r.headers["x-pdgate-dropped-reason"] == "predicted_ttft_over_budget" and int(r.headers["retry-after"]) >= 1
    assert [r.status_code for r in short] == [200] * 8, [r.text for r in short]
    metrics = httpx.get(gw.url + "/metrics", timeout=10).text
    assert 'pdgate_placement_total{placement="rejected",reason="predicted_ttft_over_budget"} 16' in metrics
    assert not re.search(r'pdgate_requests_total\{route="/v1/completions",status="504"\} [1-9]', metrics), "nothing timed out"
    # Each refusal is a failed request for the SLO accounting, with its line in the log.
    assert 'pdgate_slo_requests_total{result="failed"} 16' in metrics
    lines = _log_lines(log, 24)
    refused = [line for line in lines if line["status"] == 429]
    assert len(refused) == 16 and all(line["placement"] == "rejected" and line["slo_result"] == "failed" and line["error"] == "overloaded" for line in refused), refused


def test_per_request_objectives_and_priority_decide_early_rejection(processes: Processes, engines: Any) -> None:
    # 1,000 tokens predict about 63 ms to the first token (1 + 35 prefill, 12 + 14 transfer, 1
    # step): over a 50 ms objective with slack 1, within twice that.
    gw = _gateway(processes, engines, "--slo-ttft-ms", "50", "--admission-slack", "1", "--placement-prefill-base-ms", "1",
                  "--placement-decode-step-ms", "1", colocated=False)
    assert _complete(gw.url, 1000).status_code == 429
    for header in ("x-slo-ttft-ms", "x-llm-d-slo-ttft-ms"):
        r = _complete(gw.url, 1000, headers={header: "5000"})
        assert r.status_code == 200, (header, r.text)
    assert _complete(gw.url, 1000, headers={"x-slo-ttft-ms": "20"}).status_code == 429, "a tighter objective than the flag's"
    # The lowest priority is shed first: a higher one gets twice the slack.
    assert _complete(gw.url, 1000, headers={"x-pdgate-priority": "-1"}).status_code == 429
    assert _complete(gw.url, 1000, headers={"x-pdgate-priority": "1"}).status_code == 200
    assert _complete(gw.url, 1000, priority=1).status_code == 200, "SGLang's body field"
    bad = _complete(gw.url, 10, priority="high")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority", bad.text


def _log_lines(path: Path, n: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        if len(lines) >= n:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"the request log never had {n} lines: {path.read_text() if path.exists() else None}")




def test_admission_queue_refusals_are_failed_requests_in_the_accounting(processes: Processes, engines: Any, tmp_path: Path) -> None:
    log = tmp_path / "requests.jsonl"
    gw = _gateway(processes, engines, "--max-concurrent-requests", "1", "--queue-size", "0", "--request-log", str(log), colocated=False)
    with httpx.Client(timeout=60) as client:
        body = {"prompt": "hold", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with client.stream("POST", gw.url + "/v1/completions", json=body) as held:
            assert held.status_code == 200
            refused = _complete(gw.url, 10, headers={"x-request-id": "refused-1"})
    assert refused.status_code == 429, refused.text
    lines = _log_lines(log, 2)
    line = next(line for line in lines if line["status"] == 429)
    assert (line["client_request_id"], line["placement"], line["slo_result"], line["route"]) == ("refused-1", "rejected", "failed", "/v1/completions"), line
    assert _metric(gw.url, r'pdgate_slo_requests_total\{result="failed"\}') == 2, "the refusal and the held stream cut short"


def test_a_fleet_slower_than_the_reporting_objective_is_served_unless_an_objective_is_set(processes: Processes, engines: Any) -> None:
    # The cost model is pinned to believe every prefill takes 3 s: far past the reporting
    # objective (1000 ms) times the default --admission-slack (2), as a slow real fleet is.
    slow = ["--placement-prefill-base-ms", "3000"]
    unset = _gateway(processes, engines, *slow, colocated=False)
    answers = [_complete(unset.url, 50) for _ in range(4)]
    assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
    assert any("refusals: early rejection: only for requests that send x-slo-ttft-ms" in line for line in unset.output), "".join(unset.output)
    # Only the request that brings its own objective can be refused, and it is told why.
    own = _complete(unset.url, 50, headers={"x-slo-ttft-ms": "1000"})
    assert own.status_code == 429, own.text
    assert own.headers["x-pdgate-dropped-reason"] == "predicted_ttft_over_budget" and int(own.headers["retry-after"]) >= 3
    assert _complete(unset.url, 50).status_code == 200
    # The operator's objective arms it for every request, and the start-up log says so.
    armed = _gateway(processes, engines, *slow, "--slo-ttft-ms", "1000", colocated=False)
    assert any("refusals: early rejection: ARMED" in line and "1000 ms" in line for line in armed.output), "".join(armed.output)
    r = _complete(armed.url, 50)
    assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded", r.text
