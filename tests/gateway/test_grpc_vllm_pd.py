"""vLLM NIXL and Mooncake PD through pdgate to gRPC workers (issue 15): `pdgate launch
--vllm-pd-disaggregation --prefill grpc://... --decode grpc://... --model-path DIR` in front of
the reference engine's vLLM gRPC service (`--grpc-service vllm`).

- Greedy output equals the colocated HTTP engine's, token for token, for completions and chat,
  stream and not; the decode reports the whole prompt but its last token cached (vLLM's count:
  the decode recomputes the last prompt token) and received real KV bytes.
- The connector is not given on the command line for the gRPC fleets: `--vllm-pd-disaggregation`
  defaults to NIXL and a Mooncake fleet is found Mooncake from `GetServerInfo.kv_connector`.
- A pair may be an HTTP worker and a gRPC one, either way round (the plan carries JSON params;
  each client maps them).
- /generate is SGLang's native API: in the vLLM modes it is a 400 (docs/protocols.md).
- Pairing by GetServerInfo's keys refuses an incompatible pair with `no_compatible_pd_pair`.

The KV bytes go over the reference engine's plain TCP transfer backend, as in
tests/engine/test_grpc_vllm.py: the NIXL and Mooncake protocols (what the gateway speaks) do not
depend on the data plane's library, and tests/engine/test_backends.py covers the libraries.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import httpx
import pytest

pytest.importorskip("smg_grpc_proto", reason="smg-grpc-proto (a pdgate dependency on Python 3.10+) is not installed")

from pdgate.workers import ReferenceWorker  # noqa: E402
from tests.gateway.harness import launch  # noqa: E402
from tests.gateway.test_grpc_workers import CASES, answer, model_dir, post, same, start  # noqa: E402,F401

pytestmark = pytest.mark.timeout(300)
VLLM_CASES = ["completions", "chat"]
ADMIN_KEY = "test-admin-key"
FAST = ["--health-check-interval-secs", "1", "--prefill-policy", "round_robin", "--decode-policy", "round_robin"]


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, ReferenceWorker]]:
    # The colocated engine in the vLLM flavour: it writes what a vLLM worker sends (no tail that
    # ends inside a character), as the gateway does for a vLLM gRPC service.
    ws: dict[str, ReferenceWorker] = {"colocated": ReferenceWorker(mode="null", extra_args=["--api-flavor", "vllm"])}
    for conn, name in (("NixlConnector", "nixl"), ("MooncakeConnector", "mooncake")):
        for mode in ("prefill", "decode"):
            ws[f"{name}_{mode}_grpc"] = ReferenceWorker(mode=mode, kv_connector=conn, grpc_service="vllm")
            ws[f"{name}_{mode}_http"] = ReferenceWorker(mode=mode, kv_connector=conn)
    try:
        start(*ws.values())
        yield ws
    finally:
        for w in ws.values():
            w.stop()


@pytest.fixture(scope="module")
def reference(workers) -> dict[str, dict]:
    return {case: answer(workers["colocated"].url, case, False) for case in VLLM_CASES}


def url(w: ReferenceWorker) -> str:
    return w.grpc_url if w.grpc_service else w.url


def gateway(processes, model_dir: str, p: ReferenceWorker, d: ReferenceWorker, *extra: str, pairable: bool = True):
    gw = launch(processes, ["--vllm-pd-disaggregation", "--prefill", url(p), str(p.bootstrap_port), "--decode", url(d),
                            "--model-path", model_dir, *FAST, *extra])
    if pairable:
        gw.wait_ready(60)
    else:
        healthy(gw.url)
    return gw


def healthy(gw_url: str, timeout: float = 60) -> None:
    """Both workers healthy (an unpairable fleet never turns ready: /readiness stays 503)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        r = httpx.get(gw_url + "/readiness", timeout=5)
        last = r.json()
        if last.get("healthy_prefill", 0) >= 1 and last.get("healthy_decode", 0) >= 1:
            assert r.status_code == 503 and last.get("pairable_prefill") == 0, last
            return
        time.sleep(0.1)
    raise AssertionError(f"workers not healthy after {timeout}s: {last}")


def disagg(w: ReferenceWorker) -> dict[str, Any]:
    return httpx.get(w.url + "/v1/loads", timeout=10).json()["loads"][0]["disaggregation"]


def check_pd(gw_url: str, reference: dict[str, dict], d: ReferenceWorker, cases: list[str]) -> None:
    before = disagg(d)["kv_bytes_received"]
    for case in cases:
        for stream in (False, True):
            same(answer(gw_url, case, stream), reference[case], stream)
        path, body = CASES[case]
        r = post(gw_url, path, body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        # vLLM's count (and the reference engine's in the vLLM modes): the decode recomputes
        # the last prompt token and has the rest from the prefill.
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1, usage
    after = disagg(d)
    assert after["kv_bytes_received"] > before, "the KV moved"
    assert after["local_recompute"] == 0


@pytest.mark.parametrize("connector", ["nixl", "mooncake"])
def test_grpc_pd_equals_the_colocated_engine(processes, model_dir, workers, reference, connector):
    p, d = workers[f"{connector}_prefill_grpc"], workers[f"{connector}_decode_grpc"]
    gw = gateway(processes, model_dir, p, d, "--admin-api-key", ADMIN_KEY)
    check_pd(gw.url, reference, d, VLLM_CASES)
    # The pairing key came from GetServerInfo: the connector (no --kv-connector was given),
    # the role, the KV layout and the attention backend.
    listed = httpx.get(gw.url + "/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    assert listed.status_code == 200, listed.text
    keys = {w["url"]: w["pd_pairing"] for w in listed.json()["workers"]}
    for w, role in ((p, "prefill"), (d, "decode")):
        key = keys[w.grpc_url]
        assert key["transport"] == connector and key["reported_role"] == role, key
        assert key["runtime"] == "vllm" and key["kv_layout"]["page_size"] == 16, key
        assert key["kv_layout"]["attention_backend"] == "pdgate-numpy", key
    # /generate is SGLang's native API: the vLLM modes refuse it before any leg is sent.
    for stream in (False, True):
        path, body = CASES["generate_ids"]
        r = post(gw.url, path, {**body, "stream": stream})
        assert r.status_code == 400 and "/generate" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("connector", ["nixl", "mooncake"])
@pytest.mark.parametrize("prefill,decode", [("http", "grpc"), ("grpc", "http")])
def test_an_http_and_a_grpc_worker_pair(processes, model_dir, workers, reference, connector, prefill, decode):
    p, d = workers[f"{connector}_prefill_{prefill}"], workers[f"{connector}_decode_{decode}"]
    # The HTTP reference engine does not say its connector: the flag is its default. Its
    # runtime is `pdgate-reference` while its vLLM gRPC service reports itself as `vllm` (as
    # vLLM's does), so pairing is off here: it still requires the same transport.
    gw = gateway(processes, model_dir, p, d, "--kv-connector", connector, "--pd-pairing-mode", "off")
    check_pd(gw.url, reference, d, ["completions"])


def refusal(gw_url: str) -> dict:
    r = post(gw_url, *CASES["completions"])
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "no_compatible_pd_pair", err
    return err


def test_pairing_refuses_incompatible_grpc_workers(processes, model_dir, workers):
    # Transport: a NIXL prefill and a Mooncake decode, both named so by GetServerInfo.
    gw = gateway(processes, model_dir, workers["nixl_prefill_grpc"], workers["mooncake_decode_grpc"], pairable=False)
    assert "transport differs: prefill nixl, decode mooncake" in refusal(gw.url)["message"]
    # Role: an engine that is a KV consumer registered as the prefill.
    gw = gateway(processes, model_dir, workers["nixl_decode_grpc"], workers["nixl_decode_http"], "--kv-connector", "nixl",
                 pairable=False)
    assert "the prefill's engine says decode" in refusal(gw.url)["message"]


def test_pairing_refuses_a_different_block_size_over_grpc(processes, model_dir, workers):
    d32 = ReferenceWorker(mode="decode", kv_connector="NixlConnector", grpc_service="vllm", extra_args=["--page-size", "32"])
    try:
        start(d32)
        gw = gateway(processes, model_dir, workers["nixl_prefill_grpc"], d32, pairable=False)
        assert "KV layout page_size differs: prefill 16, decode 32" in refusal(gw.url)["message"]
    finally:
        d32.stop()
