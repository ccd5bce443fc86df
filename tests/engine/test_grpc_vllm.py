"""The engine's vLLM gRPC service (`--grpc-service vllm`): same tokens as the HTTP surface, NIXL
and Mooncake PD through `kv_transfer_params_json` with real KV bytes, control RPCs, bad input."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

pytest.importorskip("smg_grpc_proto", reason="smg-grpc-proto (a pdgate dependency on Python 3.10+) is not installed")
import grpc  # noqa: E402
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb  # noqa: E402

from grpc_client import TIMEOUT, collect, vllm_request, vllm_stub  # noqa: E402

from conftest import assert_clean, loads, start_all  # noqa: E402
from pdgate.workers import ReferenceWorker  # noqa: E402

pytestmark = pytest.mark.timeout(120)
PROMPT = [256, *b"Once upon a time, in a land"]


@pytest.fixture(scope="module")
def vw():
    ws = {"null": ReferenceWorker(mode="null", grpc_service="vllm")}
    for conn, name in (("NixlConnector", "nixl"), ("MooncakeConnector", "mooncake")):
        ws[name] = (ReferenceWorker(mode="prefill", kv_connector=conn, grpc_service="vllm"),
                    ReferenceWorker(mode="decode", kv_connector=conn, grpc_service="vllm"))
    flat = start_all(ws["null"], *ws["nixl"], *ws["mooncake"])
    try:
        yield ws
    finally:
        for w in flat:
            w.stop()


def http_completion(worker, ids, max_tokens) -> dict:
    r = httpx.post(worker.url + "/v1/completions", json={"prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                                                         "logprobs": 0}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def ids_of(choice: dict) -> list[int]:
    return [b for t in choice["logprobs"]["tokens"] for b in t.encode("latin-1")]


def test_greedy_equals_http(vw):
    w = vw["null"]
    ref = http_completion(w, PROMPT, 10)
    stub = vllm_stub(w)
    c = collect(stub.Generate(vllm_request("v-1", PROMPT, 10, logprobs=0), timeout=TIMEOUT))["complete"][0]
    assert list(c.output_ids) == ids_of(ref) and c.finish_reason == ref["finish_reason"]
    assert list(c.output_logprobs.token_logprobs) == pytest.approx(ref["logprobs"]["token_logprobs"], abs=1e-5)
    s = collect(stub.Generate(vllm_request("v-2", PROMPT, 10, stream=True), timeout=TIMEOUT))
    assert s["ids"][0] == list(c.output_ids) and s["chunks"] >= 2 and s["complete"][0].finish_reason
    text = vpb.GenerateRequest(request_id="v-3", text=bytes(PROMPT[1:]).decode(), sampling_params=vpb.SamplingParams(
        max_tokens=10, temperature=0.0))
    assert list(collect(stub.Generate(text, timeout=TIMEOUT))["complete"][0].output_ids) == list(c.output_ids)


def test_nixl_over_grpc_equals_colocated(vw):
    p, d = vw["nixl"]
    ref = collect(vllm_stub(vw["null"]).Generate(vllm_request("ref", PROMPT, 10), timeout=TIMEOUT))["complete"][0]
    for stream in (False, True):
        rid = f"nixl-{uuid.uuid4().hex}"
        pre = collect(vllm_stub(p).Generate(vllm_request(rid, PROMPT, 1, kv={"do_remote_decode": True}),
                                            timeout=TIMEOUT))["complete"][0]
        params = json.loads(pre.kv_transfer_params_json)
        assert params["do_remote_prefill"] and params["remote_engine_id"]
        dec = collect(vllm_stub(d).Generate(vllm_request(rid, PROMPT, 10, stream=stream, kv=params), timeout=TIMEOUT))
        ids = dec["ids"][0] if stream else list(dec["complete"][0].output_ids)
        assert ids == list(ref.output_ids)
        # vLLM's count: the decode recomputes the last prompt token
        assert dec["complete"][0].cached_tokens == len(PROMPT) - 1
    assert loads(d)["disaggregation"]["kv_bytes_received"] > 0 and loads(d)["disaggregation"]["local_recompute"] == 0
    assert_clean(p, d)


def test_mooncake_over_grpc_equals_colocated(vw):
    p, d = vw["mooncake"]
    ref = collect(vllm_stub(vw["null"]).Generate(vllm_request("ref-m", PROMPT, 10), timeout=TIMEOUT))["complete"][0]
    info = vllm_stub(p).GetServerInfo(vpb.GetServerInfoRequest(), timeout=TIMEOUT)
    assert info.kv_connector == "MooncakeConnector" and info.kv_role == "kv_producer" and info.kv_engine_id
    tid = f"xfer-{uuid.uuid4()}"
    pkv = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid}
    dkv = {"do_remote_decode": False, "do_remote_prefill": True, "transfer_id": tid,
           "remote_engine_id": info.kv_engine_id, "remote_bootstrap_addr": f"http://127.0.0.1:{p.bootstrap_port}"}
    # SMG's order: the prefill answers once its KV is computed, then the decode is sent
    pre = collect(vllm_stub(p).Generate(vllm_request(tid, PROMPT, 1, kv=pkv), timeout=TIMEOUT))
    dec = collect(vllm_stub(d).Generate(vllm_request(tid, PROMPT, 10, kv=dkv), timeout=TIMEOUT))
    assert json.loads(pre["complete"][0].kv_transfer_params_json)["transfer_id"] == tid
    assert list(dec["complete"][0].output_ids) == list(ref.output_ids)
    assert dec["complete"][0].cached_tokens == len(PROMPT) - 1
    assert loads(d)["disaggregation"]["kv_bytes_received"] > 0
    assert_clean(p, d)


def test_server_info_pairing_keys(vw):
    for name, role in (("nixl", "kv_producer"), ("nixl", "kv_consumer")):
        w = vw[name][0 if role == "kv_producer" else 1]
        info = vllm_stub(w).GetServerInfo(vpb.GetServerInfoRequest(), timeout=TIMEOUT)
        assert (info.server_type, info.kv_connector, info.kv_role) == ("vllm-grpc", "NixlConnector", role)
        assert (info.kv_cache_dtype, info.block_size, info.attention_backend) == ("float32", 16, "pdgate-numpy")
    plain = vllm_stub(vw["null"]).GetServerInfo(vpb.GetServerInfoRequest(), timeout=TIMEOUT)
    assert plain.kv_connector == "" and plain.kv_role == ""
    ld = vllm_stub(vw["null"]).GetLoads(vpb.GetLoadsRequest(), timeout=TIMEOUT)
    assert ld.loads[0].max_total_num_tokens > 0
    assert vllm_stub(vw["null"]).HealthCheck(vpb.HealthCheckRequest(), timeout=TIMEOUT).healthy


def test_abort_frees_pages(vw):
    w = vw["null"]
    call = vllm_stub(w).Generate(vllm_request("va-1", PROMPT, 3000, stream=True, ignore_eos=True), timeout=TIMEOUT)
    next(call)
    vllm_stub(w).Abort(vpb.AbortRequest(request_ids=["va-1"]), timeout=TIMEOUT)
    with pytest.raises(grpc.RpcError) as ei:
        list(call)
    assert ei.value.code() == grpc.StatusCode.CANCELLED
    assert_clean(w)


@pytest.mark.parametrize("make", [
    lambda: vpb.GenerateRequest(request_id="bad-1", sampling_params=vpb.SamplingParams(max_tokens=2)),
    lambda: vllm_request("bad-2", PROMPT, logprobs=-1),
    lambda: vllm_request("bad-3", PROMPT, n=2, kv={"do_remote_decode": True}),
    lambda: vpb.GenerateRequest(request_id="bad-4", tokenized=vpb.TokenizedInput(input_ids=PROMPT),
                                kv_transfer_params_json="{not json"),
    lambda: vllm_request("bad-5", PROMPT, regex="a+"),
    lambda: vllm_request("bad-6", [300]),
])
def test_bad_requests_are_invalid_argument(vw, make):
    with pytest.raises(grpc.RpcError) as ei:
        list(vllm_stub(vw["null"]).Generate(make(), timeout=TIMEOUT))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
