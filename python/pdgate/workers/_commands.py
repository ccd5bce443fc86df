"""Command lines for real SGLang and vLLM workers (built here; they need GPUs to run).

Flag names are those of SGLang 0.5.x `sglang.launch_server` (`--model-path`,
`--disaggregation-mode`, `--disaggregation-bootstrap-port`, `--disaggregation-transfer-backend`,
`--disaggregation-ib-device`, `--tp-size`) and vLLM's `vllm serve MODEL --kv-transfer-config JSON`
with `kv_connector` NixlConnector / MooncakeConnector and `kv_role`
kv_producer / kv_consumer / kv_both (vLLM docs, NixlConnector and MooncakeConnector usage guides).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence


def sglang_command(model: str, *, mode: str = "null", host: str = "127.0.0.1", port: int = 30000,
                   bootstrap_port: int | None = None, transfer_backend: str = "mooncake",
                   ib_device: str | None = None, tp_size: int = 1, python: str = "python",
                   extra_args: Sequence[str] = ()) -> list[str]:
    """argv for `python -m sglang.launch_server` as a prefill, decode or regular worker."""
    if mode not in ("prefill", "decode", "null"):
        raise ValueError(f"mode must be prefill, decode or null, not {mode!r}")
    cmd = [python, "-m", "sglang.launch_server", "--model-path", model, "--host", host,
           "--port", str(port), "--tp-size", str(tp_size)]
    if mode != "null":
        cmd += ["--disaggregation-mode", mode, "--disaggregation-transfer-backend", transfer_backend]
        if mode == "prefill":
            cmd += ["--disaggregation-bootstrap-port", str(bootstrap_port or 8998)]
        if ib_device:
            cmd += ["--disaggregation-ib-device", ib_device]
    return cmd + list(extra_args)


def vllm_command(model: str, *, mode: str = "null", host: str = "127.0.0.1", port: int = 8000,
                 kv_connector: str = "NixlConnector", kv_role: str | None = None,
                 tensor_parallel_size: int = 1, kv_extra: Mapping | None = None,
                 vllm: str = "vllm", extra_args: Sequence[str] = ()) -> list[str]:
    """argv for `vllm serve MODEL` with a `--kv-transfer-config` for PD (mode != "null").

    kv_role defaults to kv_producer for prefill and kv_consumer for decode (kv_both is accepted
    by both connectors too). The Mooncake prefill's bootstrap port is set through the
    VLLM_MOONCAKE_BOOTSTRAP_PORT environment variable (default 8998), not a flag.
    """
    if mode not in ("prefill", "decode", "null"):
        raise ValueError(f"mode must be prefill, decode or null, not {mode!r}")
    cmd = [vllm, "serve", model, "--host", host, "--port", str(port),
           "--tensor-parallel-size", str(tensor_parallel_size)]
    if mode != "null":
        role = kv_role or {"prefill": "kv_producer", "decode": "kv_consumer"}[mode]
        cfg: dict = {"kv_connector": kv_connector, "kv_role": role}
        if kv_extra:
            cfg["kv_connector_extra_config"] = dict(kv_extra)
        cmd += ["--kv-transfer-config", json.dumps(cfg, separators=(",", ":"))]
    return cmd + list(extra_args)
