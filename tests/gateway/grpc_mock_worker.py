"""A protocol mock of SGLang's gRPC scheduler service, for the gateway's gRPC leg-failure tests:
it answers the management calls (model info, server info with its PD role, health, loads) like
a healthy worker, and fails or hangs `Generate` on demand (the gRPC twin of the HTTP mocks'
`fail_status` / `hang` knobs). It counts the `Generate` calls in progress, so a test can see
that the gateway cancelled a leg it gave up instead of leaving it waiting.

Only for failure tests: it never generates a token (real answers come from the reference
engine).
"""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc

HANG_LIMIT_S = 60.0  # a hung call ends by itself after this, so a broken test cannot wedge the run


class MockScheduler(pb_grpc.SglangSchedulerServicer):
    def __init__(self, role: str, model: str = "tiny"):
        self.role, self.model = role, model
        self.fail: grpc.StatusCode | None = None
        self.hang = False
        self.received = 0
        self.active = 0
        self._lock = threading.Lock()

    def Generate(self, request, context):
        with self._lock:
            self.received += 1
            self.active += 1
        try:
            if self.fail is not None:
                context.abort(self.fail, f"mock {self.role} fails this call")
            if self.hang:
                end = time.monotonic() + HANG_LIMIT_S
                while context.is_active() and time.monotonic() < end:
                    time.sleep(0.02)
                return
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "the mock only fails or hangs")
        finally:
            with self._lock:
                self.active -= 1
        yield  # a generator: Generate is a server stream

    def HealthCheck(self, request, context):
        return pb.HealthCheckResponse(healthy=True, message="mock")

    def GetModelInfo(self, request, context):
        return pb.GetModelInfoResponse(served_model_name=self.model, model_path=self.model, is_generation=True,
                                       max_context_length=4096, vocab_size=512)

    def GetServerInfo(self, request, context):
        args = Struct()
        args.update({"disaggregation_mode": self.role, "engine": "grpc-mock"})
        return pb.GetServerInfoResponse(server_args=args, server_type="grpc")

    def GetLoads(self, request, context):
        return pb.GetLoadsResponse(dp_rank_count=1, loads=[pb.SchedulerLoad(dp_rank=0, max_total_num_tokens=4096)])

    def Abort(self, request, context):
        return pb.AbortResponse(success=False, message="nothing to abort")


class MockGrpcWorker:
    """A `MockScheduler` served on a free loopback port: `grpc_url`, `servicer` (the knobs)."""

    def __init__(self, role: str):
        self.servicer = MockScheduler(role)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
        pb_grpc.add_SglangSchedulerServicer_to_server(self.servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @property
    def grpc_url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def wait_idle(self, timeout: float) -> bool:
        """No `Generate` call in progress within `timeout` (the gateway dropped what it gave up)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.servicer.active == 0:
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        self.server.stop(grace=0).wait(5)
