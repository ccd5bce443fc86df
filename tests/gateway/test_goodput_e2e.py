"""End to end: latency accounting through `pdgate launch` to reference-engine workers, regular and
PD, measured against what the official `openai` client sees; the request log has one line per
request, and `pdgate bench`'s trace reader replays it.

Only orderings that hold on any machine are asserted (no wall-clock thresholds): the gateway's
arrival is after the client sent and its first content token is relayed before the client can
read it, so gateway TTFT <= client TTFT for every request."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import openai
import pytest

from pdgate.bench.dataset import trace_requests
from pdgate.workers import ReferenceWorker
from tests.conftest import Processes
from tests.gateway.harness import launch
from tests.gateway.stacks import FAST_HEALTH

MAX_TOKENS = 8


@pytest.fixture(params=["regular", "pd"])
def stack(request: pytest.FixtureRequest, processes: Processes, tmp_path: Path) -> Iterator[tuple[str, Any, Path]]:
    log = tmp_path / "requests.jsonl"
    if request.param == "pd":
        workers = [ReferenceWorker(mode="prefill", model="tiny"), ReferenceWorker(mode="decode", model="tiny")]
    else:
        workers = [ReferenceWorker(mode="null", model="tiny")]
    try:
        for w in workers:
            w.start(timeout=60)
        if request.param == "pd":
            args = ["--pd-disaggregation", "--prefill", workers[0].url, str(workers[0].bootstrap_port),
                    "--decode", workers[1].url]
        else:
            args = ["--worker-urls", workers[0].url]
        gateway = launch(processes, [*args, "--request-log", str(log), *FAST_HEALTH])
        gateway.wait_ready()
        yield request.param, gateway, log
    finally:
        for w in workers:
            w.stop()


def _log_lines(path: Path, n: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        lines = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        if len(lines) >= n:
            return lines
        time.sleep(0.05)
    raise AssertionError(f"the request log never had {n} lines: {path.read_text() if path.exists() else None}")


def _stream(client: openai.OpenAI, i: int, chat: bool) -> dict[str, float | int]:
    """One streamed request; the client's own TTFT (first content) and E2E, and its chunks."""
    rid = f"e2e-{i}"
    start = time.perf_counter()
    first = None
    chunks = 0
    usage_seen = False
    if chat:
        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": f"tell me {i}"}],
                                                max_tokens=MAX_TOKENS, stream=True, extra_headers={"x-request-id": rid},
                                                extra_body={"ignore_eos": True})
    else:
        stream = client.completions.create(model="tiny", prompt=f"once upon a time {i}", max_tokens=MAX_TOKENS,
                                           stream=True, extra_headers={"x-request-id": rid},
                                           extra_body={"ignore_eos": True})
    for c in stream:
        usage_seen |= getattr(c, "usage", None) is not None
        text = (c.choices[0].delta.content if chat else c.choices[0].text) if c.choices else None
        if text and first is None:
            first = time.perf_counter()
        chunks += 1
    end = time.perf_counter()
    assert first is not None and not usage_seen, "content came, and no usage the client did not ask for"
    return {"ttft_ms": (first - start) * 1000, "e2e_ms": (end - start) * 1000, "chunks": chunks}


def test_gateway_ttft_is_within_the_clients_and_the_log_has_every_request(stack: tuple[str, Any, Path]) -> None:
    kind, gateway, log = stack
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", timeout=60, max_retries=0)
    seen = {f"e2e-{i}": _stream(client, i, chat=i % 2 == 1) for i in range(6)}
    whole = client.completions.create(model="tiny", prompt="once upon a time 0", max_tokens=MAX_TOKENS,
                                      extra_headers={"x-request-id": "e2e-whole"}, extra_body={"ignore_eos": True})
    lines = _log_lines(log, 7)
    assert len(lines) == 7, lines
    by_id = {line["client_request_id"]: line for line in lines}
    assert set(by_id) == set(seen) | {"e2e-whole"}
    placement = "disaggregated" if kind == "pd" else "colocated"
    for rid, client_side in seen.items():
        line = by_id[rid]
        assert (line["status"], line["error"], line["stream"], line["placement"]) == (200, None, True, placement), line
        assert line["output_tokens"] == MAX_TOKENS, line  # the engine's usage, asked for by the gateway
        assert 0 < line["ttft_ms"] <= client_side["ttft_ms"], (line, client_side)
        assert line["ttft_ms"] <= line["e2e_ms"], (line, client_side)
        if kind != "pd":
            # A PD request ends at the gateway when its last leg does: the prefill's answer is
            # drained after the decode's last byte, so its E2E may end after the client's.
            assert line["e2e_ms"] <= client_side["e2e_ms"], (line, client_side)
        assert line["tpot_ms"] == pytest.approx((line["e2e_ms"] - line["ttft_ms"]) / (MAX_TOKENS - 1), abs=1e-5)
        if kind == "pd":
            assert line["cached_tokens"] == line["prompt_tokens"] > 0, "the KV moved"
    assert by_id["e2e-whole"]["prompt_tokens"] == whole.usage.prompt_tokens
    assert by_id["e2e-whole"]["output_tokens"] == whole.usage.completion_tokens == MAX_TOKENS
    assert by_id["e2e-whole"]["tpot_ms"] is None and by_id["e2e-whole"]["ttft_ms"] == by_id["e2e-whole"]["e2e_ms"]

    # The bench replays the log: every line, at its arrival times, with its token counts.
    replay = trace_requests(str(log), None, 99, np.random.default_rng(0))
    assert [r.prompt_len for r in replay] == [line["prompt_tokens"] for line in lines]
    assert [r.output_len for r in replay] == [MAX_TOKENS] * 7
    assert [r.arrival_s for r in replay] == [line["arrival_unix_s"] for line in lines]

    metrics = httpx.get(gateway.url + "/metrics", timeout=10).text
    assert f'pdgate_e2e_seconds_count{{placement="{placement}"}} 7' in metrics
    results = sum(float(m.split()[-1]) for m in metrics.splitlines() if m.startswith("pdgate_slo_requests_total{"))
    assert results == 7
