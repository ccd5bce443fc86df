"""Reference-engine fleets behind `pdgate launch` for the placement benchmarks (not tests).

One fleet per placement, the same number of worker processes in each:
- colocated: N regular workers (continuous batching, chunked prefill), a regular-mode gateway;
- disaggregated: P prefill + (N - P) decode workers, `--pd-disaggregation`;
- conditional: P prefill + D decode + the rest as the regular (colocated) pool beside them,
  `--pd-placement conditional`.
Every process binds 127.0.0.1; every wait has a deadline.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import httpx

from pdgate.workers import ReferenceWorker

__all__ = ["ADMIN_KEY", "Fleet", "start_fleet", "model_priors"]

# One BLAS thread per engine: the machine has 2 cores shared by everyone; more threads per
# process only add contention.
ENGINE_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
ADMIN_KEY = "placement-bench"  # loopback only; `pdgate bench --calibrate` lists workers with it
COMMON = ["--admin-api-key", ADMIN_KEY, "--chars-per-token", "1", "--policy", "least_tokens", "--health-check-interval-secs", "1",
          "--health-success-threshold", "1", "--request-timeout-secs", "120",
          # Early rejection off: the comparison is of placements, and calibration must not be shed.
          "--admission-slack", "0"]


@dataclass
class Fleet:
    name: str
    url: str
    workers: dict[str, list[ReferenceWorker]]
    gateway: subprocess.Popen
    output: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.gateway.poll() is None:
            self.gateway.terminate()
            try:
                self.gateway.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.gateway.kill()
        for pool in self.workers.values():
            for w in pool:
                w.stop()

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def model_priors(service_model: dict[str, Any]) -> list[str]:
    """The gateway's cost-model priors from a calibrated service-time file: the conditional
    decision then starts from the engine's measured costs instead of the design's example."""
    return ["--placement-prefill-base-ms", str(service_model["prefill_a_ms"]),
            "--placement-prefill-ms-per-token", str(service_model["prefill_b_ms"]),
            "--placement-decode-step-ms", str(service_model["decode_step_ms"]),
            "--placement-kv-bytes-per-token", str(service_model["kv_bytes_per_token"]),
            "--placement-link-setup-ms", str(service_model["link_setup_ms"]),
            "--placement-link-gib-per-s", str(service_model["link_gib_per_s"])]


def _worker(mode: str, model: str, chunk: int, log_dir: str, name: str) -> ReferenceWorker:
    return ReferenceWorker(mode=mode, model=model, env=ENGINE_ENV,
                           extra_args=["--chunked-prefill-size", str(chunk)],
                           log_path=os.path.join(log_dir, f"{name}.log"))


def _launch(args: Sequence[str], timeout: float = 60.0) -> tuple[subprocess.Popen, str, list[str]]:
    cmd = [sys.executable, "-m", "pdgate.cli", "launch", "--host", "127.0.0.1", "--port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: "queue.Queue[str]" = queue.Queue()
    output: list[str] = []

    def pump() -> None:
        for line in iter(proc.stdout.readline, ""):  # type: ignore[union-attr]
            output.append(line)
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if "listening on " in line:
            return proc, line.rsplit("listening on ", 1)[1].strip(), output
    proc.kill()
    raise RuntimeError("pdgate launch did not start:\n" + "".join(output))


def _wait_ready(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/readiness", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"gateway {url} not ready after {timeout}s")


def start_fleet(placement: str, *, workers: int = 3, prefill: int = 1, decode: int | None = None,
                model: str = "small", chunk: int = 512, gateway_args: Sequence[str] = (),
                log_dir: str = "/tmp/pdgate-placement") -> Fleet:
    """Start the workers and the gateway of one placement (see the module doc)."""
    os.makedirs(log_dir, exist_ok=True)
    if decode is None:  # conditional: split what the prefill leaves between decode and regular
        decode = max(1, (workers - prefill) // 2)
    plan: dict[str, int] = {"colocated": {"regular": workers},
                            "disaggregated": {"prefill": prefill, "decode": workers - prefill},
                            "conditional": {"prefill": prefill, "decode": decode,
                                            "regular": workers - prefill - decode}}[placement]
    if min(plan.values()) < 1:
        raise ValueError(f"{placement} with {workers} workers: {plan} leaves a pool empty")
    pools: dict[str, list[ReferenceWorker]] = {}
    try:
        for role, n in plan.items():
            mode = "null" if role == "regular" else role
            pools[role] = [_worker(mode, model, chunk, log_dir, f"{placement}-{role}{i}") for i in range(n)]
            for w in pools[role]:
                w.start(timeout=120)
        args = [*COMMON]
        if placement == "colocated":
            args += ["--worker-urls", *[w.url for w in pools["regular"]]]
        else:
            args += ["--pd-disaggregation", "--decode-policy", "most_free_kv", "--pd-placement", placement]
            for w in pools["prefill"]:
                args += ["--prefill", w.url, str(w.bootstrap_port)]
            for w in pools["decode"]:
                args += ["--decode", w.url]
            if "regular" in pools:
                args += ["--worker-urls", *[w.url for w in pools["regular"]]]
        proc, url, output = _launch([*args, *gateway_args])
        fleet = Fleet(placement, url, pools, proc, output)
    except BaseException:
        for pool in pools.values():
            for w in pool:
                w.stop()
        raise
    try:
        _wait_ready(url)
    except BaseException:
        fleet.stop()
        raise
    return fleet
