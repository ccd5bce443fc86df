"""What an operator sees: every series a dashboard or alert reads exists at start-up, JSON logs
in a log directory, an access line per request, warnings with the request id, and why a worker
is unhealthy (in the log and in `/workers`)."""

from __future__ import annotations

import json
import pathlib
import re
import time
from typing import Any

import httpx

from tests.conftest import Processes
from tests.gateway.harness import launch
from tests.gateway.stacks import FAST_HEALTH, pd_stack
from tests.mock_workers import MockHost, MockWorker

SERIES = re.compile(r'^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$')


def scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        m = SERIES.match(line)
        if m:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m["labels"] or ""))
            out[(m["name"], labels)] = float(m["value"])
    return out


def test_alert_and_dashboard_series_exist_at_zero_from_start(mocks: MockHost, processes: Processes) -> None:
    stack = pd_stack(mocks, processes, "bootstrap")
    series = scrape(stack.url)

    def value(name: str, **labels: str) -> float:
        key = (name, frozenset(labels.items()))
        assert key in series, f"{name}{labels} is missing at start-up"
        return series[key]

    for reason in ["unreachable", "status", "timeout", "bad_response", "truncated", "protocol", "no_workers", "other"]:
        assert value("pdgate_retries_total", reason=reason) == 0
    for leg in ["prefill", "decode"]:
        for code in [f"{leg}_unavailable", f"{leg}_error", f"{leg}_timeout", f"{leg}_stream_truncated", "bad_worker_response"]:
            assert value("pdgate_worker_errors_total", leg=leg, code=code) == 0
    assert value("pdgate_pairing_refusals_total", mode="lenient") == 0
    for protocol in ["bootstrap", "nixl", "mooncake"]:
        assert value("pdgate_pd_silent_recompute_total", protocol=protocol, cause="decode_reported") == 0
    assert value("pdgate_pd_silent_recompute_total", protocol="nixl", cause="no_params") == 0
    for route in ["/v1/completions", "/v1/chat/completions", "/generate"]:
        assert value("pdgate_requests_total", route=route, status="504") == 0
    for reason in ["queue_full", "queue_timeout"]:
        assert value("pdgate_admission_refused_total", reason=reason) == 0
    for w, role in [(stack.prefill, "prefill"), (stack.decode, "decode")]:
        assert value("pdgate_worker_breaker_state", worker=w.url) == 0
        assert value("pdgate_worker_healthy", worker=w.url, role=role) == 1
        assert value("pdgate_worker_inflight", worker=w.url, role=role) == 0


def json_lines(path: pathlib.Path) -> list[dict[str, Any]]:
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    return [json.loads(line) for line in lines]  # every line must be JSON


def wait_for(predicate: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    return predicate()


def test_json_logs_in_log_dir_with_access_lines_and_request_ids(mocks: MockHost, processes: Processes, tmp_path: pathlib.Path) -> None:
    worker = mocks.start(MockWorker())
    log_dir = tmp_path / "logs" / "nested"
    gw = launch(processes, ["--worker-urls", worker.url, *FAST_HEALTH, "--log-json", "--log-dir", str(log_dir),
                            "--retry-max-retries", "1", "--disable-circuit-breaker"])
    gw.wait_ready()
    ok = httpx.post(gw.url + "/v1/completions", json={"model": "mock-model", "prompt": "hi", "max_tokens": 2},
                    headers={"X-Request-Id": "client-ok"}, timeout=10)
    assert ok.status_code == 200
    mocks.set_knobs(worker, fail_status=503)
    bad = httpx.post(gw.url + "/v1/completions", json={"model": "mock-model", "prompt": "hi", "max_tokens": 2},
                     headers={"X-Correlation-Id": "client-bad"}, timeout=10)
    assert bad.status_code == 502
    log = log_dir / "pdgate.log"

    def access(client_id: str) -> dict[str, Any] | None:
        if not log.exists():
            return None
        return next((e for e in json_lines(log) if e.get("target") == "pdgate::access" and e["fields"].get("client_request_id") == client_id), None)

    line = wait_for(lambda: access("client-ok"))
    assert line is not None, log.read_text() if log.exists() else "no log file"
    f = line["fields"]
    assert f["request_id"] == ok.headers["x-request-id"] and f["request_id"].startswith("client-ok-")
    assert f["route"] == "/v1/completions" and f["status"] == 200 and f["worker"] == worker.url
    assert f["attempts"] == 1 and f["latency_ms"] >= 0 and line["level"] == "INFO"
    failed = wait_for(lambda: access("client-bad"))
    assert failed is not None and failed["fields"]["status"] == 502
    # The failure's warning names the request, in its fields and in its span.
    warnings = [e for e in json_lines(log) if e["level"] == "WARN" and e["fields"].get("message") == "request failed"]
    assert warnings, "no 'request failed' warning"
    assert warnings[-1]["fields"]["request_id"] == bad.headers["x-request-id"]
    assert warnings[-1]["span"]["request_id"] == bad.headers["x-request-id"]
    assert warnings[-1]["span"]["client_request_id"] == "client-bad"
    # The same lines went to stderr as JSON too.
    assert any('"target":"pdgate::access"' in out for out in gw.output)


def test_an_unreachable_worker_is_logged_with_the_reason_and_shown_in_workers(mocks: MockHost, processes: Processes) -> None:
    alive = mocks.start(MockWorker())
    dead = "http://127.0.0.1:9"
    gw = launch(processes, ["--worker-urls", alive.url, dead, *FAST_HEALTH, "--admin-api-key", "adm"])
    gw.wait_ready()
    auth = {"Authorization": "Bearer adm"}

    def dead_entry() -> dict[str, Any] | None:
        workers = httpx.get(gw.url + "/workers", headers=auth, timeout=5).json()["workers"]
        entry = next(w for w in workers if w["url"] == dead)
        return entry if entry["last_error"] else None

    entry = wait_for(dead_entry)
    assert entry is not None, "no last_error for the dead worker"
    assert entry["last_error"]["reason"].startswith(f"health check: GET {dead}/health")
    assert entry["last_error"]["at"] > 0 and entry["healthy"] is False
    alive_entry = next(w for w in httpx.get(gw.url + "/workers", headers=auth, timeout=5).json()["workers"] if w["url"] == alive.url)
    assert alive_entry["last_error"] is None
    line = wait_for(lambda: next((o for o in gw.output if "worker unreachable" in o and dead in o), None))
    assert line is not None and "reason" in line, "".join(gw.output)
