"""EPD faults through the gateway (issue 31, item 5): encode workers that hang, answer garbage or
offer an embedding the prefill refuses (`--fault-encode hang|garbage|bad-embedding` on
`tiny-mm` reference encode workers), and a client that hangs up while an embedding waits.

What must hold after each: the request is retried on a sound encode worker before its first
byte (and then answers what the colocated worker answers) or fails with the encode leg's own
error within its deadline; the faulty encode worker's breaker opens, the prefill's does not;
the prefill and the decode end idle (no live request, no page reserved) and no encode worker
keeps an embedding or a registration waiting (`embeddings_waiting_for_prefill` == 0).

The engines keep their default bootstrap timeout (300 s), so anything released within
`IDLE_WITHIN_S` was released by an abort, never by an expiry.

Two bugs kept this module out of the suite until 2026-12-07: the gateway blamed a decode whose
KV source failed before the prefill leg named the image (now it waits for the prefill leg's
outcome: `exec/commit.rs`, `settle_kv_source`), and an abort that met a bootstrap lookup's
answer in the same loop step was lost on Python 3.11 (`asyncio.wait_for`), leaving the decode
registered on the prefill for 300 s (now `transfer/context.py`'s `with_timeout`).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import httpx
import pytest

import pdgate
from pdgate.workers import ReferenceWorker
from tests.gateway.harness import wait_status
from tests.gateway.test_aborts_free_memory import wait_idle
from tests.gateway.test_epd_gateway import MODEL, NOISE, RED, chat, encode_field, loads, mm, start

pytestmark = pytest.mark.timeout(300)
IDLE_WITHIN_S = 10
ENCODE_TIMEOUT_S = 2


def waiting(w: ReferenceWorker) -> int:
    return int(loads(w)["multimodal"]["embeddings_waiting_for_prefill"])


def held_by(w: ReferenceWorker) -> dict[str, Any]:
    ld = loads(w)
    dis = ld["disaggregation"]
    return {"live": ld["num_live_reqs"], "registrations": dis["pending_registrations"],
            "transfers": dis["transfers_in_flight"], "held_for_pull": dis["held_for_pull"]}


def wait_for(what: str, check: Callable[[], bool], within: float = IDLE_WITHIN_S) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {within}s: {what}")


def breakers(gw: pdgate.Gateway) -> dict[str, str]:
    listed = httpx.get(gw.url + "/workers", timeout=10).json()
    workers = listed["workers"] if isinstance(listed, dict) else listed
    return {w["url"]: w["breaker"] for w in workers}


def leg_errors(gw: pdgate.Gateway, code: str) -> float:
    """`pdgate_worker_errors_total{leg="encode",code=...}` (0 when absent)."""
    for row in httpx.get(gw.url + "/metrics", timeout=10).text.splitlines():
        if row.startswith("pdgate_worker_errors_total{") and 'leg="encode"' in row and f'code="{code}"' in row:
            return float(row.split()[-1])
    return 0.0


class Fleet:
    def __init__(self) -> None:
        self.colo = ReferenceWorker(mode="null", model=MODEL)
        self.good = ReferenceWorker(mode="encode", model=MODEL)
        self.faulty = {f: ReferenceWorker(mode="encode", model=MODEL, extra_args=["--fault-encode", f])
                       for f in ("hang", "garbage", "bad-embedding")}
        self.prefill = ReferenceWorker(mode="prefill", model=MODEL)
        self.decode = ReferenceWorker(mode="decode", model=MODEL)
        self.encoders = [self.good, *self.faulty.values()]
        self.all = [self.colo, *self.encoders, self.prefill, self.decode]

    def gateway(self, encoders: list[ReferenceWorker], **extra: Any) -> pdgate.Gateway:
        options: dict[str, Any] = dict(
            epd_disaggregation=True, port=0, request_timeout_secs=60, encode_timeout_secs=ENCODE_TIMEOUT_S,
            encode=[[e.url, e.bootstrap_port] for e in encoders], encode_policy="round_robin",
            prefill=[[self.prefill.url, self.prefill.bootstrap_port]], decode=[self.decode.url],
            health_check_interval_secs=1, health_success_threshold=1, breaker_failure_threshold=1,
            breaker_cooldown_secs=600, retry_max_retries=3, admin_api_open=True)
        options.update(extra)
        return pdgate.Gateway(**options)

    def clean(self) -> None:
        """No request left on the prefill or the decode, nothing waiting on any encode worker."""
        try:
            wait_idle([self.prefill, self.decode], IDLE_WITHIN_S)
        except AssertionError as e:  # say what is held, not only the pages
            held = {w.url: held_by(w) for w in (self.prefill, self.decode)}
            raise AssertionError(f"{e}; held: {held}") from None
        for e in self.encoders:
            wait_for(f"{e.url} holds no embedding", lambda: waiting(e) == 0)


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    f = Fleet()
    start(f.all)
    try:
        yield f
    finally:
        for w in f.all:
            w.stop()


def colocated(fleet: Fleet, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(fleet.colo.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# bad-embedding and the killed encode worker: when the prefill cannot get an embedding, the
# bootstrap decode fails too ("KV source failed"), often heard first; the gateway waits for the
# prefill leg's outcome before it blames the decode, so the encode worker is blamed and avoided.
@pytest.mark.parametrize("fault,code", [("hang", "encode_timeout"), ("garbage", "encode_bad_response"),
                                        ("bad-embedding", "encode_bad_response")])
def test_a_faulty_encode_worker_is_retried_on_a_sound_one_and_its_breaker_opens(fleet: Fleet, fault: str, code: str) -> None:
    """Round robin over [faulty, good]: the first image request that meets the faulty worker
    fails that attempt on the encode leg and is retried on the good one; the faulty worker's
    breaker opens (threshold 1), so every later request goes to the good one at once.

    Round robin steps once per sequence number, and an image request and a text request take
    different counts of them, so round j sends j text requests before its image request: some
    round's image meets the faulty worker, whatever the counts are."""
    bad = fleet.faulty[fault]
    received = mm(fleet.prefill)["received"]
    images = 0
    with fleet.gateway([bad, fleet.good]) as gw:
        assert wait_status(gw.url + "/readiness", 200) == 200
        routes: list[str] = []

        def image_request(parts: tuple[str, ...]) -> str:
            body = chat(*parts, max_tokens=6)
            want = colocated(fleet, body)
            r = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"], parts
            route = r.headers["x-pdgate-route"]
            assert encode_field(route) == [fleet.good.url], route  # the attempt that answered
            return route

        for j in range(4):
            for _ in range(j):
                t = httpx.post(gw.url + "/v1/chat/completions", json=chat("text", max_tokens=2), timeout=60)
                assert t.status_code == 200, t.text
            routes.append(image_request(("describe: ", f"img:{RED}")))
            images += 1
            if "attempts=2" in routes[-1]:
                break
        assert sum("attempts=2" in r for r in routes) == 1, routes
        assert leg_errors(gw, code) == 1
        states = breakers(gw)
        assert states[bad.url] == "open", states
        assert states[fleet.prefill.url] == "closed" and states[fleet.good.url] == "closed", states
        # the breaker is open: the next images go straight to the good worker
        for parts in ((f"img:{NOISE}", " and this?"), ("again ", f"img:{RED}")):
            assert "attempts=1" in image_request(parts)
            images += 1
        assert leg_errors(gw, code) == 1
    # every image the prefill used came from the good encode worker (none computed, none taken
    # from the faulty one: a refused embedding is not counted as received)
    assert mm(fleet.prefill)["received"] == received + images
    fleet.clean()


def test_a_half_open_encode_worker_takes_one_probe_request_at_a_time(fleet: Fleet) -> None:
    """Once its cool-down has passed, a hanging encode worker's breaker is half-open: of six
    image requests sent at once, one is its probe (it times out and is retried on the sound
    worker) and the other five are placed on the sound worker at once, as a half-open prefill
    or decode would be. Before encode workers were admitted by their breaker, round robin sent
    the half-open worker about half of them, each to wait out --encode-timeout-secs."""
    hang = fleet.faulty["hang"]
    with fleet.gateway([hang, fleet.good], breaker_cooldown_secs=3) as gw:
        assert wait_status(gw.url + "/readiness", 200) == 200
        # open its breaker: some round's image meets it (see the first test for the text shifts)
        for j in range(4):
            for _ in range(j):
                assert httpx.post(gw.url + "/v1/chat/completions", json=chat("text", max_tokens=2), timeout=60).status_code == 200
            r = httpx.post(gw.url + "/v1/chat/completions", json=chat("open: ", f"img:{RED}", max_tokens=3), timeout=60)
            assert r.status_code == 200, r.text
            if "attempts=2" in r.headers["x-pdgate-route"]:
                break
        assert leg_errors(gw, "encode_timeout") == 1
        wait_for("the hanging worker's breaker half-open", lambda: breakers(gw)[hang.url] == "half_open", 15)
        bodies = [chat(f"probe {i}: ", f"img:{NOISE}", max_tokens=3) for i in range(6)]
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: httpx.post(gw.url + "/v1/chat/completions", json=b, timeout=60), bodies))
        for r in answers:
            assert r.status_code == 200, r.text
            assert encode_field(r.headers["x-pdgate-route"]) == [fleet.good.url], r.headers["x-pdgate-route"]
        routes = [r.headers["x-pdgate-route"] for r in answers]
        assert sum("attempts=2" in route for route in routes) == 1, routes
        assert leg_errors(gw, "encode_timeout") == 2, "one probe, not one call per request that picked it"
        assert breakers(gw)[hang.url] in ("open", "half_open")
    fleet.clean()


def test_epd_readiness_waits_for_an_encode_worker(fleet: Fleet) -> None:
    """An EPD gateway whose prefill and decode are healthy but whose one encode worker is not
    (nothing listens there) is not ready, and its readiness says why (`healthy_encode: 0`); it
    becomes ready once a sound encode worker is added through the worker API."""
    down = socket.socket()
    down.bind(("127.0.0.1", 0))  # a port nobody listens on: connections are refused
    try:
        with fleet.gateway([]) as gw:
            wait_for("the prefill and decode healthy", lambda: all(
                w["healthy"] for w in httpx.get(gw.url + "/workers", timeout=10).json()["workers"]), 30)
            r = httpx.get(gw.url + "/readiness", timeout=10)
            assert r.status_code == 503, r.text
            body = r.json()
            assert (body["status"], body["healthy_encode"], body["healthy_prefill"], body["healthy_decode"]) == ("not_ready", 0, 1, 1), body
            added = httpx.post(gw.url + "/workers", json={"url": f"http://127.0.0.1:{down.getsockname()[1]}", "worker_type": "encode",
                                                          "bootstrap_port": fleet.good.bootstrap_port}, timeout=10)
            assert added.status_code == 201, added.text
            time.sleep(2)  # two health rounds: the unreachable worker is never healthy
            assert httpx.get(gw.url + "/readiness", timeout=10).status_code == 503
            added = httpx.post(gw.url + "/workers", json={"url": fleet.good.url, "worker_type": "encode",
                                                          "bootstrap_port": fleet.good.bootstrap_port}, timeout=10)
            assert added.status_code == 201, added.text
            assert wait_status(gw.url + "/readiness", 200) == 200
            assert httpx.get(gw.url + "/readiness", timeout=10).json()["healthy_encode"] == 1
    finally:
        down.close()


def test_a_hanging_only_encode_worker_fails_the_request_with_encode_timeout(fleet: Fleet) -> None:
    """No sound encode worker: each attempt ends at --encode-timeout-secs (not at the request's
    60 s deadline: the code says which), the request fails with 504 `encode_timeout`, and
    nothing is left waiting anywhere (the hung call was aborted at the encode worker)."""
    hang = fleet.faulty["hang"]
    with fleet.gateway([hang], breaker_failure_threshold=5, retry_max_retries=2) as gw:
        assert wait_status(gw.url + "/readiness", 200) == 200
        r = httpx.post(gw.url + "/v1/chat/completions", json=chat("look: ", f"img:{RED}"), timeout=60)
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "encode_timeout", r.text
        assert "--encode-timeout-secs" in r.json()["error"]["message"]
        assert "attempts=2" in r.headers["x-pdgate-route"], r.headers["x-pdgate-route"]
        # text still works: it needs no encode worker
        ok = httpx.post(gw.url + "/v1/chat/completions", json=chat("just text", max_tokens=3), timeout=60)
        assert ok.status_code == 200, ok.text
    fleet.clean()


@pytest.mark.parametrize("fault", ["garbage", "bad-embedding"])
def test_many_attempts_failed_by_an_encode_worker_leave_nothing_held(fleet: Fleet, fault: str) -> None:
    """The faulty worker's breaker never opens here, so round robin keeps sending it images and
    every such attempt is given up and retried on the sound worker: a dozen aborts of the
    prefill and the decode while their bootstrap is under way. Every request still answers
    what the colocated worker answers, and afterwards nothing is held anywhere. (Before the
    engines' `with_timeout` fix, an abort that met the decode's bootstrap lookup in the same
    loop step was lost: the decode went on to register on the prefill and both held that
    registration for the 300 s bootstrap timeout; this test then failed 3 runs of 3. With
    bad-embedding, each of those attempts was also a 502 `decode_error` before the gateway
    waited for the prefill leg's outcome.)"""
    bad = fleet.faulty[fault]
    bodies = [chat("many: ", f"img:{RED}", max_tokens=4), chat(f"img:{NOISE}", " many", max_tokens=4)]
    want = [colocated(fleet, b)["choices"][0]["token_ids"] for b in bodies]
    retried = 0
    with fleet.gateway([bad, fleet.good], breaker_failure_threshold=1000) as gw:
        assert wait_status(gw.url + "/readiness", 200) == 200
        for i in range(24):
            if i % 3 == 1:  # shifts round robin's step, so images meet both workers
                t = httpx.post(gw.url + "/v1/chat/completions", json=chat("text", max_tokens=2), timeout=60)
                assert t.status_code == 200, t.text
            r = httpx.post(gw.url + "/v1/chat/completions", json=bodies[i % 2], timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want[i % 2]
            route = r.headers["x-pdgate-route"]
            assert encode_field(route) == [fleet.good.url], route
            retried += "attempts=2" in route
        assert retried >= 2, retried
        assert breakers(gw)[fleet.prefill.url] == "closed" and breakers(gw)[fleet.decode.url] == "closed"
    fleet.clean()


class BlackHole:
    """A decode that takes connections and requests and never answers: the prefill then waits
    for its registration, and the encode worker's embedding waits for the prefill."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def test_a_client_that_hangs_up_leaves_no_embedding_pinned(fleet: Fleet) -> None:
    """The client hangs up while its image's embedding waits on the encode worker (the prefill
    is still waiting for a decode that never registers). The gateway drops the attempt and
    aborts every leg it sent, the encode call's rooms included: the embedding is freed at once,
    not at the engines' 300 s bootstrap timeout."""
    hole = BlackHole()
    try:
        with fleet.gateway([fleet.good], decode=[hole.url], disable_health_check=True) as gw:
            assert wait_status(gw.url + "/readiness", 200) == 200
            body = chat("hang up on me: ", f"img:{NOISE}", max_tokens=4)
            body["stream"] = True
            host, port = gw.url.removeprefix("http://").split(":")
            payload = json.dumps(body).encode()
            client = socket.create_connection((host, int(port)), timeout=30)
            client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                           + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            # the embedding is ready and waits for a prefill that waits for the decode
            wait_for("the embedding waits on the encode worker", lambda: waiting(fleet.good) == 1)
            assert loads(fleet.prefill)["num_live_reqs"] == 1
            client.close()
            wait_for("the encode worker dropped the embedding", lambda: waiting(fleet.good) == 0)
            wait_idle([fleet.prefill], IDLE_WITHIN_S)
    finally:
        hole.close()
    fleet.clean()


def test_an_encode_worker_killed_mid_request_is_retried_on_a_sound_one(fleet: Fleet) -> None:
    """The only encode worker takes the image and hangs (the prefill already waits on its
    bootstrap server for the embedding); a sound one joins through `POST /workers`; then the
    first is SIGKILLed. The encode call breaks (`encode_unavailable`), or the prefill's transfer
    from it does (`encode_bad_response`, the failure still the encode worker's); the attempt is
    retried before the first byte on the sound worker, and the answer is the colocated one."""
    doomed = ReferenceWorker(mode="encode", model=MODEL, extra_args=["--fault-encode", "hang"])
    doomed.start(timeout=90)
    try:
        with fleet.gateway([doomed], encode_timeout_secs=120, breaker_failure_threshold=5) as gw:
            assert wait_status(gw.url + "/readiness", 200) == 200
            body = chat("killed: ", f"img:{NOISE}", max_tokens=6)
            want = colocated(fleet, body)
            result: dict[str, Any] = {}

            def send() -> None:
                result["r"] = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=120)

            sender = threading.Thread(target=send)
            sender.start()
            # the prefill registered for the embedding on the doomed worker: the request is in flight there
            wait_for("the prefill waits on the doomed encode worker", lambda: waiting(doomed) == 1, 30)
            added = httpx.post(gw.url + "/workers", json={"url": fleet.good.url, "worker_type": "encode",
                                                          "bootstrap_port": fleet.good.bootstrap_port}, timeout=10)
            assert added.status_code == 201, added.text
            wait_for("the sound encode worker is healthy", lambda: any(
                w["url"] == fleet.good.url and w["healthy"] for w in httpx.get(gw.url + "/workers", timeout=10).json()["workers"]), 30)
            doomed.kill()
            sender.join(120)
            r = result["r"]
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
            route = r.headers["x-pdgate-route"]
            assert encode_field(route) == [fleet.good.url] and "attempts=2" in route, route
            # one failed encode leg: the encode call's broken connection, or the prefill's broken
            # embedding transfer from the same worker, blamed on it (whichever ends first)
            codes = {c: leg_errors(gw, c) for c in ("encode_unavailable", "encode_bad_response")}
            assert sum(codes.values()) == 1, codes
            assert breakers(gw)[fleet.prefill.url] == "closed"
    finally:
        doomed.stop()
    fleet.clean()
