"""Mock workers plus `pdgate launch` in front of them, as one fixture-friendly object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import openai

from tests.conftest import Processes
from tests.gateway.harness import GatewayProcess, launch
from tests.mock_workers import (
    BootstrapDecode,
    BootstrapPrefill,
    MockHost,
    MockWorker,
    MooncakeDecode,
    MooncakePrefill,
    NixlDecode,
    NixlPrefill,
)

PD_KINDS = {
    "bootstrap": (BootstrapPrefill, BootstrapDecode),
    "nixl": (NixlPrefill, NixlDecode),
    "mooncake": (MooncakePrefill, MooncakeDecode),
}
# Fast health checks so tests see workers healthy (or not) quickly.
FAST_HEALTH = [
    "--health-check-interval-secs", "1",
    "--health-success-threshold", "1",
    "--health-failure-threshold", "1",
]


@dataclass
class Stack:
    gateway: GatewayProcess
    workers: dict[str, list[MockWorker]]

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def prefill(self) -> Any:
        return self.workers["prefill"][0]

    @property
    def decode(self) -> Any:
        return self.workers["decode"][0]

    def client(self, timeout: float = 10.0) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def prefill_flag(connector: str, worker: Any) -> list[str]:
    port = getattr(worker, "bootstrap_port", None)
    return ["--prefill", worker.url] + ([str(port)] if port else [])


def pd_stack(mocks: MockHost, processes: Processes, connector: str, *, prefills: int = 1,
             prefill_knobs: dict[str, Any] | None = None, decode_knobs: dict[str, Any] | None = None,
             args: list[str] = (), wait_ready: bool = True) -> Stack:
    prefill_kind, decode_kind = PD_KINDS[connector]
    ps = [mocks.start(prefill_kind(**(prefill_knobs or {}))) for _ in range(prefills)]
    d = mocks.start(decode_kind(**(decode_knobs or {})))
    argv = ["--pd-disaggregation", "--kv-connector", connector, *FAST_HEALTH]
    for p in ps:
        argv += prefill_flag(connector, p)
    argv += ["--decode", d.url, *args]
    stack = Stack(launch(processes, argv), {"prefill": ps, "decode": [d]})
    if wait_ready:
        stack.gateway.wait_ready()
    return stack


def regular_stack(mocks: MockHost, processes: Processes, *, workers: int = 1, args: list[str] = ()) -> Stack:
    ws = [mocks.start(MockWorker()) for _ in range(workers)]
    gateway = launch(processes, ["--worker-urls", *[w.url for w in ws], *FAST_HEALTH, *args])
    gateway.wait_ready()
    return Stack(gateway, {"regular": ws})
