"""A small gRPC client for the engine tests: the smg-grpc-proto stubs, driven synchronously."""

from __future__ import annotations

import json

import grpc
from smg_grpc_proto.generated import sglang_scheduler_pb2 as spb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgrpc

TIMEOUT = 60  # every call has a deadline


def target(worker) -> str:
    return worker.grpc_url.removeprefix("grpc://")


def sglang_stub(worker) -> sgrpc.SglangSchedulerStub:
    return sgrpc.SglangSchedulerStub(grpc.insecure_channel(target(worker)))


def sglang_request(rid: str, ids: list[int], max_new: int = 8, stream: bool = False, **kw) -> spb.GenerateRequest:
    sp = kw.pop("sampling", {})
    sp.setdefault("temperature", 0.0)
    return spb.GenerateRequest(request_id=rid, tokenized=spb.TokenizedInput(input_ids=ids), stream=stream,
                               sampling_params=spb.SamplingParams(max_new_tokens=max_new, **sp), **kw)


def collect(responses) -> dict:
    """Ids per choice from a Generate stream (chunks' deltas), and the Completes by index."""
    ids: dict[int, list[int]] = {}
    completes = {}
    chunks = 0
    for r in responses:
        if r.HasField("chunk"):
            chunks += 1
            ids.setdefault(r.chunk.index, []).extend(r.chunk.token_ids)
        else:
            completes[r.complete.index] = r.complete
    return {"ids": ids, "complete": completes, "chunks": chunks}


def vllm_stub(worker):
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vgrpc

    return vgrpc.VllmEngineStub(grpc.insecure_channel(target(worker)))


def vllm_request(rid: str, ids: list[int], max_tokens: int = 8, stream: bool = False, kv: dict | None = None, **sp):
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

    sp.setdefault("temperature", 0.0)
    extra = {"kv_transfer_params_json": json.dumps(kv)} if kv is not None else {}
    return vpb.GenerateRequest(request_id=rid, tokenized=vpb.TokenizedInput(input_ids=ids), stream=stream,
                               sampling_params=vpb.SamplingParams(max_tokens=max_tokens, **sp), **extra)
