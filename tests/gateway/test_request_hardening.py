"""What one client may put in a request, end to end (issue 11): `pdgate launch` in front of
reference engines.

- `"n": 1000000000000` used to abort the gateway process (SIGABRT collecting rooms): now a 400
  naming `n`, and the same process serves the next request.
- `max_tokens` beyond the model's context length (learned from the workers' `/v1/models`
  `max_model_len`) is a 400 at once instead of waiting out the deadline.
- Twenty requests sharing one `X-Request-Id`, four at a time, used to collide on the NIXL prefill
  (13 transfers failed, 220 pages pinned until the lease ran out): the gateway now mints a fresh
  id per attempt, so all succeed and no prefill page stays pinned; the same for Mooncake.
- An unsafe client id is never echoed (it was the response id: `cmpl-../../etc;room=1`).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import httpx
import pytest

from pdgate.workers import ReferenceWorker
from tests.conftest import Processes
from tests.gateway.harness import GatewayProcess, launch
from tests.gateway.stacks import FAST_HEALTH

pytestmark = pytest.mark.timeout(180)

CONNECTORS = {"nixl": "NixlConnector", "mooncake": "MooncakeConnector"}


def wait_until(what: str, predicate: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"not {what} within {timeout}s")


@pytest.fixture(scope="module", params=sorted(CONNECTORS))
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[str, ReferenceWorker, ReferenceWorker]]:
    """A reference prefill/decode pair per vLLM connector, shared by the tests of the module."""
    connector = CONNECTORS[request.param]
    p = ReferenceWorker(mode="prefill", kv_connector=connector)
    d = ReferenceWorker(mode="decode", kv_connector=connector)
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda w: w.start(timeout=90), (p, d)))
        yield request.param, p, d
    finally:
        p.stop()
        d.stop()


def gateway(processes: Processes, pair: tuple[str, ReferenceWorker, ReferenceWorker]) -> GatewayProcess:
    kind, p, d = pair
    gw = launch(processes, ["--pd-disaggregation", "--kv-connector", kind, *FAST_HEALTH,
                            "--prefill", p.url, str(p.bootstrap_port), "--decode", d.url,
                            "--request-timeout-secs", "60"])
    gw.wait_ready()
    # The context length arrives with the engine facts, right after the workers turn healthy.
    wait_until("models learned", lambda: httpx.get(gw.url + "/v1/models", timeout=5).json()["data"])
    return gw


def completion(url: str, body: dict, request_id: str | None = None, timeout: float = 60) -> httpx.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    return httpx.post(url + "/v1/completions", json={"prompt": "The quick brown fox", **body}, headers=headers,
                      timeout=timeout)


def prefill_state(w: ReferenceWorker) -> dict:
    return httpx.get(w.url + "/v1/loads", timeout=10).json()["loads"][0]


def prefill_idle(w: ReferenceWorker) -> bool:
    ld = prefill_state(w)
    kv = ld["kv_pages"]
    return (kv["pinned"] == kv["reserved"] == kv["in_use"] == 0 and kv["free"] + kv.get("cached", 0) == kv["total"]
            and ld["disaggregation"]["held_for_pull"] == 0 and ld["num_live_reqs"] == 0)


def test_huge_n_is_400_and_the_process_keeps_serving(processes: Processes, pair: Any) -> None:
    gw = gateway(processes, pair)
    for n in (1_000_000_000_000, 1 << 62, 1_000_000, 10_000):
        r = completion(gw.url, {"n": n, "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "n"
    assert gw.proc.poll() is None, "the gateway process is alive:\n" + "".join(gw.output[-20:])
    r = completion(gw.url, {"max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"]


def test_bootstrap_mode_survives_huge_n_and_batches(processes: Processes) -> None:
    """The SIGABRT was here: bootstrap mode minted one room per item before anything was checked."""
    p = ReferenceWorker(mode="prefill")
    d = ReferenceWorker(mode="decode")
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda w: w.start(timeout=90), (p, d)))
        gw = launch(processes, ["--pd-disaggregation", *FAST_HEALTH, "--prefill", p.url, str(p.bootstrap_port),
                                "--decode", d.url, "--request-timeout-secs", "60"])
        gw.wait_ready()
        refused = [
            ("/v1/completions", {"prompt": "x", "n": 1_000_000_000_000}, "n"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 10_000, "stream": True}, "n"),
            ("/generate", {"text": "x", "sampling_params": {"n": 10_000}}, "sampling_params.n"),
            ("/generate", {"text": [f"t{i}" for i in range(20_000)]}, "text"),
        ]
        for path, body, param in refused:
            r = httpx.post(gw.url + path, json=body, timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.status_code, r.text[:200])
        assert gw.proc.poll() is None, "the gateway process is alive:\n" + "".join(gw.output[-20:])
        r = httpx.post(gw.url + "/generate", json={"text": [f"item {i}" for i in range(16)],
                                                    "sampling_params": {"max_new_tokens": 2, "temperature": 0}}, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()) == 16
        assert "rooms=16,digest=" in r.headers["x-pdgate-route"], r.headers["x-pdgate-route"]
    finally:
        p.stop()
        d.stop()


def test_max_tokens_beyond_the_context_length_is_400(processes: Processes, pair: Any) -> None:
    gw = gateway(processes, pair)
    context = httpx.get(pair[2].url + "/v1/models", timeout=5).json()["data"][0]["max_model_len"]
    for asked in (2**64 - 1, 10**7, context + 1):
        r = completion(gw.url, {"max_tokens": asked}, timeout=10)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "max_tokens" and str(context) in err["message"], err
    assert prefill_idle(pair[1])


def test_a_shared_client_id_never_collides_and_no_page_stays_pinned(processes: Processes, pair: Any) -> None:
    kind, p, _d = pair
    gw = gateway(processes, pair)

    def one(i: int) -> httpx.Response:
        return completion(gw.url, {"max_tokens": 4, "temperature": 0, "prompt": f"request {i} shares an id"},
                          request_id="shared-client-id")

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(one, range(20)))
    failures = [(r.status_code, r.text[:200]) for r in answers if r.status_code != 200]
    assert not failures, f"{len(failures)} of 20 failed: {failures[:3]}"
    ids = {r.headers["x-request-id"] for r in answers}
    assert len(ids) == 20 and all(i.startswith("shared-client-id-") for i in ids), ids
    assert {r.headers["x-client-request-id"] for r in answers} == {"shared-client-id"}
    assert {r.json()["id"] for r in answers} == {f"cmpl-{i}" for i in ids}, "the engine's response id is the minted one"
    # Everything the prefills published was pulled (or pushed): nothing waits for a lease.
    wait_until(f"{kind} prefill idle: {prefill_state(p)}", lambda: prefill_idle(p), timeout=10)


def test_an_unsafe_client_id_is_replaced(processes: Processes, pair: Any) -> None:
    gw = gateway(processes, pair)
    r = completion(gw.url, {"max_tokens": 2}, request_id="cmpl-../../etc;room=1")
    assert r.status_code == 200, r.text
    assert "x-client-request-id" not in r.headers
    assert r.headers["x-request-id"].startswith("pdgate-")
    assert "etc" not in r.json()["id"] and ";" not in r.json()["id"], r.json()["id"]
