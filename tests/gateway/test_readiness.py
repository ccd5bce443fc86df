"""/readiness in PD mode: 503 until a healthy prefill AND a healthy decode exist."""

from __future__ import annotations

import httpx

from tests.conftest import Processes
from tests.gateway.harness import wait_status
from tests.gateway.stacks import pd_stack
from tests.mock_workers import MockHost


def test_readiness_follows_worker_health(mocks: MockHost, processes: Processes) -> None:
    stack = pd_stack(mocks, processes, "bootstrap", decode_knobs={"healthy": False}, wait_ready=False)
    ready = stack.url + "/readiness"
    # No healthy decode yet: not ready, though the process is alive.
    assert wait_status(ready, 503) == 503
    assert httpx.get(stack.url + "/liveness", timeout=5).status_code == 200
    mocks.set_knobs(stack.decode, healthy=True)
    assert wait_status(ready, 200) == 200
    mocks.set_knobs(stack.prefill, healthy=False)
    assert wait_status(ready, 503) == 503
    mocks.set_knobs(stack.prefill, healthy=True)
    assert wait_status(ready, 200) == 200
