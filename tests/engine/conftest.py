"""Fixtures for the reference engine tests: real worker processes on free loopback ports.

Workers are shared per session where tests only read them, and private where a test kills or
starves one. Every worker is stopped (SIGTERM, then SIGKILL) when its fixture ends.
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

try:
    import pdgate  # noqa: F401  the installed package (with the compiled gateway) wins
except ImportError:
    # The engine is pure Python: it also runs from the source tree without a build.
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "python"))

from pdgate.workers import ReferenceWorker  # noqa: E402

# Short deadlines so that fault tests end in seconds; large enough for a loaded 2-core machine.
FAULT_ARGS = ["--bootstrap-timeout", "3", "--waiting-timeout", "4", "--transfer-timeout", "3",
              "--kv-lease-timeout", "3"]


def start_all(*workers: ReferenceWorker) -> tuple[ReferenceWorker, ...]:
    """Start workers in parallel; on any failure stop all of them and re-raise."""
    with ThreadPoolExecutor(len(workers)) as ex:
        futures = [ex.submit(w.start, 90) for w in workers]
        errors = [f.exception() for f in futures]
    if any(errors):
        for w in workers:
            w.stop()
        raise next(e for e in errors if e)
    return workers


def loads(w: ReferenceWorker) -> dict:
    return httpx.get(w.url + "/v1/loads", timeout=10).json()["loads"][0]


def wait_until(pred, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def assert_clean(*workers: ReferenceWorker, timeout: float = 10) -> None:
    """No page reserved, in use or pinned; nothing live, held or pending on any worker, and no
    transfer row that has not ended (Failed or Success)."""
    for w in workers:
        def clean(w=w):
            ld = loads(w)
            kv, dis = ld["kv_pages"], ld["disaggregation"]
            return (kv["reserved"] == kv["in_use"] == kv["pinned"] == 0 and kv["free"] + kv.get("cached", 0) == kv["total"]
                    and ld["num_live_reqs"] == 0 and dis["held_for_pull"] == 0
                    and dis["pending_registrations"] == 0
                    and not any(dis["transfers_in_flight"].values())) and ld
        wait_until(clean, timeout, f"{w} to be clean: {loads(w)}")


def _pair(mode_args, **kw):
    p = ReferenceWorker(mode="prefill", **kw, extra_args=mode_args)
    d = ReferenceWorker(mode="decode", **kw, extra_args=mode_args)
    return p, d


@pytest.fixture(scope="session")
def workers():
    """One colocated worker plus a prefill/decode pair per protocol (default timeouts)."""
    n = ReferenceWorker(mode="null")
    chunked = ReferenceWorker(mode="null", extra_args=["--chunked-prefill-size", "24"])
    sp, sd = _pair([])
    np_, nd = _pair([], kv_connector="NixlConnector")
    mp, md = _pair([], kv_connector="MooncakeConnector")
    ws = start_all(n, chunked, sp, sd, np_, nd, mp, md)
    try:
        yield {"null": n, "chunked": chunked, "sglang": (sp, sd), "nixl": (np_, nd), "mooncake": (mp, md)}
    finally:
        for w in ws:
            w.stop()


@pytest.fixture(scope="session")
def colocated(workers):
    return workers["null"]


@pytest.fixture
def fault_pair():
    """A bootstrap-style pair with short deadlines, private to one test (it may be killed)."""
    p, d = _pair(FAULT_ARGS)
    start_all(p, d)
    try:
        yield p, d
    finally:
        p.stop()
        d.stop()
