"""One PD leg fails: the client gets an OpenAI-style error promptly, and the other leg is
cancelled (dropped) instead of being left waiting on its peer.

The mocks wait 60 s for a missing peer, the gateway's deadline is 2 s and the client gives up
after 15 s, so only a gateway that cancels the surviving leg passes.
"""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import Processes
from tests.gateway.stacks import pd_stack
from tests.mock_workers import MockHost

FAST_FAIL = ["--request-timeout-secs", "2", "--retry-max-retries", "0"]
BODY = {"model": "mock-model", "prompt": "a prompt that will not finish", "max_tokens": 4}
CLIENT_TIMEOUT_S = 15.0


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S)


def assert_openai_error(resp: httpx.Response, statuses: tuple[int, ...]) -> dict:
    assert resp.status_code in statuses, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert error["message"] and error["type"] and "code" in error and "param" in error
    return error


CASES = {
    # name: (prefill knobs, decode knobs, statuses, leg named in the message)
    "prefill_500": ({"fail_status": 500}, {}, (502, 503), "prefill"),
    "decode_500": ({}, {"fail_status": 500}, (502, 503), "decode"),
    "prefill_never_answers": ({"hang": True}, {}, (504,), None),
    "decode_never_answers": ({}, {"hang": True}, (504,), None),
}


@pytest.mark.parametrize("connector", ["bootstrap", "nixl", "mooncake"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_one_leg_fails(case: str, connector: str, mocks: MockHost, processes: Processes) -> None:
    p_knobs, d_knobs, statuses, leg = CASES[case]
    stack = pd_stack(mocks, processes, connector, args=FAST_FAIL)
    mocks.set_knobs(stack.prefill, **p_knobs)  # after readiness: health checks stay green
    mocks.set_knobs(stack.decode, **d_knobs)
    error = assert_openai_error(post(stack.url, BODY), statuses)
    if leg:
        assert leg in error["message"].lower()
    for worker in (stack.prefill, stack.decode):
        assert mocks.wait_idle(worker, timeout=5), f"{type(worker).__name__} still has a request waiting"


def test_nixl_prefill_failure_never_reaches_decode(mocks: MockHost, processes: Processes) -> None:
    stack = pd_stack(mocks, processes, "nixl", args=FAST_FAIL)
    mocks.set_knobs(stack.prefill, fail_status=500)
    assert_openai_error(post(stack.url, BODY), (502, 503))
    assert mocks.state(stack.decode)["received"] == []


def test_decode_dies_mid_stream_ends_with_an_error_event(mocks: MockHost, processes: Processes) -> None:
    stack = pd_stack(mocks, processes, "bootstrap", args=FAST_FAIL)
    mocks.set_knobs(stack.decode, die_mid_stream=True)
    with httpx.stream("POST", stack.url + "/v1/completions", json={**BODY, "stream": True}, timeout=CLIENT_TIMEOUT_S) as resp:
        assert resp.status_code == 200  # bytes already went out when the decode died
        events = [line for line in resp.iter_lines() if line.startswith("data:")]
    assert "error" in events[-1] or "error" in events[-2], events
    assert mocks.wait_idle(stack.prefill, timeout=5)


def test_retry_picks_another_prefill(mocks: MockHost, processes: Processes) -> None:
    stack = pd_stack(mocks, processes, "bootstrap", prefills=2, args=["--request-timeout-secs", "5", "--retry-max-retries", "2"])
    mocks.set_knobs(stack.workers["prefill"][0], fail_status=500)
    for _ in range(4):  # round robin puts the failing prefill first at least once
        resp = post(stack.url, BODY)
        assert resp.status_code == 200, resp.text
    assert mocks.state(stack.workers["prefill"][0])["received"], "the failing prefill was never tried"
