"""Start `pdgate launch` as a subprocess and talk to it, every wait bounded by a deadline."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

START_TIMEOUT_S = 30.0


@dataclass
class GatewayProcess:
    proc: subprocess.Popen
    url: str
    output: list[str] = field(default_factory=list)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then wait; returns the exit code (kills it if the deadline passes)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise

    def wait_ready(self, timeout: float = 20.0) -> None:
        """Wait until /readiness answers 200 (workers found healthy)."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = httpx.get(self.url + "/readiness", timeout=2).status_code
                if last == 200:
                    return
            except httpx.HTTPError as exc:
                last = exc
            time.sleep(0.05)
        raise AssertionError(f"gateway not ready after {timeout}s (last: {last}); output:\n" + "".join(self.output))


def _pump(stream: Any, lines: "queue.Queue[str]", sink: list[str]) -> None:
    for line in iter(stream.readline, ""):
        sink.append(line)
        lines.put(line)


def launch(processes: Any, args: list[str], env: dict[str, str] | None = None) -> GatewayProcess:
    """`pdgate launch --host 127.0.0.1 --port 0 ARGS`; returns once it printed its URL."""
    cmd = [sys.executable, "-m", "pdgate.cli", "launch", "--host", "127.0.0.1", "--port", "0", *args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = processes.popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env)
    lines: "queue.Queue[str]" = queue.Queue()
    output: list[str] = []
    threading.Thread(target=_pump, args=(proc.stdout, lines, output), daemon=True).start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.1)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if "listening on " in line:
            return GatewayProcess(proc, line.rsplit("listening on ", 1)[1].strip(), output)
    proc.kill()
    raise AssertionError("pdgate launch did not start; output:\n" + "".join(output))


def wait_status(url: str, status: int, timeout: float = 15.0) -> int:
    """Polls `url` until it answers `status` (or `timeout` passes); returns the last status seen."""
    deadline = time.monotonic() + timeout
    last = -1
    while time.monotonic() < deadline:
        try:
            last = httpx.get(url, timeout=2).status_code
        except httpx.HTTPError:
            last = -1
        if last == status:
            break
        time.sleep(0.05)
    return last


def scrape(url: str, sample: str) -> float:
    """One sample's value from a /metrics page (`name` or `name{labels}`); 0 when absent."""
    for row in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if row.startswith(sample + " "):
            return float(row.split()[-1])
    return 0.0
