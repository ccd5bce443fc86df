"""Serving the engine over gRPC: `--grpc-service sglang` (= `--smg-grpc-mode`) or `vllm`.

SGLang's convention: the gRPC service on `--port`, an HTTP sidecar on `--port + 1` (here the
engine's whole HTTP surface, so `/metrics`, `/health` and `/v1/loads` are there too).
"""

from __future__ import annotations

import logging

import grpc

from .errors import EngineConfigError, EngineStartError

log = logging.getLogger("pdgate.engine.grpc")
MAX_MESSAGE_BYTES = 256 << 20  # the HTTP surface's body limit


def sidecar_port(config) -> int:
    return config.port + 1


async def start_grpc(engine, service: str, host: str, port: int) -> grpc.aio.Server:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    if service == "sglang":
        from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc

        from .grpc_sglang import SglangScheduler

        sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server(SglangScheduler(engine), server)
    elif service == "vllm":
        from smg_grpc_proto.generated import vllm_engine_pb2_grpc

        from .grpc_vllm import VllmEngine

        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(VllmEngine(engine), server)
    else:
        raise EngineConfigError(f"--grpc-service {service!r}: expected sglang or vllm")
    try:  # grpcio raises on a port in use (older releases returned 0)
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError as e:
        raise EngineStartError(f"cannot bind the gRPC port {host}:{port} ({e})") from None
    if bound == 0:
        raise EngineStartError(f"cannot bind the gRPC port {host}:{port}")
    await server.start()
    log.info("serving %s gRPC on %s:%d", service, host, port)
    return server
