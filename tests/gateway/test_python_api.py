"""`pdgate.Gateway` in this process: start, serve, stop, errors."""

from __future__ import annotations

import socket

import httpx
import pytest

import pdgate
from tests.mock_workers import BootstrapDecode, BootstrapPrefill, MockHost, MockWorker
from tests.mock_workers.model import expected_text


def test_context_manager_serves_and_stops(mocks: MockHost) -> None:
    worker = mocks.start(MockWorker())
    gateway = pdgate.Gateway(worker_urls=[worker.url], port=0)
    assert not gateway.running and gateway.url is None
    with gateway as gw:
        assert gw.running and gw.port and gw.url == f"http://127.0.0.1:{gw.port}"
        resp = httpx.post(gw.url + "/v1/completions", json={"model": "m", "prompt": "a b", "max_tokens": 3}, timeout=10)
        assert resp.json()["choices"][0]["text"] == expected_text("completions", {"prompt": "a b", "max_tokens": 3})[0]
        port = gw.port
    assert not gateway.running
    gateway.stop()  # idempotent
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/liveness", timeout=2)


def test_pd_mode_in_process(mocks: MockHost) -> None:
    prefill = mocks.start(BootstrapPrefill())
    decode = mocks.start(BootstrapDecode())
    options = {
        "pd_disaggregation": True,
        "prefill": [[prefill.url, prefill.bootstrap_port]],
        "decode": [decode.url],
        "port": 0,
        "request_timeout_secs": 10,
    }
    with pdgate.Gateway(**options) as gw:
        body = {"text": "hello pd world", "sampling_params": {"max_new_tokens": 4}}
        resp = httpx.post(gw.url + "/generate", json=body, timeout=10)
        assert resp.status_code == 200, resp.text
        assert resp.json()["text"] == expected_text("generate", body)[0]
    assert mocks.state(prefill)["violations"] == [] and mocks.state(decode)["violations"] == []


def test_restart_after_stop(mocks: MockHost) -> None:
    worker = mocks.start(MockWorker())
    gateway = pdgate.Gateway(worker_urls=[worker.url], port=0)
    gateway.start()
    gateway.stop()
    gateway.start()
    try:
        assert httpx.get(gateway.url + "/liveness", timeout=5).status_code == 200
    finally:
        gateway.stop()


def test_start_twice_is_a_state_error(mocks: MockHost) -> None:
    worker = mocks.start(MockWorker())
    with pdgate.Gateway(worker_urls=[worker.url], port=0) as gw:
        with pytest.raises(pdgate.GatewayStateError):
            gw.start()


def test_port_in_use_is_a_start_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        gateway = pdgate.Gateway(port=taken.getsockname()[1])
        with pytest.raises(pdgate.GatewayStartError):
            gateway.start()
        assert not gateway.running


def test_unknown_option_is_named() -> None:
    with pytest.raises(pdgate.ConfigError, match="prefil_policy"):
        pdgate.Gateway(prefil_policy="random")


@pytest.mark.parametrize(
    "options",
    [
        {"policy": "no-such-policy"},
        {"port": "eighty"},
        {"prefill": [["http://127.0.0.1:1", 8998]]},  # needs pd_disaggregation
        {"pd_disaggregation": True, "prefill": [["ftp://x", 1]]},
        {"request_timeout_secs": 0},
    ],
)
def test_invalid_values_are_config_errors(options: dict) -> None:
    with pytest.raises(pdgate.ConfigError) as info:
        pdgate.Gateway(**options)
    assert isinstance(info.value, ValueError)
    assert str(info.value)


def test_config_holds_every_option_with_defaults() -> None:
    config = pdgate.Gateway().config
    names = {o["name"] for o in pdgate.config_schema()}
    assert set(config) == names
    assert config["port"] == 30000 and config["host"] == "127.0.0.1"
