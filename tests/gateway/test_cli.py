"""The `pdgate` command: dispatch, and `pdgate quickstart` end to end with reference workers."""

from __future__ import annotations

import os
import pathlib
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from tests.conftest import Processes

PDGATE = [sys.executable, "-m", "pdgate.cli"]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*PDGATE, *args], capture_output=True, text=True, timeout=60, env=env)


def test_top_level_usage_and_unknown_command() -> None:
    out = run("--help")
    assert out.returncode == 0
    for command in ("launch", "quickstart", "engine"):
        assert command in out.stdout
    bad = run("lunch")
    assert bad.returncode == 2 and "unknown command" in bad.stderr


def test_launch_rejects_contradicting_options() -> None:
    out = run("launch", "--worker-urls", "http://127.0.0.1:9", "--prefill", "http://127.0.0.1:8")
    assert out.returncode != 0 and "pd-disaggregation" in (out.stderr + out.stdout)


def test_launch_version_names_pdgate_launch() -> None:
    pytest.importorskip("pdgate._core", reason="needs the compiled gateway (pip install .)")
    out = run("launch", "--version")
    assert out.returncode == 0 and out.stdout.startswith("pdgate launch "), out.stdout + out.stderr


def test_launch_with_discovery_but_no_kubernetes_refuses_to_start(tmp_path: pathlib.Path) -> None:
    """Fail fast: a gateway that cannot reach Kubernetes must not serve an empty pool forever."""
    pytest.importorskip("pdgate._core", reason="needs the compiled gateway (pip install .)")
    missing = str(tmp_path / "no-such-kubeconfig")
    out = run("launch", "--service-discovery", "--selector", "app=llm", "--port", "0", "--kubeconfig", missing)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "service discovery" in out.stderr and missing in out.stderr
    assert "listening" not in out.stdout
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    out = run("launch", "--service-discovery", "--selector", "app=llm", "--port", "0", env=env)
    assert out.returncode == 1 and "in-cluster" in out.stderr, out.stdout + out.stderr


def test_engine_help_comes_from_the_engine() -> None:
    pytest.importorskip("pdgate.engine.cli")
    out = run("engine", "--help")
    assert out.returncode == 0 and "usage: pdgate engine" in out.stdout


def start_quickstart(processes: Processes, *args: str) -> tuple[subprocess.Popen, str, list[str]]:
    """Runs `pdgate quickstart --port 0 ARGS` until it says the gateway is ready."""
    pytest.importorskip("pdgate.workers")
    proc = processes.popen([*PDGATE, "quickstart", "--port", "0", "--log-level", "warn", *args],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: "queue.Queue[str]" = queue.Queue()
    output: list[str] = []

    def pump() -> None:
        for line in iter(proc.stdout.readline, ""):
            output.append(line)
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    url = None
    deadline = time.monotonic() + 180
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if "gateway ready at " in line:
            url = line.rsplit("gateway ready at ", 1)[1].strip()
    assert url, "quickstart did not come up:\n" + "".join(output)
    return proc, url, output


def worker_pids(output: list[str]) -> list[int]:
    """The pids quickstart printed for its workers ('... worker at URL (pid N, log PATH)')."""
    return [int(m.group(1)) for line in output if (m := re.search(r"worker at \S+ \(pid (\d+), log (\S+)\)", line))]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead but not yet reaped by its (new) parent.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


@pytest.mark.timeout(300)
@pytest.mark.parametrize("connector,workers", [("bootstrap", 1), ("nixl", 1), ("mooncake", 1), ("bootstrap", 2)])
def test_quickstart_serves_through_reference_workers(connector: str, workers: int, processes: Processes) -> None:
    counts = ["--prefill-workers", str(workers), "--decode-workers", str(workers)]
    proc, url, output = start_quickstart(processes, "--kv-connector", connector, *counts)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    assert "".join(output).count("worker at http") == 2 * workers
    pids = worker_pids(output)
    assert len(pids) == 2 * workers, "quickstart must print each worker's pid and log path:\n" + "".join(output)
    for _ in range(2 * workers):  # round robin visits every worker
        out = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=4, temperature=0)
        # The tiny random-weight model may sample its end-of-sequence token early.
        assert 1 <= out.usage.completion_tokens <= 4 and out.choices[0].finish_reason in ("length", "stop")
        # The KV really moved: the decode reports the prompt as cached.
        assert out.usage.prompt_tokens_details.cached_tokens >= out.usage.prompt_tokens - 1
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0
    assert "stopping" in "".join(output)
    assert not [p for p in pids if alive(p)], "Ctrl-C left workers behind"


@pytest.mark.timeout(300)
def test_quickstart_workers_die_when_quickstart_is_killed(processes: Processes) -> None:
    """SIGKILL runs no cleanup in quickstart: the workers must notice on their own and exit."""
    proc, url, output = start_quickstart(processes)
    pids = worker_pids(output)
    assert len(pids) == 2, "".join(output)
    assert all(alive(p) for p in pids)
    # On loopback, quickstart opens the worker API and says so.
    assert "/workers) is OPEN without a key" in "".join(output), "".join(output)
    assert httpx.get(url + "/workers", timeout=10).status_code == 200
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 15
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    assert not left, f"workers {left} outlived their killed quickstart"
