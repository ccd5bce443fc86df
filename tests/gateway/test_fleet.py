"""The fleet at runtime, end to end: workers added, disabled and removed through the gateway's
`/workers` API and through `pdgate.Gateway`'s Python API while clients keep sending requests.

A clean removal drains: no request fails because of it, nothing new reaches the worker once the
DELETE was answered, and the worker is gone once its in-flight requests finished. New workers
take traffic at once; `/readiness` follows the last decode leaving and coming back.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator
from urllib.parse import quote

import httpx
import openai
import pytest

import pdgate
from pdgate._workers_api import WorkersApi
from pdgate.workers import ReferenceWorker
from tests.conftest import Processes
from tests.gateway.harness import wait_status
from tests.gateway.load import Load, Outcome
from tests.gateway.stacks import pd_stack
from tests.mock_workers import BootstrapDecode, BootstrapPrefill, MockHost, MockWorker

ADMIN = "admin-secret"
FAST = {"health_check_interval_secs": 1, "health_success_threshold": 1, "health_failure_threshold": 1}


def wait_until(what: str, predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"not {what} within {timeout}s")


def routed(role: str, url: str) -> Any:
    return lambda o: o.ok and o.route.get(role) == url


def assert_clean(outcomes: list[Outcome]) -> None:
    failures = [o.error for o in outcomes if not o.ok]
    assert not failures, f"{len(failures)} of {len(outcomes)} requests failed: {failures[:5]}"
    retried = [o.route for o in outcomes if o.route.get("attempts") != "1"]
    assert not retried, f"requests needed a retry (a drained worker was still picked?): {retried[:3]}"


@pytest.fixture
def reference() -> Iterator[Any]:
    """Starts reference workers (concurrently) and stops every one of them afterwards."""
    started: list[ReferenceWorker] = []

    def start(*modes: str) -> list[ReferenceWorker]:
        workers = [ReferenceWorker(mode=m, model="tiny") for m in modes]
        started.extend(workers)
        with ThreadPoolExecutor(len(workers)) as pool:
            list(pool.map(lambda w: w.start(timeout=60), workers))
        return workers

    try:
        yield start
    finally:
        for w in started:
            w.stop()


def test_python_api_changes_the_fleet_under_load(reference: Any) -> None:
    """In-process gateway, reference engines, bootstrap PD: add a decode and a prefill, remove
    the original ones (drain, then stop their processes) while 3 clients keep going."""
    p1, p2, d1, d2 = reference("prefill", "prefill", "decode", "decode")
    options = dict(pd_disaggregation=True, prefill=[[p1.url, p1.bootstrap_port]], decode=[d1.url], port=0,
                   admin_api_key=ADMIN, request_timeout_secs=30, **FAST)
    with pdgate.Gateway(**options) as gw:
        assert wait_status(gw.url + "/readiness", 200) == 200
        with Load(gw.url, "tiny", threads=3, max_tokens=24, limit=1500) as load:
            load.wait_for("served", lambda o: o.ok, count=5)

            added = gw.add_worker(d2.url, "decode", labels={"zone": "b"})
            assert (added["url"], added["worker_type"], added["source"], added["labels"]) == (d2.url, "decode", "api", {"zone": "b"})
            assert added["healthy"] and added["enabled"] and not added["draining"]
            load.wait_for("on the added decode", routed("decode", d2.url))
            added = gw.add_worker(p2.url, "prefill", bootstrap_port=p2.bootstrap_port)
            load.wait_for("on the added prefill", routed("prefill", p2.url))

            # Remove the original decode by URL, the original prefill by id; once each is gone
            # its process is stopped, as an operator would.
            p1_id = next(w["id"] for w in gw.list_workers() if w["url"] == p1.url)
            asked: dict[str, float] = {}
            gone: dict[str, float] = {}
            for key, worker in ((d1.url, d1), (p1_id, p1)):
                busy = lambda: any(w["url"] == worker.url and w["inflight"] for w in gw.list_workers())  # noqa: E731
                wait_until(f"a request in flight on {worker.url}", busy)
                asked[worker.url] = time.monotonic()
                answer = gw.remove_worker(key, wait=True, timeout=30)
                assert answer["status"] == "draining" and answer["url"] == worker.url
                gone[worker.url] = time.monotonic()
                worker.stop()
            load.wait_for("served after the removals", lambda o: o.ok and o.started > max(gone.values()), count=6)

        outcomes = load.snapshot()
        assert_clean(outcomes)
        for url, t in asked.items():  # the drains had something to wait for
            assert any(o.started < t < o.ended and url in o.route.values() for o in outcomes), url
        late = [o.route for o in outcomes for url, t in gone.items()
                if o.started > t and url in (o.route.get("prefill"), o.route.get("decode"))]
        assert not late, f"requests sent after a removal reached the removed worker: {late[:3]}"
        assert sorted(w["url"] for w in gw.list_workers()) == sorted([p2.url, d2.url])

        # /readiness as the last decode is disabled / leaves, and comes back.
        ready = gw.url + "/readiness"
        assert gw.set_worker_enabled(d2.url, False)["enabled"] is False
        assert wait_status(ready, 503) == 503
        assert gw.set_worker_enabled(d2.url, True)["enabled"] is True
        assert wait_status(ready, 200) == 200
        gw.remove_worker(d2.url, wait=True, timeout=30)
        assert wait_status(ready, 503) == 503
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=20)
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model="tiny", prompt="nobody decodes", max_tokens=4)
        assert refused.value.status_code == 503
        assert gw.add_worker(d2.url, "decode")["healthy"]
        assert wait_status(ready, 200) == 200
        assert client.completions.create(model="tiny", prompt="back again", max_tokens=4).choices[0].finish_reason


def test_workers_http_api_drains_under_load(mocks: MockHost, processes: Processes) -> None:
    """`pdgate launch` with an admin key, mock workers, raw `/workers` calls: a decode added by
    POST takes traffic; a DELETE (percent-encoded URL) drains a decode with streams in flight:
    they finish, nothing new reaches it, then it is gone."""
    stack = pd_stack(mocks, processes, "bootstrap", decode_knobs={"delay_s": 0.2},
                     args=["--admin-api-key", ADMIN, "--request-timeout-secs", "20"])
    d1 = stack.decode
    admin = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    with admin, Load(stack.url, "mock-model", threads=3, max_tokens=6, limit=1500) as load:
        load.wait_for("served", lambda o: o.ok, count=4)

        d2 = mocks.start(BootstrapDecode(delay_s=0.2))
        resp = admin.post("/workers", json={"url": d2.url, "worker_type": "decode", "labels": {"pool": "new"}})
        assert resp.status_code == 201, resp.text
        assert resp.json()["source"] == "api" and resp.json()["healthy"] is True
        load.wait_for("on the added decode", routed("decode", d2.url))

        # Slow d1 down so a request is surely in flight on it when the DELETE arrives.
        mocks.set_knobs(d1, delay_s=2.0)
        time.sleep(0.3)
        wait_until("a request in flight on d1", lambda: mocks.call(lambda: d1.pending) >= 1)
        resp = admin.delete("/workers/" + quote(d1.url, safe=""))
        removed_at = time.monotonic()
        assert resp.status_code == 202, resp.text
        assert resp.json()["status"] == "draining"
        seen = admin.get("/workers/" + quote(d1.url, safe=""))
        assert seen.status_code == 200 and seen.json()["draining"] is True and seen.json()["inflight"] >= 1
        received_at_delete = len(mocks.state(d1)["received"])
        wait_until("d1 removed", lambda: admin.get(f"/workers/{seen.json()['id']}").status_code == 404, timeout=15)
        assert mocks.wait_idle(d1, 2), "d1 was removed while a request was still in flight on it"
        assert len(mocks.state(d1)["received"]) == received_at_delete, "d1 got requests while draining"
        mocks.call(d1.stop)  # the operator stops the drained worker
        load.wait_for("served after the removal", lambda o: o.ok and o.started > removed_at + 2.5, count=4)

    outcomes = load.snapshot()
    assert_clean(outcomes)
    assert any(o.route.get("decode") == d1.url and o.started < removed_at < o.ended for o in outcomes), \
        "no request was in flight on d1 across the DELETE"
    assert not [o for o in outcomes if o.started > removed_at and o.route.get("decode") == d1.url]
    for worker in (stack.prefill, d2):
        assert mocks.state(worker)["violations"] == []

    # The last decode leaves: not ready, requests refused with 503; it comes back: ready.
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10) as admin:
        workers = admin.get("/workers").json()
        assert workers["total"] == 2 and {w["url"] for w in workers["workers"]} == {stack.prefill.url, d2.url}
        assert admin.delete("/workers/" + quote(d2.url, safe="")).status_code == 202
        assert wait_status(stack.url + "/readiness", 503) == 503
        wait_until("d2 removed", lambda: admin.get("/workers/" + quote(d2.url, safe="")).status_code == 404)
        refused = httpx.post(stack.url + "/v1/completions", json={"model": "mock-model", "prompt": "x", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503, refused.text
        assert admin.post("/workers", json={"url": d2.url, "worker_type": "decode"}).status_code == 201
        assert wait_status(stack.url + "/readiness", 200) == 200


ADMIN_CALLS = [
    ("GET", "/workers", None),
    ("POST", "/workers", {"url": "http://127.0.0.1:9", "worker_type": "decode"}),
    ("GET", "/workers/{id}", None),
    ("PUT", "/workers/{id}", {"enabled": False}),
    ("DELETE", "/workers/{id}", None),
]


def test_admin_key_is_enforced(mocks: MockHost, processes: Processes) -> None:
    stack = pd_stack(mocks, processes, "bootstrap", args=["--admin-api-key", ADMIN])
    good = {"Authorization": f"Bearer {ADMIN}"}
    before = httpx.get(stack.url + "/workers", headers=good, timeout=10).json()
    decode_id = next(w["id"] for w in before["workers"] if w["worker_type"] == "decode")
    for method, path, body in ADMIN_CALLS:
        url = stack.url + path.format(id=decode_id)
        for headers, status, code in (({}, 401, "missing_api_key"),
                                      ({"Authorization": "Bearer wrong"}, 403, "invalid_api_key"),
                                      ({"Authorization": ADMIN}, 401, "missing_api_key")):  # no "Bearer "
            resp = httpx.request(method, url, json=body, headers=headers, timeout=10)
            assert (resp.status_code, resp.json()["error"]["code"]) == (status, code), (method, path, headers, resp.text)
    after = httpx.get(stack.url + "/workers", headers=good, timeout=10).json()
    strip = lambda ws: [{k: w[k] for k in ("id", "url", "enabled", "draining")} for w in ws["workers"]]  # noqa: E731
    assert strip(after) == strip(before), "a refused admin call changed the fleet"
    # Probes, scrapers and (without --api-key) clients need no key.
    for path in ("/health", "/liveness", "/readiness", "/metrics"):
        assert httpx.get(stack.url + path, timeout=10).status_code == 200, path
    assert stack.client().completions.create(model="mock-model", prompt="a b", max_tokens=2).choices
    # The Python client maps the refusal onto the documented exception.
    with pytest.raises(pdgate.WorkerError) as refused:
        WorkersApi(stack.url, "wrong").list_workers()
    assert (refused.value.status, refused.value.code) == (403, "invalid_api_key")


def test_admin_api_is_closed_by_default(mocks: MockHost, processes: Processes) -> None:
    """No --admin-api-key: every worker API call is refused, --api-key does not open it, and
    the refusal says how to open it. The fleet is unchanged and clients are served."""
    stack = pd_stack(mocks, processes, "bootstrap", args=["--api-key", "client-key"])
    for method, path, body in ADMIN_CALLS:
        for headers in ({}, {"Authorization": "Bearer client-key"}):
            resp = httpx.request(method, stack.url + path.format(id="w0"), json=body, headers=headers, timeout=10)
            assert (resp.status_code, resp.json()["error"]["code"]) == (403, "admin_api_closed"), (method, path, resp.text)
            assert "--admin-api-key" in resp.json()["error"]["message"]
    assert httpx.get(stack.url + "/readiness", timeout=10).json()["admin_api"] == "closed"
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="client-key", max_retries=0, timeout=30)
    assert client.completions.create(model="mock-model", prompt="a b", max_tokens=2).choices


def test_admin_api_open_is_explicit_and_warned_about(mocks: MockHost, processes: Processes) -> None:
    stack = pd_stack(mocks, processes, "bootstrap", args=["--admin-api-open"])
    assert httpx.get(stack.url + "/workers", timeout=10).status_code == 200
    assert httpx.get(stack.url + "/readiness", timeout=10).json()["admin_api"] == "open"
    warnings = [line for line in stack.gateway.output if "WARN" in line and "--admin-api-open" in line]
    assert warnings, "no start-up warning:\n" + "".join(stack.gateway.output)


def test_an_embedded_gateway_manages_its_fleet_while_http_stays_closed(mocks: MockHost) -> None:
    """Without a key the Gateway object holds a private one: its own calls work, others' do not."""
    decode = mocks.start(BootstrapDecode())
    with pdgate.Gateway(pd_disaggregation=True, port=0, **FAST) as gw:
        assert gw.add_worker(decode.url, "decode")["worker_type"] == "decode"
        assert [w["url"] for w in gw.list_workers()] == [decode.url]
        resp = httpx.get(gw.url + "/workers", timeout=10)
        assert (resp.status_code, resp.json()["error"]["code"]) == (401, "missing_api_key")
        resp = httpx.get(gw.url + "/workers", headers={"Authorization": "Bearer guess"}, timeout=10)
        assert (resp.status_code, resp.json()["error"]["code"]) == (403, "invalid_api_key")
        assert gw.config["admin_api_key"] is None, "the private key is not part of the user's config"


def test_python_api_errors(mocks: MockHost) -> None:
    prefill = mocks.start(BootstrapPrefill())
    decode = mocks.start(BootstrapDecode())
    gateway = pdgate.Gateway(pd_disaggregation=True, port=0, admin_api_key=ADMIN, **FAST)
    with pytest.raises(pdgate.GatewayStateError):
        gateway.list_workers()
    with gateway as gw:
        assert gw.list_workers() == []
        assert gw.add_worker(decode.url, "decode")["worker_type"] == "decode"
        cases = [
            (lambda: gw.add_worker(decode.url, "decode"), 409, "conflict"),
            (lambda: gw.add_worker(prefill.url, "decode"), 400, "invalid_request"),  # /server_info says prefill
            (lambda: gw.add_worker(prefill.url), 400, "invalid_request"),  # PD mode needs a worker_type
            (lambda: gw.add_worker(prefill.url, "regular"), 400, "invalid_request"),
            (lambda: gw.add_worker("not a url", "decode"), 400, "invalid_request"),
            (lambda: gw.add_worker(decode.url + "1", "decode", bootstrap_port=8998), 400, "invalid_request"),
            (lambda: gw.remove_worker("http://127.0.0.1:9"), 404, "not_found"),
            (lambda: gw.set_worker_enabled("w000000000000", False), 404, "not_found"),
        ]
        for call, status, code in cases:
            with pytest.raises(pdgate.WorkerError) as err:
                call()
            assert (err.value.status, err.value.code) == (status, code), str(err.value)
        assert [w["url"] for w in gw.list_workers()] == [decode.url], "a refused call changed the fleet"
        # A KV connector and a Mooncake engine id are taken as given.
        added = gw.add_worker(prefill.url, "prefill", bootstrap_port=prefill.bootstrap_port, kv_connector="bootstrap")
        assert (added["bootstrap_port"], added["kv_connector"]) == (prefill.bootstrap_port, "bootstrap")
        assert wait_status(gw.url + "/readiness", 200) == 200
    with pytest.raises(pdgate.GatewayStateError):
        gateway.add_worker(decode.url, "decode")


def test_regular_mode_add_and_remove(mocks: MockHost) -> None:
    first, second = mocks.start(MockWorker()), mocks.start(MockWorker())
    with pdgate.Gateway(worker_urls=[first.url], port=0, request_timeout_secs=10, **FAST) as gw:
        assert gw.add_worker(second.url)["worker_type"] == "regular"  # the default outside PD mode
        with Load(gw.url, "mock-model", threads=2, max_tokens=4, limit=400) as load:
            load.wait_for("on the added worker", routed("worker", second.url))
            gw.remove_worker(first.url, wait=True, timeout=15)
            removed_at = time.monotonic()
            load.wait_for("served after the removal", lambda o: o.ok and o.started > removed_at, count=4)
        assert_clean(load.snapshot())
        assert not [o for o in load.snapshot() if o.started > removed_at and o.route.get("worker") == first.url]
        assert [w["url"] for w in gw.list_workers()] == [second.url]


def test_drain_is_bounded_by_the_request_timeout(mocks: MockHost) -> None:
    """A worker whose request never ends is removed anyway once the request timeout passed;
    `remove_worker(wait=True)` with a shorter timeout says so with `drain_timeout`."""
    stuck, spare = mocks.start(MockWorker(hang=True)), mocks.start(MockWorker())
    with pdgate.Gateway(worker_urls=[stuck.url], port=0, request_timeout_secs=2, **FAST) as gw:
        with ThreadPoolExecutor(1) as pool:
            hung = pool.submit(httpx.post, gw.url + "/v1/completions", timeout=10,
                               json={"model": "mock-model", "prompt": "x", "max_tokens": 2})
            assert mocks.wait_pending(stuck, 1)
            gw.add_worker(spare.url)
            with pytest.raises(pdgate.WorkerError) as err:
                gw.remove_worker(stuck.url, wait=True, timeout=0.5)
            assert (err.value.status, err.value.code) == (None, "drain_timeout")
            assert {w["url"]: w["draining"] for w in gw.list_workers()} == {stuck.url: True, spare.url: False}
            assert hung.result(timeout=10).status_code == 504
        wait_until("the stuck worker removed", lambda: [w["url"] for w in gw.list_workers()] == [spare.url], timeout=5)


# ---- regressions: gateway bugs these tests found --------------------------------------------------


def test_nixl_prefill_drain_waits_for_the_decode_pull(mocks: MockHost, processes: Processes) -> None:
    stack = pd_stack(mocks, processes, "nixl", decode_knobs={"delay_s": 1.0},
                     args=["--request-timeout-secs", "20", "--admin-api-key", ADMIN])
    p1 = stack.prefill
    p2 = mocks.start(type(p1)())
    admin = httpx.Client(base_url=stack.url, timeout=10, headers={"Authorization": f"Bearer {ADMIN}"})
    with admin:
        assert admin.post("/workers", json={"url": p2.url, "worker_type": "prefill"}).status_code == 201
        with Load(stack.url, "mock-model", threads=2, max_tokens=4, limit=200) as load:
            wait_until("KV held on p1 for a decode", lambda: mocks.state(p1)["held"] >= 1)
            assert admin.delete("/workers/" + quote(p1.url, safe="")).status_code == 202
            wait_until("p1 removed", lambda: admin.get("/workers/" + quote(p1.url, safe="")).status_code == 404)
            held = mocks.state(p1)["held"]
            mocks.call(p1.stop)
            load.wait_for("done", lambda o: True, count=len(load.snapshot()) + 4)
    assert_clean(load.snapshot())
    assert held == 0, f"the drained prefill was removed while {held} decode(s) had still to pull its KV"


def test_worker_url_with_trailing_slash_names_it_for_every_call(mocks: MockHost) -> None:
    worker = mocks.start(MockWorker())
    with pdgate.Gateway(worker_urls=[worker.url], port=0, admin_api_open=True, **FAST) as gw:
        key = "/workers/" + quote(worker.url + "/", safe="")
        assert httpx.get(gw.url + key, timeout=5).status_code == 200
        assert httpx.put(gw.url + key, json={"enabled": False}, timeout=5).status_code == 200
        assert httpx.delete(gw.url + key, timeout=5).status_code == 202

