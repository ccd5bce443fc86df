"""SMG's options with SMG's meaning, end to end: the retry budget (measured against SMG itself
when it is installed), admission (--max-concurrent-requests / --queue-size), the metrics
listener (--prometheus-port) and the control-plane keys."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pdgate.workers import free_port

from tests.conftest import Processes
from tests.gateway.harness import wait_status
from tests.gateway.stacks import pd_stack, regular_stack
from tests.mock_workers import BootstrapDecode, BootstrapPrefill, MockHost

FAST_RETRY = ["--retry-initial-backoff-ms", "1", "--retry-max-backoff-ms", "5"]
BODY = {"model": "mock-model", "prompt": "hi", "max_tokens": 4}


def decode_hits(mocks: MockHost, decode: object) -> int:
    return len(mocks.state(decode)["received"])


@pytest.mark.parametrize("max_retries", [1, 2, 3])
def test_retry_max_retries_counts_every_attempt(mocks: MockHost, processes: Processes, max_retries: int) -> None:
    # The breaker is off so that it cannot cut the attempts short.
    stack = pd_stack(mocks, processes, "bootstrap", decode_knobs={"fail_status": 503},
                     args=["--retry-max-retries", str(max_retries), "--disable-circuit-breaker", *FAST_RETRY])
    r = httpx.post(stack.url + "/v1/completions", json=BODY, timeout=30)
    assert r.status_code == 502, r.text
    assert decode_hits(mocks, stack.decode) == max_retries
    assert f"attempts={max_retries}" in r.headers["x-pdgate-route"]


def test_disable_retries_sends_one_attempt(mocks: MockHost, processes: Processes) -> None:
    stack = pd_stack(mocks, processes, "bootstrap", decode_knobs={"fail_status": 503},
                     args=["--retry-max-retries", "5", "--disable-retries", "--disable-circuit-breaker"])
    httpx.post(stack.url + "/v1/completions", json=BODY, timeout=30)
    assert decode_hits(mocks, stack.decode) == 1


def smg_binary() -> str | None:
    beside = pathlib.Path(sys.executable).parent / "smg"
    return str(beside) if beside.exists() else shutil.which("smg")


@pytest.mark.parametrize("max_retries", [1, 3])
def test_retry_count_is_the_same_as_smgs(mocks: MockHost, processes: Processes, max_retries: int) -> None:
    """The same failing decode behind SMG 1.13 and behind pdgate: as many decode hits."""
    smg = smg_binary()
    if smg is None:
        pytest.skip("smg is not installed (pip install smg==1.13.0)")
    hits = {}
    for router in ("smg", "pdgate"):
        p = mocks.start(BootstrapPrefill())
        d = mocks.start(BootstrapDecode(fail_status=503))
        flags = ["--pd-disaggregation", "--prefill", p.url, str(p.bootstrap_port), "--decode", d.url,
                 "--policy", "round_robin", "--retry-max-retries", str(max_retries), *FAST_RETRY, "--disable-circuit-breaker"]
        if router == "smg":
            port = free_port()
            cmd = [smg, "launch", "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()), *flags]
            proc = processes.popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            url = f"http://127.0.0.1:{port}"
            assert wait_status(url + "/readiness", 200, timeout=60) == 200, "smg did not become ready"
        else:
            from tests.gateway.harness import launch

            gw = launch(processes, flags)
            gw.wait_ready()
            url = gw.url
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=30)
        assert r.status_code >= 500, (router, r.status_code, r.text)
        hits[router] = decode_hits(mocks, d)
        if router == "smg":
            proc.terminate()
    assert hits["pdgate"] == hits["smg"] == max_retries, hits


def test_concurrency_limit_queues_then_refuses_429_and_times_out_408(mocks: MockHost, processes: Processes) -> None:
    stack = regular_stack(mocks, processes, args=["--max-concurrent-requests", "1", "--queue-size", "1", "--queue-timeout-secs", "1"])
    worker = stack.workers["regular"][0]
    mocks.set_knobs(worker, hang=True)
    results: dict[str, int] = {}

    def send(name: str) -> None:
        try:
            results[name] = httpx.post(stack.url + "/v1/completions", json=BODY, timeout=3).status_code
        except httpx.TimeoutException:
            results[name] = -1

    running = threading.Thread(target=send, args=("running",))
    running.start()
    assert mocks.wait_pending(worker, 1), "the first request did not reach the worker"
    queued = threading.Thread(target=send, args=("queued",))
    queued.start()
    # The queue holds one: wait until it does, then one more is refused at once.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and "pdgate_admission_waiting 1" not in httpx.get(stack.url + "/metrics").text:
        time.sleep(0.02)
    third = httpx.post(stack.url + "/v1/completions", json=BODY, timeout=5)
    queued.join(10)
    assert third.status_code == 429, third.text
    assert third.json()["error"]["code"] == "too_many_requests"
    assert results["queued"] == 408, results
    running.join(10)
    metrics = httpx.get(stack.url + "/metrics").text
    assert 'pdgate_admission_refused_total{reason="queue_full"} 1' in metrics
    assert 'pdgate_admission_refused_total{reason="queue_timeout"} 1' in metrics


def test_prometheus_port_serves_metrics_and_the_main_port_keeps_them(mocks: MockHost, processes: Processes) -> None:
    port = free_port()
    stack = regular_stack(mocks, processes, args=["--prometheus-port", str(port)])
    own = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert own.status_code == 200 and "pdgate_requests_total" in own.text
    assert httpx.get(stack.url + "/metrics", timeout=5).status_code == 200
    # Only metrics there: the API is not served on the metrics listener.
    assert httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=BODY, timeout=5).status_code == 404


def test_control_plane_admin_key_opens_the_worker_api(mocks: MockHost, processes: Processes) -> None:
    stack = regular_stack(mocks, processes, args=["--control-plane-api-keys", "k1:Ops:admin:cp-secret"])
    assert httpx.get(stack.url + "/workers", timeout=5).status_code == 401
    assert httpx.get(stack.url + "/workers", headers={"Authorization": "Bearer wrong"}, timeout=5).status_code == 403
    ok = httpx.get(stack.url + "/workers", headers={"Authorization": "Bearer cp-secret"}, timeout=5)
    assert ok.status_code == 200 and ok.json()["total"] == 1


def test_disable_health_check_counts_workers_healthy_without_asking_them(processes: Processes) -> None:
    from tests.gateway.harness import launch

    dead = "http://127.0.0.1:9"
    checked = launch(processes, ["--worker-urls", dead, "--health-check-interval-secs", "1"])
    assert wait_status(checked.url + "/readiness", 200, timeout=3) == 503, "a dead worker is unhealthy when checked"
    unchecked = launch(processes, ["--worker-urls", dead, "--health-check-interval-secs", "1", "--disable-health-check"])
    assert wait_status(unchecked.url + "/readiness", 200, timeout=10) == 200
    # The breaker still takes it out once requests fail.
    r = httpx.post(unchecked.url + "/v1/completions", json=BODY, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "worker_unavailable"


def test_an_unusable_log_dir_stops_the_start_with_the_reason(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = subprocess.run([sys.executable, "-m", "pdgate.cli", "launch", "--port", "0", "--log-dir", str(blocker / "logs")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--log-dir" in out.stderr and str(blocker / "logs") in out.stderr
