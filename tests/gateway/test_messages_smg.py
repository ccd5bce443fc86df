"""The same Messages requests through SMG 1.13 and through pdgate, in front of the same reference
workers (issue 29 item 6). What differs is written down in docs/migrating-from-smg.md,
"Messages API"; this test keeps that list true. Skips when `smg` is not installed
(pip install smg==1.13.0)."""

from __future__ import annotations

import contextlib
import json
import tempfile
from typing import Any, Iterator

import httpx
import pytest

import pdgate
from pdgate.workers import ReferenceWorker
from tests.gateway.grpc_stacks import export_model_dir, start
from tests.gateway.harness import wait_status
from tests.gateway.test_smg_compat import smg_binary
from tests.gateway.test_smg_grpc_interop import smg_router as smg_grpc_router

pytestmark = pytest.mark.timeout(300)
MESSAGES = [{"role": "user", "content": "Hello there"}]
CREATE = {"model": "tiny", "max_tokens": 8, "temperature": 0, "system": "Be brief.", "messages": MESSAGES}


@contextlib.contextmanager
def smg_router(model_dir: str, flags: list[str]) -> Iterator[str]:
    """SMG 1.13 in front of `flags`' workers (test_smg_grpc_interop's launcher); skips without it."""
    smg = smg_binary()
    if smg is None:
        pytest.skip("smg is not installed (pip install smg==1.13.0)")
    with smg_grpc_router(smg, model_dir, flags) as url:
        yield url


@contextlib.contextmanager
def both(grpc: bool) -> Iterator[tuple[str, str]]:
    """SMG and pdgate in PD (bootstrap) mode in front of one prefill and one decode."""
    if smg_binary() is None:
        pytest.skip("smg is not installed (pip install smg==1.13.0)")
    model_dir = export_model_dir(tempfile.mkdtemp(prefix="tiny-model-"))
    service: dict[str, Any] = {"grpc_service": "sglang"} if grpc else {}
    p, d = ReferenceWorker(mode="prefill", model="tiny", **service), ReferenceWorker(mode="decode", model="tiny", **service)
    try:
        start([p, d])
        purl, durl = (p.grpc_url, d.grpc_url) if grpc else (p.url, d.url)
        with smg_router(model_dir, ["--pd-disaggregation", "--prefill", purl, str(p.bootstrap_port), "--decode", durl]) as smg:
            with pdgate.Gateway(pd_disaggregation=True, port=0, prefill=[[purl, p.bootstrap_port]], decode=[durl], model_path=model_dir,
                                health_check_interval_secs=1, health_success_threshold=1) as gw:
                assert wait_status(gw.url + "/readiness", 200, timeout=60) == 200
                yield smg, gw.url
    finally:
        p.stop()
        d.stop()


def events(url: str, body: dict) -> list[tuple[str, dict]]:
    out, name = [], None
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                out.append((name, json.loads(line[len("data: "):])))
    return out


def text(evs: list[tuple[str, dict]]) -> str:
    return "".join(d["delta"]["text"] for n, d in evs if n == "content_block_delta")


def test_over_grpc_workers_the_answers_agree_and_the_differences_are_the_documented_ones() -> None:
    with both(grpc=True) as (smg, pd):
        a, b = (httpx.post(u + "/v1/messages", json=CREATE, timeout=60) for u in (smg, pd))
        assert a.status_code == b.status_code == 200, (a.text, b.text)
        sa, pa = a.json(), b.json()
        assert sa["content"] == pa["content"] and sa["stop_reason"] == pa["stop_reason"]
        assert sa["usage"]["output_tokens"] == pa["usage"]["output_tokens"]
        # Documented: SMG counts the whole prompt as input_tokens and reports no cache read;
        # pdgate follows the worker's cached-token report (the PD decode's: the prompt arrived
        # as KV), so input_tokens + cache_read_input_tokens is SMG's input_tokens.
        assert sa["usage"]["cache_read_input_tokens"] == 0
        assert pa["usage"]["input_tokens"] + pa["usage"].get("cache_read_input_tokens", 0) == sa["usage"]["input_tokens"]
        # Documented: SMG's extra fields.
        assert {"stop_details", "container"} <= set(sa) and not {"stop_details", "container"} & set(pa)
        ea, eb = events(smg, CREATE), events(pd, CREATE)
        assert text(ea) == text(eb) == sa["content"][0]["text"]
        assert [n for n, _ in ea if n != "ping"] [:2] == [n for n, _ in eb if n != "ping"][:2] == ["message_start", "content_block_start"]
        assert "ping" not in [n for n, _ in ea] and "ping" in [n for n, _ in eb]
        assert ea[-1][0] == eb[-1][0] == "message_stop"
        count = {"model": "tiny", "system": "Be brief.", "messages": MESSAGES}
        ca, cb = (httpx.post(u + "/v1/messages/count_tokens", json=count, timeout=60).json() for u in (smg, pd))
        assert ca == cb
        for body in ({"model": "tiny", "messages": MESSAGES},
                     {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
                     {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                                                                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9", "content": "r"}]}]}):
            ra, rb = (httpx.post(u + "/v1/messages", json=body, timeout=60) for u in (smg, pd))
            assert ra.status_code == rb.status_code == 400, (ra.text, rb.text)
            assert ra.json()["error"]["type"] == rb.json()["error"]["type"] == "invalid_request_error"


def test_over_http_workers_smg_forwards_and_pdgate_translates() -> None:
    """SMG's HTTP PD router sends /v1/messages to the workers as it is: the reference engine (like
    SGLang) does not serve it, so SMG answers 404; pdgate translates and answers."""
    with both(grpc=False) as (smg, pd):
        a, b = (httpx.post(u + "/v1/messages", json=CREATE, timeout=60) for u in (smg, pd))
        assert a.status_code == 404 and a.json()["type"] == "error", a.text
        assert b.status_code == 200 and b.json()["type"] == "message", b.text
        count = {"model": "tiny", "messages": MESSAGES}
        assert httpx.post(smg + "/v1/messages/count_tokens", json=count, timeout=60).status_code == 404
        assert httpx.post(pd + "/v1/messages/count_tokens", json=count, timeout=60).status_code == 200
