"""The engine's SGLang gRPC service (`--smg-grpc-mode`), driven by a client on the published
stubs: same tokens as the HTTP surface, PD over gRPC with real KV, control RPCs, bad input."""

from __future__ import annotations

import hashlib
import io
import zipfile
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("smg_grpc_proto", reason="smg-grpc-proto (a pdgate dependency on Python 3.10+) is not installed")
import grpc  # noqa: E402
from google.protobuf.json_format import MessageToDict  # noqa: E402
from google.protobuf.struct_pb2 import Struct  # noqa: E402
from smg_grpc_proto.generated import common_pb2  # noqa: E402
from smg_grpc_proto.generated import sglang_scheduler_pb2 as spb  # noqa: E402

from grpc_client import TIMEOUT, collect, sglang_request, sglang_stub  # noqa: E402

from conftest import assert_clean, start_all, wait_until  # noqa: E402
from pdgate.engine.hf_export import export  # noqa: E402
from pdgate.workers import ReferenceWorker  # noqa: E402

pytestmark = pytest.mark.timeout(120)
PROMPT = [256, *b"The quick brown fox"]


@pytest.fixture(scope="module")
def grpc_workers():
    null = ReferenceWorker(mode="null", grpc_service="sglang")
    p = ReferenceWorker(mode="prefill", grpc_service="sglang")
    d = ReferenceWorker(mode="decode", grpc_service="sglang")
    ws = start_all(null, p, d)
    try:
        yield {"null": null, "prefill": p, "decode": d}
    finally:
        for w in ws:
            w.stop()


def http_generate(worker, ids, max_new, **sp) -> dict:
    body = {"input_ids": ids, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, **sp}}
    r = httpx.post(worker.url + "/generate", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_equals_http_stream_and_not(grpc_workers):
    w = grpc_workers["null"]
    ref = http_generate(w, PROMPT, 12)
    stub = sglang_stub(w)
    whole = collect(stub.Generate(sglang_request("g-1", PROMPT, 12, return_logprob=True), timeout=TIMEOUT))
    c = whole["complete"][0]
    assert list(c.output_ids) == ref["output_ids"] and whole["chunks"] == 0
    assert c.prompt_tokens == len(PROMPT) and c.completion_tokens == len(ref["output_ids"])
    assert c.finish_reason == ref["meta_info"]["finish_reason"]["type"]
    assert list(c.output_logprobs.token_logprobs) == pytest.approx([x[0] for x in ref["meta_info"]["output_token_logprobs"]], abs=1e-6)
    assert list(c.output_logprobs.token_ids) == ref["output_ids"]
    assert not c.input_logprobs.token_logprobs[0].HasField("value")  # the first prompt token has none
    streamed = collect(stub.Generate(sglang_request("g-2", PROMPT, 12, stream=True), timeout=TIMEOUT))
    assert streamed["ids"][0] == ref["output_ids"] and streamed["chunks"] >= 2
    assert streamed["complete"][0].finish_reason == c.finish_reason


def test_n_choices_and_top_logprobs(grpc_workers):
    stub = sglang_stub(grpc_workers["null"])
    seed = Struct()
    seed.update({"seed": 7})
    req = sglang_request("n-1", PROMPT, 6, return_logprob=True, top_logprobs_num=3,
                         sampling={"temperature": 1.0, "n": 3, "custom_params": seed})
    out = collect(stub.Generate(req, timeout=TIMEOUT))
    assert sorted(out["complete"]) == [0, 1, 2]
    assert all(len(c.output_ids) == 6 and len(c.output_logprobs.top_logprobs) == 6 for c in out["complete"].values())
    assert all(len(t.token_ids) == 3 for t in out["complete"][0].output_logprobs.top_logprobs)
    again = collect(stub.Generate(req, timeout=TIMEOUT))  # seeded: the same draws
    assert [list(again["complete"][i].output_ids) for i in range(3)] == [list(out["complete"][i].output_ids) for i in range(3)]
    streamed = collect(stub.Generate(sglang_request("n-2", PROMPT, 6, stream=True, sampling={
        "temperature": 1.0, "n": 3, "custom_params": seed}), timeout=TIMEOUT))
    assert {i: streamed["ids"][i] for i in range(3)} == {i: list(out["complete"][i].output_ids) for i in range(3)}


def test_stop_token_id_is_reported(grpc_workers):
    w = grpc_workers["null"]
    ref = http_generate(w, PROMPT, 12, ignore_eos=True)["output_ids"]
    stop = ref[3]
    first = ref.index(stop)
    c = collect(sglang_stub(w).Generate(sglang_request("s-1", PROMPT, 12, sampling={"stop_token_ids": [stop]}),
                                        timeout=TIMEOUT))["complete"][0]
    assert c.finish_reason == "stop" and c.matched_token_id == stop
    assert list(c.output_ids) == ref[:first + 1]


@pytest.mark.parametrize("make, field", [
    (lambda: sglang_request("b-1", []), "empty"),
    (lambda: sglang_request("b-2", [1, 2, 99999]), "out of vocabulary"),
    (lambda: sglang_request("b-3", PROMPT, sampling={"n": 100}), "n"),
    (lambda: sglang_request("b-4", PROMPT, sampling={"regex": "a+"}), "regex"),
    (lambda: sglang_request("b-5", PROMPT, sampling={"top_p": 1.5}), "top_p"),
    (lambda: sglang_request("b-6", PROMPT, top_logprobs_num=50), "top_logprobs_num"),
    (lambda: sglang_request("b-7", [1] * 5000), "context"),
])
def test_bad_requests_are_invalid_argument(grpc_workers, make, field):
    w = grpc_workers["null"]
    with pytest.raises(grpc.RpcError) as ei:
        list(sglang_stub(w).Generate(make(), timeout=TIMEOUT))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, ei.value.details())
    assert sglang_stub(w).HealthCheck(spb.HealthCheckRequest(), timeout=TIMEOUT).healthy


def test_abort_ends_the_stream_and_frees_pages(grpc_workers):
    w = grpc_workers["null"]
    stub = sglang_stub(w)
    call = stub.Generate(sglang_request("abort-me", PROMPT, 3000, stream=True, sampling={"ignore_eos": True}),
                         timeout=TIMEOUT)
    first = next(call)
    assert first.HasField("chunk")
    assert stub.Abort(spb.AbortRequest(request_id="abort-me"), timeout=TIMEOUT).success
    with pytest.raises(grpc.RpcError) as ei:
        for _ in call:
            pass
    assert ei.value.code() == grpc.StatusCode.CANCELLED
    assert not stub.Abort(spb.AbortRequest(request_id="abort-me"), timeout=TIMEOUT).success
    assert_clean(w)


def test_client_cancel_frees_pages(grpc_workers):
    w = grpc_workers["null"]
    call = sglang_stub(w).Generate(sglang_request("cancel-me", PROMPT, 3000, stream=True,
                                                  sampling={"ignore_eos": True}), timeout=TIMEOUT)
    next(call)
    call.cancel()
    assert_clean(w)


def test_control_rpcs(grpc_workers, tmp_path):
    w, p = grpc_workers["null"], grpc_workers["prefill"]
    stub = sglang_stub(w)
    assert stub.HealthCheck(spb.HealthCheckRequest(), timeout=TIMEOUT).healthy
    mi = stub.GetModelInfo(spb.GetModelInfoRequest(), timeout=TIMEOUT)
    assert (mi.vocab_size, mi.bos_token_id, list(mi.eos_token_ids), mi.is_generation) == (258, 256, [257], True)
    si = sglang_stub(p).GetServerInfo(spb.GetServerInfoRequest(), timeout=TIMEOUT)
    args = MessageToDict(si.server_args)
    assert si.server_type == "grpc" and args["disaggregation_mode"] == "prefill"
    assert args["kv_cache_dtype"] == "float32" and args["page_size"] == 16 and args["attention_backend"]
    assert args["disaggregation_bootstrap_port"] == p.bootstrap_port and si.max_total_num_tokens > 0
    loads = stub.GetLoads(spb.GetLoadsRequest(), timeout=TIMEOUT)
    assert loads.dp_rank_count == 1 and loads.loads[0].max_total_num_tokens == si.max_total_num_tokens
    with pytest.raises(grpc.RpcError) as ei:
        stub.GetLoads(spb.GetLoadsRequest(dp_rank=3), timeout=TIMEOUT)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT).success
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=TIMEOUT))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest() and all(not c.sha256 for c in chunks[:-1])
    export("tiny", str(tmp_path))
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        assert sorted(zf.namelist()) == sorted(["tokenizer.json", "tokenizer_config.json", "config.json",
                                                 "generation_config.json"])
        assert zf.read("tokenizer.json") == (tmp_path / "tokenizer.json").read_bytes()


def test_pd_bootstrap_over_grpc_equals_colocated(grpc_workers):
    p, d, null = grpc_workers["prefill"], grpc_workers["decode"], grpc_workers["null"]
    ref = http_generate(null, PROMPT, 10)["output_ids"]
    for room, stream in ((11, False), (12, True)):
        dp = spb.DisaggregatedParams(bootstrap_host="127.0.0.1", bootstrap_port=p.bootstrap_port, bootstrap_room=room)
        with ThreadPoolExecutor(2) as ex:
            fp = ex.submit(lambda: collect(sglang_stub(p).Generate(
                sglang_request(f"pd-{room}", PROMPT, 10, stream=stream, disaggregated_params=dp), timeout=TIMEOUT)))
            fd = ex.submit(lambda: collect(sglang_stub(d).Generate(
                sglang_request(f"pd-{room}", PROMPT, 10, stream=stream, disaggregated_params=dp), timeout=TIMEOUT)))
            pre, dec = fp.result(), fd.result()
        ids = dec["ids"][0] if stream else list(dec["complete"][0].output_ids)
        assert ids == ref
        assert dec["complete"][0].cached_tokens == len(PROMPT) == dec["complete"][0].prompt_tokens
        assert pre["complete"][0].finish_reason == "length"
    sent = httpx.get(p.url + "/v1/loads", timeout=10).json()["loads"][0]["disaggregation"]["kv_bytes_sent"]
    assert sent > 0
    wait_until(lambda: sglang_stub(p).GetLoads(spb.GetLoadsRequest(), timeout=TIMEOUT).loads[0].disaggregation.mode
               == "prefill", 10, "prefill load")
    assert_clean(p, d)


def test_prefix_cache_hits_are_reported_cached(grpc_workers):
    stub = sglang_stub(grpc_workers["null"])
    ids = [256, *range(40, 79)]  # 40 tokens: two full pages before the last token
    first = collect(stub.Generate(sglang_request("pc-1", ids, 2), timeout=TIMEOUT))["complete"][0]
    second = collect(stub.Generate(sglang_request("pc-2", ids, 2, stream=True), timeout=TIMEOUT))["complete"][0]
    assert first.cached_tokens == 0 and second.cached_tokens == 32
