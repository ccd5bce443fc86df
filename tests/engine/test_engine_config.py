"""The engine as a library (issue 28 item 4): built from a typed `EngineConfig` without argparse,
bad configs raise `EngineConfigError` (never `SystemExit`), a start that cannot bind raises
`EngineStartError`, importing reads no environment variable, and the CLI's flags are the
config's fields with the same defaults."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import sys

import pytest

import pdgate
from pdgate.engine import EngineConfig, EngineConfigError, EngineStartError

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "python")


async def _generate(config: EngineConfig, ids: list[int], max_new: int) -> tuple[dict, dict]:
    """Run the engine's HTTP surface in this process: /generate's answer and /server_info."""
    from aiohttp.test_utils import TestClient, TestServer

    from pdgate.engine import Engine
    from pdgate.engine.server import engine_app

    engine = Engine(config)
    await engine.start()
    client = TestClient(TestServer(engine_app(engine)))
    await client.start_server()
    try:
        r = await client.post("/generate", json={"input_ids": ids, "sampling_params": {
            "max_new_tokens": max_new, "temperature": 0}})
        assert r.status == 200, await r.text()
        out = await r.json()
        info = await (await client.get("/server_info")).json()
    finally:
        await client.close()
        await engine.stop()
    return out, info


def test_engine_from_a_typed_config():
    config = EngineConfig(model="tiny", max_total_tokens=4096, page_size=8, served_model_name="t")
    out, info = asyncio.run(_generate(config, [256, *b"Hello"], 6))
    assert len(out["output_ids"]) == 6 and out["meta_info"]["prompt_tokens"] == 6
    assert info["page_size"] == 8 and info["served_model_name"] == "t" and info["disaggregation_mode"] == "null"
    again, _ = asyncio.run(_generate(config, [256, *b"Hello"], 6))
    assert again["output_ids"] == out["output_ids"]  # same seed, same weights, greedy


def test_resolved_fills_what_fields_imply():
    kv = {"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "e1"}
    c = EngineConfig(kv_transfer_config=json.dumps(kv)).resolved()
    assert (c.disaggregation_mode, c.api_flavor, c.engine_id, c.kv_transfer_config) == ("prefill", "vllm", "e1", kv)
    assert c.resolved() == c  # idempotent: the engine resolves what it is given
    plain = EngineConfig().resolved()
    assert (plain.disaggregation_mode, plain.api_flavor, plain.advertise_host) == ("null", "sglang", "127.0.0.1")


@pytest.mark.parametrize("changes, why", [
    ({"page_size": 0}, "--page-size"),
    ({"max_total_tokens": 4, "page_size": 16}, "--max-total-tokens"),
    ({"kv_transfer_config": "not json"}, "not JSON"),
    ({"kv_transfer_config": {"kv_role": "kv_producer"}}, "kv_connector"),
    ({"kv_events_config": '{"publisher": "kafka"}'}, "publisher"),
    ({"kv_events_config": '{"enable_kv_cache_events": true, "publisher": "zmq"}', "enable_prefix_caching": False},
     "prefix caching"),
    ({"disaggregation_mode": "both"}, "--disaggregation-mode"),
    ({"disaggregation_transfer_backend": "rdma"}, "--disaggregation-transfer-backend"),
    ({"grpc_service": "trtllm"}, "--grpc-service"),
])
def test_a_bad_config_raises_the_engine_s_exception(changes, why):
    with pytest.raises(EngineConfigError, match=why):  # a SystemExit would escape pytest.raises
        EngineConfig(**changes).resolved()


def test_an_unknown_model_raises_when_the_engine_is_built():
    from pdgate.engine import Engine

    with pytest.raises(EngineConfigError, match="not a preset"):
        Engine(EngineConfig(model="no-such-model"))


def test_the_exceptions_are_pdgate_s():
    assert issubclass(EngineConfigError, pdgate.ConfigError) and issubclass(EngineConfigError, ValueError)
    assert issubclass(EngineStartError, pdgate.PdgateError) and issubclass(EngineStartError, RuntimeError)


def test_a_port_in_use_raises_engine_start_error():
    from pdgate.engine import serve

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(EngineStartError, match="address already in use"):
            asyncio.run(serve(EngineConfig(port=port, max_total_tokens=4096)))


def test_cli_flags_are_the_config_fields_with_its_defaults(monkeypatch):
    from pdgate.engine.cli import FAULT_ENV, add_arguments, config_from_args

    for var in ("VLLM_NIXL_SIDE_CHANNEL_PORT", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
                "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "PDGATE_ENGINE_TRANSFER_TIMEOUT",
                "VLLM_NIXL_ABORT_REQUEST_TIMEOUT", *(v for v, _ in FAULT_ENV.values())):
        monkeypatch.delenv(var, raising=False)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = set(vars(parser.parse_args([])))
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert flags - fields == {"export_tokenizer", "export_model"}  # the CLI's own actions
    assert fields - flags == set(FAULT_ENV)  # test hooks the CLI takes from the environment
    assert config_from_args(parser.parse_args([])) == EngineConfig()
    monkeypatch.setenv("PDGATE_ENGINE_FAULT_SEND_DELAY", "0.25")
    monkeypatch.setenv("SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "7")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    c = config_from_args(parser.parse_args([]))
    assert (c.fault_send_delay, c.bootstrap_timeout) == (0.25, 7.0)


# Imports every engine module with os.environ reads traced; fails if one is made from the
# engine's own code while it is imported.
_TRACE = r"""
import importlib, os, pkgutil, sys, traceback
hits = []
orig = type(os.environ).__getitem__
def traced(self, key):
    # the reader: the innermost frame that is not os.environ's own mapping machinery
    stack = [f.filename for f in traceback.extract_stack()[:-1]]
    reader = next(f for f in reversed(stack) if "_collections_abc" not in f and f not in (os.__file__, "<frozen os>"))
    if os.sep + os.path.join("pdgate", "engine") + os.sep in reader:
        hits.append(key)
    return orig(self, key)
type(os.environ).__getitem__ = traced
import pdgate.engine
for m in pkgutil.walk_packages(pdgate.engine.__path__, "pdgate.engine."):
    if m.name.endswith("__main__"):
        continue  # it runs the CLI
    importlib.import_module(m.name)
print(sorted(set(hits)))
"""


def test_importing_the_engine_reads_no_environment():
    env = dict(os.environ, PYTHONPATH=SRC, PDGATE_ENGINE_FAULT_SEND_DELAY="1", VLLM_NIXL_SIDE_CHANNEL_PORT="1")
    out = subprocess.run([sys.executable, "-c", _TRACE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
