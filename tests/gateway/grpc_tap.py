"""A recording pass-through in front of one gRPC worker: every call is forwarded as raw bytes to
the worker, and `Generate` calls are also decoded (SGLang's or vLLM's messages, by the method's
service) so a test can read what a third-party router really sent and received: the prompt ids,
the sampling fields, and the output ids per choice.

Used where the router's HTTP answer alone cannot show token ids (SMG's `/v1/completions` writes
text only).
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc

# The contract's server-streaming methods; every other method is unary (smg-grpc-proto 0.4.28).
STREAMING = {"Generate", "GetTokenizer", "SubscribeKvEvents"}


@dataclass
class Call:
    """One `Generate` as it crossed the tap."""

    request: object
    chunk_ids: dict[int, list[int]] = field(default_factory=dict)
    completes: dict[int, object] = field(default_factory=dict)

    def output_ids(self, index: int = 0) -> list[int]:
        """The choice's ids: the chunks' deltas when streamed, else the Complete's ids."""
        if self.request.stream:
            return self.chunk_ids.get(index, [])
        return list(self.completes[index].output_ids)


def _messages(method: str):
    if "/sglang." in method:
        from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
    else:
        from smg_grpc_proto.generated import vllm_engine_pb2 as pb
    return pb


class GrpcTap:
    """Listens on 127.0.0.1:`port`, forwards to `target` (`host:port`), records `Generate`."""

    def __init__(self, target: str, port: int):
        self.port = port
        self.channel = grpc.insecure_channel(target)
        self.calls: list[Call] = []
        self._lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        self.server.add_generic_rpc_handlers([_Forward(self)])
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    @property
    def grpc_url(self) -> str:
        return f"grpc://127.0.0.1:{self.port}"

    def generate_calls(self) -> list[Call]:
        with self._lock:
            return list(self.calls)

    def stop(self) -> None:
        self.server.stop(grace=1).wait()
        self.channel.close()

    def _record_request(self, method: str, raw: bytes) -> Call:
        call = Call(request=_messages(method).GenerateRequest.FromString(raw))
        with self._lock:
            self.calls.append(call)
        return call

    @staticmethod
    def _record_response(method: str, call: Call, raw: bytes) -> None:
        r = _messages(method).GenerateResponse.FromString(raw)
        if r.HasField("chunk"):
            call.chunk_ids.setdefault(r.chunk.index, []).extend(r.chunk.token_ids)
        elif r.HasField("complete"):
            call.completes[r.complete.index] = r.complete


def _deadline(ctx) -> float | None:
    """The caller's deadline for the forwarded call; a call without one reads as a huge
    remaining time, which grpc would take as already expired."""
    left = ctx.time_remaining()
    return left if left is not None and left < 3600 else None


class _Forward(grpc.GenericRpcHandler):
    def __init__(self, tap: GrpcTap):
        self.tap = tap

    def service(self, details):
        method = details.method
        if method.rsplit("/", 1)[-1] in STREAMING:
            return grpc.unary_stream_rpc_method_handler(self._stream(method))
        return grpc.unary_unary_rpc_method_handler(self._unary(method))

    def _unary(self, method: str):
        upstream = self.tap.channel.unary_unary(method)

        def handle(raw: bytes, ctx):
            try:
                return upstream(raw, timeout=_deadline(ctx))
            except grpc.RpcError as err:
                ctx.abort(err.code(), err.details() or "")
        return handle

    def _stream(self, method: str):
        upstream = self.tap.channel.unary_stream(method)
        generate = method.endswith("/Generate")

        def handle(raw: bytes, ctx):
            call = self.tap._record_request(method, raw) if generate else None
            responses = upstream(raw, timeout=_deadline(ctx))
            ctx.add_callback(responses.cancel)  # the router gave up: so does the worker's call
            try:
                for resp in responses:
                    if call is not None:
                        self.tap._record_response(method, call, resp)
                    yield resp
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.CANCELLED:
                    ctx.abort(err.code(), err.details() or "")
        return handle
