"""`EngineConfig`: everything a reference engine worker is started with, as one typed value.

The CLI (`cli.py`) builds it from its flags; a program builds it directly. Defaults are the
CLI's defaults, except that nothing here reads the environment: the CLI takes the SGLang/vLLM
environment variables it honours (timeouts, the side channel port, test fault hooks) into the
fields itself. `resolved()` fills what one field implies for another and checks the whole; the
engine resolves the config it is given, so a caller need not.
"""

from __future__ import annotations

import dataclasses
import json
import socket
from dataclasses import dataclass
from typing import Any, Optional

from .errors import EngineConfigError

MODES = ("null", "prefill", "decode")
TRANSFER_BACKENDS = ("tcp", "mooncake", "nixl")
LOAD_FAILURE_POLICIES = ("fail", "recompute")
API_FLAVORS = ("sglang", "vllm")
GRPC_SERVICES = ("sglang", "vllm")
ENCODE_FAULTS = ("hang", "garbage", "bad-embedding")
# vLLM's disaggregated encoder (`--ec-transfer-config`, vllm/config/ec_transfer.py): the
# connector the engine implements, the roles, and every field vLLM's config takes.
EC_CONNECTORS = ("ECExampleConnector",)
EC_ROLES = ("ec_producer", "ec_consumer", "ec_both")
EC_FIELDS = ("ec_connector", "engine_id", "ec_buffer_device", "ec_buffer_size", "ec_role", "ec_ip",
             "ec_port", "ec_connector_extra_config", "ec_connector_module_path")
EC_DEFAULT_STORAGE_PATH = "/tmp"  # ECExampleConnector's default shared_storage_path


@dataclass(frozen=True)
class EngineConfig:
    """One worker's configuration; each field is the CLI flag of the same name (docs/engine.md)."""

    model: str = "tiny"
    served_model_name: Optional[str] = None
    host: str = "127.0.0.1"
    port: int = 30000
    advertise_host: Optional[str] = None
    seed: int = 0
    page_size: int = 16
    max_total_tokens: int = 65536
    chunked_prefill_size: int = 8192
    max_running_requests: int = 256
    queue_timeout: float = 600.0
    disaggregation_mode: Optional[str] = None        # None: from kv_transfer_config's kv_role
    disaggregation_bootstrap_port: int = 8998
    disaggregation_transfer_backend: str = "tcp"
    kv_transfer_config: Any = None                   # vLLM's JSON text or its dict
    ec_transfer_config: Any = None                   # vLLM's ECTransferConfig JSON text or its dict
    kv_load_failure_policy: str = "fail"
    transfer_port: int = 0
    engine_id: Optional[str] = None
    bootstrap_timeout: float = 300.0
    waiting_timeout: float = 300.0
    transfer_timeout: float = 60.0
    kv_lease_timeout: float = 480.0
    fault_kill_after_tokens: int = 0
    fault_drop_after_tokens: int = 0
    fault_slow_health: float = 0.0
    fault_encode: Optional[str] = None               # encode workers: hang | garbage | bad-embedding
    fault_send_delay: float = 0.0                    # seconds before each KV frame (tests only)
    fault_frame_pages: int = 0                       # pages per KV frame, 0: by size (tests only)
    api_flavor: Optional[str] = None                 # None: vllm with kv_transfer_config, else sglang
    vllm_endpoints_only: bool = False
    enable_prefix_caching: bool = True
    kv_events_config: Any = None                     # vLLM's KVEventsConfig JSON, dict or parsed
    encoder_only: bool = False                       # SGLang's --encoder-only: an EPD encode worker
    mm_embedding_cache_items: int = 256
    mm_embedding_staging_slots: int = 64             # embeddings in flight over Mooncake TE at once
    log_level: str = "info"
    grpc_service: Optional[str] = None

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def resolved(self) -> "EngineConfig":
        """A copy with what one field implies for another filled in, checked as a whole;
        `EngineConfigError` names the first problem. Resolving twice changes nothing."""
        from .kv_events import parse_config  # zmq/msgpack only when a worker is configured

        _check_choices(self)
        kv = _transfer_config(self.kv_transfer_config)
        events = parse_config(self.kv_events_config)
        if events.active and not self.enable_prefix_caching:
            raise EngineConfigError("--kv-events-config publishes the prefix cache's events: it needs prefix caching on")
        mode = self.disaggregation_mode
        if mode is None:
            mode = {"kv_producer": "prefill", "kv_consumer": "decode"}.get((kv or {}).get("kv_role"), "null")
        engine_id = self.engine_id
        if kv and kv.get("engine_id") and not engine_id:
            engine_id = str(kv["engine_id"])
        advertise = self.advertise_host
        if not advertise:
            wildcard = self.host in ("0.0.0.0", "::", "")
            advertise = socket.gethostbyname(socket.gethostname()) if wildcard else self.host
        ec = _ec_transfer_config(self.ec_transfer_config)
        if ec is not None and self.encoder_only:
            raise EngineConfigError("--ec-transfer-config (vLLM's encoder disaggregation) and --encoder-only "
                                    "(SGLang's / TokenSpeed's encode role) are two ways to be an encoder: pick one")
        if ec is not None and ec["ec_role"] == "ec_producer" and mode != "null":
            raise EngineConfigError("--ec-transfer-config ec_role ec_producer is an encoder-only instance: "
                                    "no --disaggregation-mode prefill/decode or kv_role kv_producer/kv_consumer")
        if self.encoder_only and mode != "null":
            raise EngineConfigError("--encoder-only is a role of its own: no --disaggregation-mode / kv_role")
        if self.fault_encode is not None and not self.encoder_only:
            raise EngineConfigError("--fault-encode is a fault of an encode worker: it needs --encoder-only")
        if self.mm_embedding_cache_items < 0:
            raise EngineConfigError("--mm-embedding-cache-items must be >= 0")
        if self.mm_embedding_staging_slots < 0:
            raise EngineConfigError("--mm-embedding-staging-slots must be >= 0")
        if self.page_size < 1 or self.max_total_tokens < self.page_size:
            raise EngineConfigError("--page-size must be >= 1 and --max-total-tokens >= --page-size")
        return self.replace(kv_transfer_config=kv, ec_transfer_config=ec, kv_events_config=events,
                            disaggregation_mode=mode,
                            api_flavor=self.api_flavor or ("vllm" if kv or ec else "sglang"),
                            vllm_endpoints_only=bool(self.vllm_endpoints_only), engine_id=engine_id,
                            advertise_host=advertise)


def _transfer_config(cfg: Any) -> Optional[dict]:
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except json.JSONDecodeError as e:
            raise EngineConfigError(f"--kv-transfer-config is not JSON: {e}") from None
    if cfg is None:
        return None
    if not isinstance(cfg, dict) or "kv_connector" not in cfg:
        raise EngineConfigError("--kv-transfer-config needs at least kv_connector")
    return cfg


def _ec_transfer_config(cfg: Any) -> Optional[dict]:
    """vLLM's `--ec-transfer-config`, checked: ECExampleConnector (the shared-storage one) is the
    only connector here, `ec_role` one of the three, `shared_storage_path` a path (default
    /tmp, as vLLM). Returns the dict with `ec_connector_extra_config.shared_storage_path` filled."""
    if isinstance(cfg, str):
        try:
            cfg = json.loads(cfg)
        except json.JSONDecodeError as e:
            raise EngineConfigError(f"--ec-transfer-config is not JSON: {e}") from None
    if cfg is None:
        return None
    if not isinstance(cfg, dict):
        raise EngineConfigError("--ec-transfer-config must be a JSON object")
    unknown = sorted(set(cfg) - set(EC_FIELDS))
    if unknown:
        raise EngineConfigError(f"--ec-transfer-config: unknown field(s) {', '.join(unknown)} "
                                f"(vLLM's ECTransferConfig has {', '.join(EC_FIELDS)})")
    connector = cfg.get("ec_connector")
    if connector not in EC_CONNECTORS:
        raise EngineConfigError(f"--ec-transfer-config ec_connector {connector!r} is not supported: the reference "
                                f"engine implements {', '.join(EC_CONNECTORS)} (embeddings through a shared folder)")
    if cfg.get("ec_connector_module_path") is not None:
        raise EngineConfigError("--ec-transfer-config ec_connector_module_path: the reference engine loads no "
                                "connector module")
    if cfg.get("ec_role") not in EC_ROLES:
        raise EngineConfigError(f"--ec-transfer-config ec_role {cfg.get('ec_role')!r}: expected one of "
                                f"{', '.join(EC_ROLES)}")
    extra = cfg.get("ec_connector_extra_config")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise EngineConfigError("--ec-transfer-config ec_connector_extra_config must be an object")
    path = extra.get("shared_storage_path", EC_DEFAULT_STORAGE_PATH)
    if not isinstance(path, str) or not path:
        raise EngineConfigError("--ec-transfer-config ec_connector_extra_config.shared_storage_path must be "
                                "a non-empty string (a folder every encoder and consumer can reach)")
    return dict(cfg, ec_connector_extra_config=dict(extra, shared_storage_path=path))


def _check_choices(c: EngineConfig) -> None:
    """What argparse's `choices` checks for the CLI, for configs built in code."""
    for flag, value, allowed in (("--disaggregation-mode", c.disaggregation_mode, MODES),
                                 ("--disaggregation-transfer-backend", c.disaggregation_transfer_backend,
                                  TRANSFER_BACKENDS),
                                 ("--kv-load-failure-policy", c.kv_load_failure_policy, LOAD_FAILURE_POLICIES),
                                 ("--api-flavor", c.api_flavor, API_FLAVORS),
                                 ("--grpc-service", c.grpc_service, GRPC_SERVICES),
                                 ("--fault-encode", c.fault_encode, ENCODE_FAULTS)):
        if value is not None and value not in allowed:
            raise EngineConfigError(f"{flag} {value!r}: expected one of {', '.join(allowed)}")
