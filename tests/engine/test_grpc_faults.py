"""PD leg failures over gRPC end with a gRPC status within the engine's deadlines, and every page
on both workers is free afterwards (the HTTP fault suite's bounded outcomes, over the servicers)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("smg_grpc_proto", reason="smg-grpc-proto (a pdgate dependency on Python 3.10+) is not installed")
import grpc  # noqa: E402
from smg_grpc_proto.generated import sglang_scheduler_pb2 as spb  # noqa: E402

from grpc_client import TIMEOUT, collect, sglang_request, sglang_stub  # noqa: E402

from conftest import FAULT_ARGS, assert_clean, start_all  # noqa: E402
from pdgate.workers import ReferenceWorker  # noqa: E402

pytestmark = pytest.mark.timeout(120)
PROMPT = [256, *b"a prompt for the fault tests"]


@pytest.fixture
def pair():
    p = ReferenceWorker(mode="prefill", grpc_service="sglang", extra_args=FAULT_ARGS)
    d = ReferenceWorker(mode="decode", grpc_service="sglang", extra_args=FAULT_ARGS)
    start_all(p, d)
    try:
        yield p, d
    finally:
        p.stop()
        d.stop()


def dp(p, room: int) -> spb.DisaggregatedParams:
    return spb.DisaggregatedParams(bootstrap_host="127.0.0.1", bootstrap_port=p.bootstrap_port, bootstrap_room=room)


def failed_status(worker, req) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as ei:
        collect(sglang_stub(worker).Generate(req, timeout=TIMEOUT))
    return ei.value.code()


def test_decode_never_comes(pair):
    p, d = pair
    code = failed_status(p, sglang_request("f-1", PROMPT, 4, disaggregated_params=dp(p, 21)))
    assert code not in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED), code  # the engine's deadline, not ours
    assert_clean(p, d)


def test_prefill_request_never_comes(pair):
    p, d = pair
    code = failed_status(d, sglang_request("f-2", PROMPT, 4, disaggregated_params=dp(p, 22)))
    assert code not in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED), code
    assert_clean(p, d)


def test_decode_killed_while_prefill_waits(pair):
    p, d = pair
    result = {}

    def prefill():
        try:
            collect(sglang_stub(p).Generate(sglang_request("f-3", PROMPT, 4, disaggregated_params=dp(p, 23)),
                                            timeout=TIMEOUT))
            result["code"] = grpc.StatusCode.OK
        except grpc.RpcError as e:
            result["code"] = e.code()

    t = threading.Thread(target=prefill)
    t.start()
    time.sleep(0.3)  # not a threshold: the decode dies either before or after the prefill arrives
    d.kill()
    t.join(TIMEOUT)
    assert not t.is_alive() and result["code"] != grpc.StatusCode.OK
    assert_clean(p)


def test_client_deadline_aborts_the_decode(pair):
    p, d = pair
    with pytest.raises(grpc.RpcError) as ei:
        collect(sglang_stub(d).Generate(sglang_request("f-4", PROMPT, 4, disaggregated_params=dp(p, 24)), timeout=0.5))
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_clean(p, d)


# The HTTP surfaces' fault hooks, honoured over gRPC (the gateway's gRPC fault e2e tests use them).

@pytest.mark.parametrize("service", ["sglang", "vllm"])
def test_fault_drop_ends_every_call_unavailable_and_the_engine_lives_on(service):
    from grpc_client import vllm_request, vllm_stub

    w = ReferenceWorker(mode="null", grpc_service=service, extra_args=["--fault-drop-after-tokens", "3"])
    start_all(w)
    try:
        for stream in (True, False):
            for n in range(2):  # on EVERY call, not once
                rid = f"drop-{service}-{stream}-{n}"
                req = (sglang_request(rid, PROMPT, 16, stream=stream) if service == "sglang"
                       else vllm_request(rid, PROMPT, 16, stream=stream))
                stub = sglang_stub(w) if service == "sglang" else vllm_stub(w)
                got: list[int] = []
                with pytest.raises(grpc.RpcError) as ei:
                    for r in stub.Generate(req, timeout=TIMEOUT):
                        assert not r.HasField("complete"), ("the call must break before its answer completes", got, r)
                        got.extend(r.chunk.token_ids)
                assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value
                # A stream had exactly the tokens before the drop (the scheduler holds a
                # sequence at N, so the engine cannot run ahead of it); a whole answer none.
                assert len(got) == (3 if stream else 0), got
                assert w.proc is not None and w.proc.poll() is None, "the engine lives on"
                assert_clean(w)
    finally:
        w.stop()


def test_fault_kill_dies_mid_stream_after_the_nth_token():
    w = ReferenceWorker(mode="null", grpc_service="sglang", extra_args=["--fault-kill-after-tokens", "3"])
    start_all(w)
    try:
        got: list[int] = []
        with pytest.raises(grpc.RpcError) as ei:
            for r in sglang_stub(w).Generate(sglang_request("kill-1", PROMPT, 16, stream=True), timeout=TIMEOUT):
                got.extend(r.chunk.token_ids)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value  # the connection went away
        assert w.proc is not None and w.proc.wait(timeout=10) == -9, "SIGKILLed itself"
        assert len(got) <= 3, got  # never past its moment (what was in flight may be lost)
    finally:
        w.stop()
