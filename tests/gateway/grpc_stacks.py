"""Gateways in front of gRPC workers for the gRPC fault, resume, breaker and abort tests: the
model directory the gateway tokenizes with, and starting reference engines and a gateway."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pdgate
from pdgate.workers import ReferenceWorker
from tests.gateway.harness import wait_status

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "python")


def export_model_dir(d: str) -> str:
    """`pdgate engine --model tiny --export-tokenizer DIR`: what `--model-path` loads."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-m", "pdgate.engine", "--model", "tiny", "--export-tokenizer", d],
                   check=True, timeout=60, env=env, capture_output=True)
    return d


def start(workers: list[ReferenceWorker]) -> None:
    with ThreadPoolExecutor(len(workers)) as pool:
        list(pool.map(lambda w: w.start(timeout=90), workers))


def gateway(model_dir: str, **options: Any) -> pdgate.Gateway:
    """A started, ready gateway (`with` it, or call `__exit__`); health checked every second."""
    opts: dict[str, Any] = dict(port=0, model_path=model_dir, health_check_interval_secs=1, health_success_threshold=1)
    opts.update(options)
    gw = pdgate.Gateway(**opts)
    gw.__enter__()
    try:
        assert wait_status(gw.url + "/readiness", 200, timeout=60) == 200, "gateway not ready"
    except BaseException:
        gw.__exit__(None, None, None)
        raise
    return gw


def alive(w: ReferenceWorker) -> bool:
    return w.proc is not None and w.proc.poll() is None


def exited_within(w: ReferenceWorker, seconds: float) -> bool:
    """Whether the worker's process has exited, polling up to `seconds` (a worker that kills
    itself mid-stream may still be tearing down when its client has already seen the break)."""
    end = time.monotonic() + seconds
    while w.proc is not None and w.proc.poll() is None:
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)
    return True
