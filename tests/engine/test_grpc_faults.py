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
