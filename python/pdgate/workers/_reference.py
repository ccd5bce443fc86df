"""`ReferenceWorker`: one `python -m pdgate.engine` subprocess on loopback."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence

from pdgate.errors import WorkerStartError

_CONNECTORS = ("NixlConnector", "MooncakeConnector")


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def _ephemeral_start() -> int:
    """The lowest port the OS hands out on its own (to bind(0) and to outgoing connections)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", span: int = 1) -> int:
    """A port that was free a moment ago, never one this process handed out before: the OS may
    offer a just-released port again, and two workers started together would then both be told
    to bind it. With span > 1, ports port..port+span-1 are all free (a gRPC worker's HTTP
    sidecar is port + 1): those come from below the OS's ephemeral range, since a port next to
    one the OS picked is likely an outgoing connection's (Linux gives connect() the neighbours
    of the ports it gives bind(0))."""
    with _handed_out_lock:
        if span == 1:
            for _ in range(64):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((host, 0))
                    port = s.getsockname()[1]
                if port not in _handed_out:
                    _handed_out.add(port)
                    return port
        else:
            top = _ephemeral_start() - span
            rng = random.Random()
            for _ in range(256):
                port = rng.randrange(max(1024, top - 12000), top)
                ports = range(port, port + span)
                if not _handed_out.intersection(ports) and all(_bindable(host, p) for p in ports):
                    _handed_out.update(ports)
                    return port
    raise OSError(f"no fresh free port span of {span} found")


class ReferenceWorker:
    """A reference engine worker process.

    mode: "prefill" | "decode" | "null" | "encode" (an EPD encode worker: `--encoder-only`, needs
    a multimodal model such as `tiny-mm`; like a prefill it runs a bootstrap server). kv_connector: None for SGLang bootstrap style, or
    "NixlConnector" / "MooncakeConnector" for vLLM style (`--kv-transfer-config`).
    port / bootstrap_port: None picks free ports (bootstrap only for prefill workers).
    grpc_service: "sglang" / "vllm" serves that gRPC service on `port` (`grpc_url`) and the HTTP
    surface on `port + 1` (`url`), SGLang's sidecar convention.
    ec_transfer_config: vLLM's `--ec-transfer-config` as a mapping, e.g. `{"ec_connector":
    "ECExampleConnector", "ec_role": "ec_producer", "ec_connector_extra_config":
    {"shared_storage_path": "/dir"}}` (vLLM's disaggregated encoder; a multimodal model). An
    `ec_producer` is mode "null": it answers chat requests without generating.
    """

    def __init__(self, mode: str = "null", model: str = "tiny", port: int | None = None,
                 bootstrap_port: int | None = None, transfer_backend: str = "tcp",
                 kv_connector: str | None = None, extra_args: Sequence[str] = (),
                 env: Mapping[str, str] | None = None, log_path: str | None = None,
                 host: str = "127.0.0.1", grpc_service: str | None = None,
                 ec_transfer_config: Mapping | None = None):
        if mode not in ("prefill", "decode", "null", "encode"):
            raise ValueError(f"mode must be prefill, decode, null or encode, not {mode!r}")
        if kv_connector is not None and kv_connector not in _CONNECTORS:
            raise ValueError(f"kv_connector must be None or one of {_CONNECTORS}")
        if grpc_service not in (None, "sglang", "vllm"):
            raise ValueError(f"grpc_service must be None, sglang or vllm, not {grpc_service!r}")
        self.mode, self.model, self.host, self.grpc_service = mode, model, host, grpc_service
        self._auto_port, self._auto_bootstrap = port is None, bootstrap_port is None
        self.port = port or free_port(host, span=2 if grpc_service else 1)
        self.bootstrap_port = (bootstrap_port or free_port(host)) if mode in ("prefill", "encode") else bootstrap_port
        self.transfer_backend = transfer_backend
        self.kv_connector = kv_connector
        self.ec_transfer_config = dict(ec_transfer_config) if ec_transfer_config is not None else None
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    @property
    def url(self) -> str:
        """The HTTP surface (`port + 1` beside a gRPC service)."""
        return f"http://{self.host}:{self.port + (1 if self.grpc_service else 0)}"

    @property
    def grpc_url(self) -> str:
        """`grpc://host:port` of the gRPC service (only with grpc_service)."""
        if not self.grpc_service:
            raise RuntimeError("this worker serves HTTP only")
        return f"grpc://{self.host}:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "pdgate.engine", "--model", self.model, "--host", self.host,
               "--port", str(self.port),
               "--disaggregation-mode", "null" if self.mode == "encode" else self.mode,
               "--disaggregation-transfer-backend", self.transfer_backend]
        if self.bootstrap_port is not None:
            cmd += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        if self.mode == "encode":
            cmd += ["--encoder-only"]
        if self.kv_connector is not None:
            role = {"prefill": "kv_producer", "decode": "kv_consumer"}.get(self.mode, "kv_both")
            cmd += ["--kv-transfer-config",
                    json.dumps({"kv_connector": self.kv_connector, "kv_role": role})]
        if self.ec_transfer_config is not None:
            cmd += ["--ec-transfer-config", json.dumps(self.ec_transfer_config, separators=(",", ":"))]
        if self.grpc_service:
            cmd += ["--grpc-service", self.grpc_service]
        return cmd + self.extra_args

    def start(self, timeout: float = 60) -> "ReferenceWorker":
        """Spawn and wait until GET /health is 200; raise WorkerStartError with the log tail.

        Ports picked here can be taken by another process before the worker binds them; then
        the worker is restarted on fresh ports (up to 3 tries)."""
        if self.proc is not None:
            raise RuntimeError("worker already started")
        deadline = time.monotonic() + timeout
        for attempt in range(3):
            self._spawn()
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if self._healthy():
                    return self
                time.sleep(0.1)
            else:
                self._fail(f"worker not healthy within {timeout:g}s")
            if attempt < 2 and "address already in use" in self.log_tail().lower() and (
                    self._auto_port or (self.mode in ("prefill", "encode") and self._auto_bootstrap)):
                self.proc = None
                self.port = free_port(self.host, span=2 if self.grpc_service else 1) if self._auto_port else self.port
                if self.mode in ("prefill", "encode") and self._auto_bootstrap:
                    self.bootstrap_port = free_port(self.host)
                continue
            self._fail(f"worker exited with code {self.proc.returncode}")
        return self

    def _spawn(self) -> None:
        env = dict(os.environ)
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
        env.setdefault("OMP_NUM_THREADS", "1")
        env.update(self.env)
        # The worker dies with this process, even when it is killed (engine/parent_watch.py).
        env["PDGATE_PARENT_PID"] = str(os.getpid())
        env["PDGATE_PARENT_MAIN_THREAD"] = "1" if threading.current_thread() is threading.main_thread() else "0"
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if self.log_path is None:
            fd, self.log_path = tempfile.mkstemp(prefix=f"pdgate-engine-{self.mode}-", suffix=".log")
            os.close(fd)
        if self._log_file is None:
            self._log_file = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=self._log_file, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)

    def _healthy(self) -> bool:
        """/health is 200 and the port is really this engine's: another server that took the
        port (e.g. a prefill's bootstrap server, which also answers /health) has no /v1/models,
        and a worker that lost the port is told apart by its exit instead of passing for ready."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                if r.status != 200:
                    return False
            with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                return r.status == 200 and "data" in json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _fail(self, why: str) -> None:
        tail = self.log_tail()
        self.stop()
        raise WorkerStartError(f"{why}: {' '.join(self.command())}\n--- log tail ---\n{tail}")

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            return b"\n".join(f.read().splitlines()[-lines:]).decode("utf-8", "replace")

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM, then SIGKILL after `timeout`. Safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def kill(self) -> None:
        """SIGKILL at once (fault tests: a worker that dies mid-transfer)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def __enter__(self) -> "ReferenceWorker":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"ReferenceWorker(mode={self.mode!r}, url={self.url!r}, bootstrap_port={self.bootstrap_port})"
