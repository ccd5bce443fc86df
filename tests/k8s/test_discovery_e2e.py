"""End to end: the real `pdgate launch --service-discovery` process against the fake API server.

Pods are created, made Ready, relabeled, marked terminating and deleted with the official
Kubernetes client; they point (pod IP 127.0.0.1, port from the `pdgate.ai/port` annotation) at
real reference-engine workers on loopback. Requests through the gateway must keep succeeding as
workers come and go, and the gateway's worker set must converge to the pods' truth after watch
drops, server-closed watches and 410s.
"""

from __future__ import annotations

import pathlib
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import httpx
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "gateway"))

from apiserver import FakeApiServer  # noqa: E402
from harness import GatewayProcess, launch  # noqa: E402
from pods import create_pod, delete_pod, relabel, set_ready, terminate  # noqa: E402

pytest.importorskip("pdgate._core", reason="needs the compiled gateway (pip install .)")

NS = "ml"
CONVERGE_S = 8.0
# The worker API is closed without a key; these tests read it (and add a worker by hand).
ADMIN = "k8s-admin-key"
ADMIN_HEADERS = {"Authorization": f"Bearer {ADMIN}"}
DISCOVERY_ARGS = ["--pd-disaggregation", "--service-discovery", "--prefill-selector", "app=p", "--decode-selector", "app=d",
                  "--service-discovery-namespace", NS, "--health-check-interval-secs", "1", "--admin-api-key", ADMIN]


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Any]]:
    """Two prefill and two decode reference workers, shared by the tests of this module."""
    from pdgate.workers import ReferenceWorker

    workers = {name: ReferenceWorker(mode="prefill" if name.startswith("p") else "decode", model="tiny")
               for name in ("p1", "p2", "d1", "d2")}
    try:
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda w: w.start(), workers.values()))
        yield workers
    finally:
        for w in workers.values():
            w.stop()


def annotations_for(worker: Any) -> dict[str, str]:
    out = {"pdgate.ai/port": str(worker.port)}
    if worker.bootstrap_port is not None:
        out["sglang.ai/bootstrap-port"] = str(worker.bootstrap_port)
    return out


def start_gateway(processes: Any, apiserver: FakeApiServer, tmp_path: pathlib.Path, extra: list[str] = ()) -> GatewayProcess:
    kubeconfig = apiserver.write_kubeconfig(str(tmp_path / "kubeconfig"), namespace=NS)
    return launch(processes, [*DISCOVERY_ARGS, "--kubeconfig", kubeconfig, *extra])


def workers(gw: GatewayProcess) -> list[dict[str, Any]]:
    return httpx.get(gw.url + "/workers", headers=ADMIN_HEADERS, timeout=5).json()["workers"]


def discovered(gw: GatewayProcess) -> dict[str, str]:
    """URL -> worker_type of the workers discovery added (draining ones excluded)."""
    return {w["url"]: w["worker_type"] for w in workers(gw) if w["source"] == "discovery" and not w.get("draining")}


def converge(gw: GatewayProcess, want: Callable[[], dict[str, str]] | dict[str, str], what: str, timeout: float = CONVERGE_S) -> None:
    expected = want() if callable(want) else want
    deadline = time.monotonic() + timeout
    got: Any = None
    while time.monotonic() < deadline:
        try:
            got = discovered(gw)
            if got == expected:
                return
        except httpx.HTTPError as exc:
            got = exc
        time.sleep(0.1)
    raise AssertionError(f"{what}: worker set did not converge in {timeout}s\nwant {expected}\ngot  {got}\n"
                         + "".join(gw.output[-40:]))


class Load:
    """Requests through the gateway on a thread, streamed and not; every failure is kept."""

    def __init__(self, url: str) -> None:
        self.url, self.ok, self.failures = url, 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _one(self, client: httpx.Client, i: int) -> None:
        body = {"model": "tiny", "prompt": f"request {i} to the pool", "max_tokens": 4, "temperature": 0, "stream": i % 2 == 1}
        with client.stream("POST", self.url + "/v1/completions", json=body, timeout=30) as resp:
            text = resp.read().decode()
            if resp.status_code != 200 or (body["stream"] and "[DONE]" not in text) or '"error"' in text:
                self.failures.append(f"{resp.status_code} {text[:300]}")
            else:
                self.ok += 1

    def _run(self) -> None:
        with httpx.Client() as client:
            i = 0
            while not self._stop.is_set():
                try:
                    self._one(client, i)
                except httpx.HTTPError as exc:
                    self.failures.append(repr(exc))
                i += 1

    def __enter__(self) -> "Load":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(40)


def test_workers_follow_pods_and_requests_keep_succeeding(processes: Any, apiserver: FakeApiServer, core: Any,
                                                          engines: dict[str, Any], tmp_path: pathlib.Path) -> None:
    gw = start_gateway(processes, apiserver, tmp_path)
    url = {name: w.url for name, w in engines.items()}
    for name in ("p1", "d1"):
        create_pod(core, NS, name, {"app": name[0]}, annotations_for(engines[name]))
    time.sleep(1.0)
    assert discovered(gw) == {}, "a pod that is not Running and Ready is not a worker"
    set_ready(core, NS, "p1", ready=False)
    set_ready(core, NS, "d1")
    converge(gw, {url["d1"]: "decode"}, "only the Ready pod")
    set_ready(core, NS, "p1")
    converge(gw, {url["p1"]: "prefill", url["d1"]: "decode"}, "p1 ready")
    gw.wait_ready(10)
    entry = next(w for w in workers(gw) if w["url"] == url["p1"])
    assert entry["labels"]["k8s.namespace"] == NS and entry["labels"]["k8s.pod"] == "p1" and entry["labels"]["k8s.uid"]
    assert entry["bootstrap_port"] == engines["p1"].bootstrap_port

    with Load(gw.url) as load:
        create_pod(core, NS, "p2", {"app": "p"}, annotations_for(engines["p2"]))
        set_ready(core, NS, "p2")
        converge(gw, {url["p1"]: "prefill", url["p2"]: "prefill", url["d1"]: "decode"}, "p2 joined")
        relabel(core, NS, "p1", {"app": "other"})
        converge(gw, {url["p2"]: "prefill", url["d1"]: "decode"}, "p1 relabeled out of the selector")
        relabel(core, NS, "p1", {"app": "p"})
        create_pod(core, NS, "d2", {"app": "d"}, annotations_for(engines["d2"]))
        set_ready(core, NS, "d2")
        converge(gw, {url["p1"]: "prefill", url["p2"]: "prefill", url["d1"]: "decode", url["d2"]: "decode"}, "p1 back, d2 joined")
        terminate(core, NS, "p2")
        converge(gw, {url["p1"]: "prefill", url["d1"]: "decode", url["d2"]: "decode"}, "p2 terminating")
        set_ready(core, NS, "d1", ready=False)
        converge(gw, {url["p1"]: "prefill", url["d2"]: "decode"}, "d1 not ready")
        delete_pod(core, NS, "p2")
        ok_before = load.ok
        deadline = time.monotonic() + 10
        while load.ok < ok_before + 3 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert not load.failures, f"{len(load.failures)} failed requests (of {load.ok + len(load.failures)}): {load.failures[:3]}"
    assert load.ok >= 10, f"only {load.ok} requests completed"


def test_pod_in_both_pools_is_refused_and_hand_added_workers_are_left_alone(
        processes: Any, apiserver: FakeApiServer, core: Any, engines: dict[str, Any], tmp_path: pathlib.Path) -> None:
    # No --service-discovery-namespace: every namespace is watched.
    kubeconfig = apiserver.write_kubeconfig(str(tmp_path / "kubeconfig"))
    gw = launch(processes, ["--pd-disaggregation", "--service-discovery", "--prefill-selector", "role=prefill",
                            "--decode-selector", "pool=decode", "--kubeconfig", kubeconfig, "--health-check-interval-secs", "1",
                            "--admin-api-key", ADMIN])
    p1, d1 = engines["p1"], engines["d1"]
    added = httpx.post(gw.url + "/workers", json={"url": d1.url, "worker_type": "decode"}, headers=ADMIN_HEADERS, timeout=10)
    assert added.status_code == 201, added.text

    create_pod(core, NS, "both", {"role": "prefill", "pool": "decode"}, annotations_for(p1))
    set_ready(core, NS, "both")
    deadline = time.monotonic() + CONVERGE_S
    while "matches both" not in "".join(gw.output) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "matches both" in "".join(gw.output), "a pod in both pools is refused with a log line"
    assert discovered(gw) == {}
    relabel(core, NS, "both", {"pool": None})
    converge(gw, {p1.url: "prefill"}, "no longer in both pools")

    # A pod at the hand-added worker's URL: discovery leaves that worker alone, also when the pod
    # goes away.
    create_pod(core, "other-ns", "dup", {"pool": "decode"}, annotations_for(d1))
    set_ready(core, "other-ns", "dup")
    deadline = time.monotonic() + CONVERGE_S
    while "added by hand" not in "".join(gw.output) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "added by hand" in "".join(gw.output), "".join(gw.output[-30:])
    delete_pod(core, "other-ns", "dup")
    time.sleep(1.5)
    by_url = {w["url"]: w for w in workers(gw)}
    assert by_url[d1.url]["source"] == "api" and not by_url[d1.url]["draining"]
    assert discovered(gw) == {p1.url: "prefill"}


def red_square_chat() -> dict[str, Any]:
    """A chat request with one small image (a data: URL), for the `tiny-mm` workers."""
    import base64
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (220, 20, 30)).save(buf, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is this?"}]
    return {"model": "tiny-mm", "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}


def test_epd_encode_pods_are_found_by_the_encode_selector(processes: Any, apiserver: FakeApiServer, core: Any,
                                                          tmp_path: pathlib.Path) -> None:
    """EPD: encode pods join and leave like prefill and decode pods, with their bootstrap port read
    from the same annotation; an image request goes through the discovered encode worker."""
    from pdgate.workers import ReferenceWorker

    engines = {name: ReferenceWorker(mode=mode, model="tiny-mm") for name, mode in (("ep", "prefill"), ("ed", "decode"), ("ee", "encode"))}
    try:
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda w: w.start(timeout=90), engines.values()))
        kubeconfig = apiserver.write_kubeconfig(str(tmp_path / "kubeconfig"), namespace=NS)
        gw = launch(processes, ["--epd-disaggregation", "--service-discovery", "--selector", "team=ml", "--prefill-selector", "app=p",
                                "--decode-selector", "app=d", "--encode-selector", "encoder=yes", "--service-discovery-namespace", NS,
                                "--health-check-interval-secs", "1", "--admin-api-key", ADMIN, "--kubeconfig", kubeconfig])
        url = {name: w.url for name, w in engines.items()}
        for name, labels in (("ep", {"app": "p"}), ("ed", {"app": "d"}), ("ee", {"encoder": "yes"})):
            create_pod(core, NS, name, {"team": "ml", **labels}, annotations_for(engines[name]))
            set_ready(core, NS, name)
        converge(gw, {url["ep"]: "prefill", url["ed"]: "decode", url["ee"]: "encode"}, "the encode pod joined")
        entry = next(w for w in workers(gw) if w["url"] == url["ee"])
        assert entry["bootstrap_port"] == engines["ee"].bootstrap_port, "read from sglang.ai/bootstrap-port, as a prefill's"
        assert entry["labels"]["k8s.pod"] == "ee"
        gw.wait_ready(10)  # EPD readiness waits for a healthy encode worker too
        assert next(w for w in workers(gw) if w["url"] == url["ee"])["healthy"]
        r = httpx.post(gw.url + "/v1/chat/completions", json=red_square_chat(), timeout=60)
        assert r.status_code == 200, r.text
        assert f"encode={url['ee']}" in r.headers["x-pdgate-route"], r.headers["x-pdgate-route"]

        # A pod that matches the encode and the prefill selectors is refused, naming both flags.
        create_pod(core, NS, "both", {"team": "ml", "app": "p", "encoder": "yes"}, {"pdgate.ai/port": "20999"})
        set_ready(core, NS, "both")
        deadline = time.monotonic() + CONVERGE_S
        while "matches both --encode-selector and --prefill-selector" not in "".join(gw.output) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "matches both --encode-selector and --prefill-selector" in "".join(gw.output), "".join(gw.output[-30:])
        assert "http://127.0.0.1:20999" not in discovered(gw)
        delete_pod(core, NS, "both")

        terminate(core, NS, "ee")
        converge(gw, {url["ep"]: "prefill", url["ed"]: "decode"}, "the encode pod is terminating")
        delete_pod(core, NS, "ee")
    finally:
        for w in engines.values():
            w.stop()


def test_a_pod_at_the_gateways_own_address_is_skipped(processes: Any, apiserver: FakeApiServer, core: Any,
                                                       tmp_path: pathlib.Path) -> None:
    """Selectors that match the gateway's own pod would make it a worker of itself (a loop)."""
    gw = start_gateway(processes, apiserver, tmp_path)
    own_port = gw.url.rsplit(":", 1)[1]
    create_pod(core, NS, "me", {"app": "d"}, {"pdgate.ai/port": own_port})
    set_ready(core, NS, "me")
    deadline = time.monotonic() + CONVERGE_S
    while "discovered pod skipped" not in "".join(gw.output) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "discovered pod skipped" in "".join(gw.output), "".join(gw.output[-30:])
    assert discovered(gw) == {}
    delete_pod(core, NS, "me")
    assert httpx.get(gw.url + "/liveness", timeout=5).status_code == 200


def test_watch_drops_and_410s_lose_no_update(processes: Any, core: Any, tmp_path: pathlib.Path) -> None:
    # Watches also end by themselves every 3 s (server-closed), on top of the drops below.
    server = FakeApiServer(bookmark_interval=0.5, max_watch_seconds=3).start()
    try:
        from kubernetes import client, config

        conf = client.Configuration()
        config.load_kube_config(config_file=server.write_kubeconfig(str(tmp_path / "kc2")), client_configuration=conf)
        api = client.CoreV1Api(client.ApiClient(conf))
        gw = start_gateway(processes, server, tmp_path)
        truth: dict[str, str] = {}
        # Nothing listens on these ports: the workers stay unhealthy, discovery still lists them.
        port = iter(range(20001, 20100))

        def add(name: str, role: str) -> None:
            p = next(port)
            create_pod(api, NS, name, {"app": role[0]}, {"pdgate.ai/port": str(p)})
            set_ready(api, NS, name)
            truth[name] = (f"http://127.0.0.1:{p}", role)

        def remove(name: str) -> None:
            delete_pod(api, NS, name)
            truth.pop(name)

        out_of_pool: dict[str, tuple[str, str]] = {}

        def toggle(name: str) -> None:
            """Relabels a decode pod out of its pool, or back in."""
            if name in truth:
                relabel(api, NS, name, {"app": "elsewhere"})
                out_of_pool[name] = truth.pop(name)
            else:
                relabel(api, NS, name, {"app": "d"})
                truth[name] = out_of_pool.pop(name)

        want = lambda: {u: r for u, r in truth.values()}  # noqa: E731
        for i in range(3):
            add(f"p{i}", "prefill")
            add(f"d{i}", "decode")
        converge(gw, want, "initial pods")
        for round_ in range(4):
            # Changes while no watch can be open (list and watch answer 503); on odd rounds the
            # history is compacted as well, so the gateway's resume gets 410 Gone and it must
            # re-list, and notice deletions from the list alone.
            server.unavailable = True
            server.drop_watches(abrupt=round_ % 2 == 0)
            remove(f"p{round_ % 3}" if f"p{round_ % 3}" in truth else next(n for n in truth if n.startswith("new")))
            add(f"new{round_}", "decode" if round_ % 2 else "prefill")
            toggle(f"d{round_ % 2}")
            if round_ % 2:
                server.compact()
            time.sleep(0.3)
            server.unavailable = False
            converge(gw, want, f"round {round_}")
        # The gauge follows within a resync period (a drained worker leaves a moment later).
        gauge = re.compile(r'^pdgate_workers\{source="discovery"\} %d$' % len(truth), re.M)
        deadline = time.monotonic() + 5
        metrics = httpx.get(gw.url + "/metrics", timeout=5).text
        while not gauge.search(metrics) and time.monotonic() < deadline:
            time.sleep(0.2)
            metrics = httpx.get(gw.url + "/metrics", timeout=5).text
        assert gauge.search(metrics), metrics
        restarts = re.search(r"^pdgate_discovery_watch_restarts_total (\d+)", metrics, re.M)
        assert restarts and int(restarts.group(1)) >= 4, "every outage interrupted both watches"
        relists = re.search(r'^pdgate_discovery_events_total\{type="relist"\} (\d+)', metrics, re.M)
        assert relists and int(relists.group(1)) >= 2 + 2 * 2, "410s made both watchers re-list"
    finally:
        server.stop()
