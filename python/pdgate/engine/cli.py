"""Command line of a reference worker: SGLang-style flags plus vLLM's `--kv-transfer-config`.

`add_arguments(parser)` and `run(args)` are what `pdgate engine` wires in;
`python -m pdgate.engine` uses them directly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys


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


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill what one flag implies for another; raise SystemExit on contradictions."""
    cfg = args.kv_transfer_config
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--kv-transfer-config is not JSON: {e}") from None
        if not isinstance(cfg, dict) or "kv_connector" not in cfg:
            raise SystemExit("--kv-transfer-config needs at least kv_connector")
    args.kv_transfer_config = cfg
    from .kv_events import parse_config

    args.kv_events_config = parse_config(args.kv_events_config)
    if args.kv_events_config.active and not args.enable_prefix_caching:
        raise SystemExit("--kv-events-config publishes the prefix cache's events: it needs prefix caching on")
    if args.disaggregation_mode is None:
        role = (cfg or {}).get("kv_role")
        args.disaggregation_mode = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(role, "null")
    if getattr(args, "api_flavor", None) is None:
        args.api_flavor = "vllm" if cfg else "sglang"
    args.vllm_endpoints_only = bool(getattr(args, "vllm_endpoints_only", False))
    if cfg and cfg.get("engine_id") and not args.engine_id:
        args.engine_id = str(cfg["engine_id"])
    if not args.advertise_host:
        wildcard = args.host in ("0.0.0.0", "::", "")
        args.advertise_host = socket.gethostbyname(socket.gethostname()) if wildcard else args.host
    if args.page_size < 1 or args.max_total_tokens < args.page_size:
        raise SystemExit("--page-size must be >= 1 and --max-total-tokens >= --page-size")
    return args


def run(args: argparse.Namespace) -> int:
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
    args = resolve(args)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = asyncio.run(serve(args))
    except KeyboardInterrupt:
        code = 0
    if args.disaggregation_transfer_backend == "nixl":
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
