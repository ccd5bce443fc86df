"""A client's mistake gets a 4xx with an OpenAI-style error body: never a 5xx, a panic or a hang."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import Processes
from tests.gateway.stacks import Stack, pd_stack, regular_stack
from tests.mock_workers import MockHost

LIMIT = 4096


@pytest.fixture(params=["regular", "pd"])
def stack(request: pytest.FixtureRequest, mocks: MockHost, processes: Processes) -> Stack:
    args = ["--max-payload-size", str(LIMIT)]
    if request.param == "pd":
        return pd_stack(mocks, processes, "bootstrap", args=args)
    return regular_stack(mocks, processes, args=args)


def assert_client_error(resp: httpx.Response, status: int | None = None) -> None:
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text)
    if status is not None:
        assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert {"type", "code", "param"} <= set(error)


CASES = {
    "malformed_json": ("/v1/completions", b'{"prompt": "x", '),
    "not_an_object": ("/v1/chat/completions", b"[1, 2, 3]"),
    "wrong_type": ("/v1/completions", b'{"model": "m", "prompt": "x", "max_tokens": "many"}'),
    "missing_prompt": ("/v1/completions", b'{"model": "m", "max_tokens": 3}'),
    "missing_messages": ("/v1/chat/completions", b'{"model": "m"}'),
    "generate_without_input": ("/generate", b'{"sampling_params": {"max_new_tokens": 2}}'),
    "stream_not_bool": ("/v1/completions", b'{"model": "m", "prompt": "x", "stream": "yes"}'),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_bodies(case: str, stack: Stack) -> None:
    path, body = CASES[case]
    resp = httpx.post(stack.url + path, content=body, headers={"content-type": "application/json"}, timeout=10)
    assert_client_error(resp)


def test_body_over_limit(stack: Stack) -> None:
    body = b'{"model": "m", "prompt": "' + b"x" * (LIMIT * 2) + b'"}'
    resp = httpx.post(stack.url + "/v1/completions", content=body, headers={"content-type": "application/json"}, timeout=10)
    assert_client_error(resp, 413)


def test_unknown_route(stack: Stack) -> None:
    assert_client_error(httpx.get(stack.url + "/v1/nope", timeout=10), 404)


def test_gateway_still_serves_after_bad_input(stack: Stack) -> None:
    httpx.post(stack.url + "/v1/completions", content=b"{", timeout=10)
    ok = httpx.post(stack.url + "/v1/completions", json={"model": "m", "prompt": "x y", "max_tokens": 2}, timeout=10)
    assert ok.status_code == 200, ok.text
