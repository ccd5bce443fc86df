"""SubscribeKvEvents on both gRPC services: the same batches, under the same sequence numbers,
as the engine's ZMQ publisher sends (read here with plain pyzmq + msgpack); resuming from a
sequence number replays from the history; an engine without KV events answers UNIMPLEMENTED."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2

from grpc_client import collect, sglang_request, sglang_stub, vllm_request, vllm_stub
from test_kv_events import PAGE, Subscriber, events_of, ids
from pdgate.workers import ReferenceWorker

pytestmark = pytest.mark.timeout(150)


def stub_and_request(service):
    return (sglang_stub, sglang_request) if service == "sglang" else (vllm_stub, vllm_request)


def signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def read(stream, n: int) -> list:
    out = []
    for b in stream:
        out.append(b)
        if len(out) == n:
            break
    return out


@pytest.mark.parametrize("service", ["sglang", "vllm"])
def test_the_grpc_stream_carries_the_zmq_batches(service):
    sub = Subscriber()
    w = ReferenceWorker(mode="null", grpc_service=service,
                        extra_args=["--max-total-tokens", "128", "--kv-events-config", sub.config()])
    w.start(90)
    try:
        stub_of, request = stub_and_request(service)
        stub = stub_of(w)
        for i, seed in enumerate((1, 2, 3)):  # 2, then 7 pages each: the third evicts
            n = 40 if i == 0 else 100
            collect(stub.Generate(request(f"r{i}", ids(n, seed), 1), timeout=60))
        zmq_batches = dict(sub.replay(0))
        assert len(zmq_batches) >= 3 and any(e["type"] == "BlockRemoved" for e in events_of(zmq_batches))
        req = common_pb2.SubscribeKvEventsRequest(start_sequence_number=0)
        got = read(stub.SubscribeKvEvents(req, timeout=30), len(zmq_batches))
        assert [b.sequence_number for b in got] == sorted(zmq_batches)
        for b in got:
            ts, events, rank = zmq_batches[b.sequence_number]
            assert b.dp_rank == rank and abs(b.timestamp - ts) < 1e-6 and len(b.events) == len(events)
            for pe, ze in zip(b.events, events):
                kind = pe.WhichOneof("data")
                if ze["type"] == "BlockStored":
                    assert kind == "stored"
                    assert [blk.block_hash for blk in pe.stored.blocks] == [signed(h) for h in ze["block_hashes"]]
                    assert [t for blk in pe.stored.blocks for t in blk.token_ids] == ze["token_ids"]
                    assert all(blk.block_size == PAGE for blk in pe.stored.blocks)
                    parent = ze["parent_block_hash"]
                    assert pe.stored.HasField("parent_block_hash") == (parent is not None)
                    assert parent is None or pe.stored.parent_block_hash == signed(parent)
                else:
                    assert ze["type"] == "BlockRemoved" and kind == "removed"
                    assert list(pe.removed.block_hashes) == [signed(h) for h in ze["block_hashes"]]
        # resuming from a later number replays from there; live batches follow
        last = max(zmq_batches)
        stream = stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=last), timeout=30)
        first = read(stream, 1)[0]
        assert first.sequence_number == last
        collect(stub.Generate(request("r9", ids(40, 9), 1), timeout=60))
        live = read(stream, 1)[0]
        assert live.sequence_number == last + 1 and live.events[0].WhichOneof("data") in ("stored", "removed")
        stream.cancel()
    finally:
        w.stop()
        sub.close()


def test_an_engine_without_kv_events_answers_unimplemented():
    w = ReferenceWorker(mode="null", grpc_service="sglang")
    w.start(90)
    try:
        with pytest.raises(grpc.RpcError) as e:
            read(sglang_stub(w).SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=30), 1)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        w.stop()
