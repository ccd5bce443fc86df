"""Command line of a reference worker: SGLang-style flags plus vLLM's `--kv-transfer-config`.

`add_arguments(parser)` and `run(args)` are what `pdgate engine` wires in;
`python -m pdgate.engine` uses them directly. The flags become an `EngineConfig`
(`config_from_args`); the environment variables the CLI honours are read here, when the parser
is built or the worker starts, never by the library.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys

from .engine_config import EngineConfig
from .errors import EngineConfigError, EngineStartError

_SETUP_ERRORS = (EngineConfigError, EngineStartError)


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "--model-path", dest="model", default="tiny",
                   help="preset `tiny`, `tiny64` or `small` (weights from --seed), or a local Hugging Face "
                        "Llama directory (config.json, *.safetensors, tokenizer.json)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--advertise-host", default=None,
                   help="address peers use to reach this worker's side channel and bootstrap "
                        "server (default: --host, or this machine's address when --host is a wildcard)")
    p.add_argument("--seed", type=int, default=0, help="weights seed of the presets")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    p.add_argument("--max-total-tokens", type=int, default=65536, help="KV pool size in tokens")
    p.add_argument("--chunked-prefill-size", type=int, default=8192,
                   help="prompt tokens per scheduler step; -1 = whole prompts")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--queue-timeout", type=float, default=600.0,
                   help="seconds a request may wait for KV memory before it fails with 503")
    p.add_argument("--disaggregation-mode", choices=["null", "prefill", "decode"], default=None)
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998)
    p.add_argument("--disaggregation-transfer-backend", choices=["tcp", "mooncake", "nixl"], default="tcp")
    p.add_argument("--kv-transfer-config", default=None,
                   help='vLLM style, e.g. \'{"kv_connector":"NixlConnector","kv_role":"kv_producer"}\'')
    p.add_argument("--ec-transfer-config", default=None,
                   help='vLLM\'s disaggregated encoder (a multimodal model), e.g. \'{"ec_connector": '
                        '"ECExampleConnector", "ec_role": "ec_producer", "ec_connector_extra_config": '
                        '{"shared_storage_path": "/tmp/ec"}}\': ec_producer embeds images into the shared '
                        'folder and answers without generating; ec_consumer loads them from it; ec_both does both')
    p.add_argument("--kv-load-failure-policy", choices=["fail", "recompute"], default="fail",
                   help="vLLM decode: what a failed KV load does")
    p.add_argument("--transfer-port", type=int,
                   default=int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "0") or 0),
                   help="TCP side channel port (0 = any free port)")
    p.add_argument("--engine-id", default=None)
    p.add_argument("--bootstrap-timeout", type=float,
                   default=_env_float("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", 300.0),
                   help="seconds for the PD rendezvous (env SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT)")
    p.add_argument("--waiting-timeout", type=float,
                   default=_env_float("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", 300.0),
                   help="seconds a registered decode waits for the first KV byte "
                        "(env SGLANG_DISAGGREGATION_WAITING_TIMEOUT)")
    p.add_argument("--transfer-timeout", type=float,
                   default=_env_float("PDGATE_ENGINE_TRANSFER_TIMEOUT", 60.0),
                   help="seconds without progress that fail a transfer in flight")
    p.add_argument("--kv-lease-timeout", type=float,
                   default=_env_float("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", 480.0),
                   help="seconds a NIXL-style prefill holds pages nobody pulled "
                        "(env VLLM_NIXL_ABORT_REQUEST_TIMEOUT)")
    p.add_argument("--fault-kill-after-tokens", type=int, default=0,
                   help="fault injection for tests: the engine SIGKILLs itself once it has sent a "
                        "stream chunk holding a sequence's N-th output token, or (whole answers) "
                        "once a sequence has generated N tokens; 0: off")
    p.add_argument("--fault-drop-after-tokens", type=int, default=0,
                   help="fault injection for tests: on EVERY request, the engine closes the "
                        "connection (the process lives on) once it has sent a stream chunk holding "
                        "a sequence's N-th output token, or (whole answers) once a sequence has "
                        "generated N tokens; the sequence is aborted; 0: off")
    p.add_argument("--fault-slow-health", type=float, default=0.0, metavar="SECONDS",
                   help="fault injection for tests: a busy engine's health. Once the engine has taken "
                        "a generation request, every GET /health answers only after SECONDS, while "
                        "generations answer as usual; 0: off")
    p.add_argument("--fault-encode", choices=["hang", "garbage", "bad-embedding"], default=None,
                   help="fault injection for tests, on an encode worker (--encoder-only): hang: every "
                        "POST /encode is read and never answered; garbage: answered 200 with a body that "
                        "is not JSON, nothing encoded; bad-embedding: answered as usual, but the embedding "
                        "offered under each room carries another content hash, so the prefill refuses it")
    p.add_argument("--api-flavor", choices=["sglang", "vllm"], default=None,
                   help="which engine's names /metrics exports its load under (sglang:* or vllm:*); "
                        "default: vllm with --kv-transfer-config, else sglang")
    p.add_argument("--vllm-endpoints-only", action="store_true",
                   help="answer 404 on SGLang's own endpoints (/server_info, /get_server_info, "
                        "/model_info, /v1/loads), as a real vLLM server does")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share full KV pages between requests with the same prefix (vLLM's flag; "
                        "--no-enable-prefix-caching or SGLang's --disable-radix-cache turn it off)")
    p.add_argument("--disable-radix-cache", dest="enable_prefix_caching", action="store_false",
                   default=argparse.SUPPRESS, help="SGLang's spelling of --no-enable-prefix-caching")
    p.add_argument("--kv-events-config", default=None,
                   help='vLLM\'s KVEventsConfig as JSON, e.g. \'{"enable_kv_cache_events": true, '
                        '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", '
                        '"topic": "kv@pod@model"}\': publish the prefix cache\'s KV events over ZMQ')
    p.add_argument("--encoder-only", action="store_true",
                   help="SGLang's flag: an encode worker of a multimodal model (tiny-mm): serves "
                        "POST /encode and ships the embeddings to prefills, generates nothing")
    p.add_argument("--mm-embedding-cache-items", type=int, default=256,
                   help="image embeddings kept by content hash, so a repeated image is encoded once "
                        "(0: no cache)")
    p.add_argument("--mm-embedding-staging-slots", type=int, default=64,
                   help="EPD with --disaggregation-transfer-backend mooncake: embeddings' slots in a "
                        "staging area registered with Mooncake TE at startup (a prefill receives into "
                        "one per waiting registration, an encode worker writes from one); with none "
                        "free an embedding goes as TCP frames; 0: always TCP frames")
    p.add_argument("--log-level", default="info")
    p.add_argument("--grpc-service", choices=["sglang", "vllm"], default=None,
                   help="serve gRPC on --port (SGLang's scheduler service or vLLM's engine service, "
                        "the smg-grpc-proto contract) with the HTTP surface on --port + 1")
    p.add_argument("--smg-grpc-mode", dest="grpc_service", action="store_const", const="sglang",
                   help="SGLang's flag: the same as --grpc-service sglang")
    p.add_argument("--export-tokenizer", metavar="DIR", default=None,
                   help="write the model's Hugging Face tokenizer files (tokenizer.json, "
                        "tokenizer_config.json with the chat template, config.json, "
                        "generation_config.json) into DIR and exit: a gateway's --model-path")
    p.add_argument("--export-model", metavar="DIR", default=None,
                   help="write the preset --model (weights from --seed) as a whole Hugging Face Llama "
                        "checkpoint into DIR (the --export-tokenizer files plus model.safetensors, "
                        "float32) and exit: real vLLM and this engine then serve the same model")


# Test-only fault hooks the CLI takes from the environment (tests/engine/test_faults.py).
FAULT_ENV = {"fault_send_delay": ("PDGATE_ENGINE_FAULT_SEND_DELAY", float),
             "fault_frame_pages": ("PDGATE_ENGINE_FAULT_FRAME_PAGES", int)}


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The typed config of the parsed flags (the export flags are the CLI's own, not the
    engine's), with the fault hooks from the environment."""
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    for name, (var, kind) in FAULT_ENV.items():
        values[name] = kind(os.environ.get(var, "0") or 0)
    return EngineConfig(**values)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except _SETUP_ERRORS as e:  # the library raises; the CLI exits 1 with the message, as ever
        raise SystemExit(str(e)) from None


def _run(args: argparse.Namespace) -> int:
    if args.export_model:
        from .hf_export import export_model

        try:
            paths = export_model(args.model, args.export_model, args.seed)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        for path in paths:
            print(path)
        return 0
    if args.export_tokenizer:
        from .hf_export import export

        for path in export(args.model, args.export_tokenizer):
            print(path)
        return 0
    from .parent_watch import install_from_env
    from .server import serve  # numpy and aiohttp load only when a worker really runs

    install_from_env()
    config = config_from_args(args).resolved()
    logging.basicConfig(level=getattr(logging, str(config.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = asyncio.run(serve(config))
    except KeyboardInterrupt:
        code = 0
    if config.disaggregation_transfer_backend == "nixl":
        # nixl-cu12 1.5.1 crashes the interpreter's teardown (SIGSEGV, exit 139) once an agent with
        # a progress thread exists, so every clean stop would look like a crash to the supervisor.
        # The engine has shut down by now (servers closed, pages freed): skip the teardown.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    return code


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdgate.engine",
                                description="pdgate reference engine worker")
    add_arguments(p)
    return run(p.parse_args(argv))
