"""``pdgate.Gateway``: run the Rust gateway inside a Python process.

The keyword options are exactly the names of the gateway's config schema (the same options as
``pdgate launch --help``, with ``-`` written as ``_``); the schema is declared once, in Rust, and
typed for Python by ``pdgate._options.GatewayOptions`` (generated from it).
"""

from __future__ import annotations

import json
import secrets
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

from pdgate._config import config_schema, normalize_options
from pdgate._native import core
from pdgate.errors import GatewayStateError

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from pdgate._options import GatewayOptions
    from pdgate._workers_api import WorkersApi

__all__ = ["Gateway", "config_schema"]


def private_admin_key(config: Mapping[str, Any]) -> str | None:
    """The admin key an embedding process uses for its own fleet calls.

    The worker API is closed over HTTP without an admin key. A process that owns the gateway gets
    a key of its own that nobody else knows: add_worker() and the rest keep working while
    /workers stays closed to every other client.
    """
    key = config.get("admin_api_key") or None
    if key is None and not config.get("admin_api_open"):
        key = secrets.token_urlsafe(32)
    return key


def drain_wait_limit(config: Mapping[str, Any], timeout: float | None) -> float:
    """How long ``remove_worker(wait=True)`` waits by default: the request timeout plus 10 s."""
    return timeout if timeout is not None else float(config.get("request_timeout_secs") or 0) + 10


class Gateway:
    """A pdgate gateway in this process, serving on its own Rust threads.

    ``start()`` returns once the gateway accepts connections and does not block afterwards; the
    GIL is released while the gateway works. Use it as a context manager to stop it reliably::

        with Gateway(pd_disaggregation=True,
                     prefill=[["http://127.0.0.1:30001", 8998]],
                     decode=["http://127.0.0.1:30002"],
                     port=0) as gw:
            httpx.post(gw.url + "/v1/completions", json={...})

    Raises :class:`pdgate.UnknownOptionError` for an unknown option (with "did you mean"),
    :class:`pdgate.OptionError` for an invalid value (naming the option and the value) and
    :class:`pdgate.ConfigError` for options that contradict each other. The options are typed
    (:class:`pdgate.GatewayOptions`), so a type checker finds the same mistakes before running.
    For an asyncio program, :class:`pdgate.AsyncGateway` is the same gateway with awaitable calls.
    """

    def __init__(self, **options: Unpack[GatewayOptions]) -> None:
        self._config: dict[str, Any] = normalize_options(options)
        self._handle: Any = None
        self._admin_key = private_admin_key(self._config)

    @classmethod
    def from_cli_args(cls, argv: Sequence[str]) -> Gateway:
        """Build from ``pdgate launch`` arguments, e.g. ``["--worker-urls", "http://h:8000"]``.

        Raises :class:`pdgate.CommandLineError` (``exit_code`` 0 for ``--help``/``--version``).
        """
        config = json.loads(core().parse_cli(list(argv)))
        gateway = cls(**config)  # the full config: every key is an option
        # `pdgate launch`: nobody in this process manages the fleet, so no private key either;
        # the worker API is exactly as the flags say (closed without --admin-api-key).
        gateway._admin_key = gateway._config.get("admin_api_key") or None
        return gateway

    @property
    def config(self) -> dict[str, Any]:
        """The complete configuration, defaults included (a copy)."""
        copy: dict[str, Any] = json.loads(json.dumps(self._config))
        return copy

    def start(self) -> Gateway:
        """Bind and serve; returns once accepting. Raises :class:`pdgate.GatewayStartError`."""
        if self._handle is None:
            launched = dict(self._config, admin_api_key=self._admin_key)
            self._handle = core().GatewayHandle(json.dumps(launched))
        self._handle.start()
        return self

    def stop(self) -> None:
        """Graceful stop: readiness turns 503 and new requests get 503 at once; requests in
        flight (streams included) get ``shutdown_grace_period_secs`` to finish; then the port is
        released. Idempotent."""
        if self._handle is not None:
            self._handle.stop()

    @property
    def running(self) -> bool:
        return self._handle is not None and bool(self._handle.running)

    @property
    def url(self) -> str | None:
        """``http://host:port`` for clients on this machine, or ``None`` when not running."""
        return self._handle.url if self._handle is not None else None

    @property
    def port(self) -> int | None:
        """The bound port (the real one when configured with ``port=0``), or ``None``."""
        return self._handle.port if self._handle is not None else None

    @property
    def metrics_url(self) -> str | None:
        """``http://host:port/metrics`` of the ``prometheus_port`` listener, or ``None``
        (without that option, or when not running; ``url + "/metrics"`` always works)."""
        return self._handle.metrics_url if self._handle is not None else None

    # ---- the fleet: thin wrappers over this gateway's own /workers API (docs/fleet.md) ----------

    def _workers(self) -> WorkersApi:
        from pdgate._workers_api import WorkersApi  # httpx only when the fleet is managed

        url = self.url
        if not self.running or url is None:
            raise GatewayStateError("the gateway is not running: start() it before managing workers")
        return WorkersApi(url, self._admin_key)

    def add_worker(
        self,
        url: str,
        worker_type: Literal["regular", "prefill", "decode"] | None = None,
        *,
        bootstrap_port: int | None = None,
        kv_connector: Literal["bootstrap", "nixl", "mooncake"] | None = None,
        kv_engine_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        kv_events: str | None = None,
        kv_events_replay: str | None = None,
    ) -> dict[str, Any]:
        """Register a worker (``POST /workers``) and return it as ``list_workers()`` shows it.

        ``worker_type`` is required in PD mode and defaults to ``"regular"`` otherwise. The
        gateway reads the engine's ``/server_info`` and health-checks it before answering.
        Raises :class:`pdgate.WorkerError`: ``.status`` 409 if the URL is registered, 400 if
        invalid (e.g. the engine reports another ``disaggregation_mode``), 401/403 for the key.
        ``kv_events`` / ``kv_events_replay``: the engine's KV event publisher and replay socket
        (``tcp://host:port``), for ``cache_aware`` routing on the engines' KV events.
        """
        from pdgate._workers_api import worker_spec

        workers = self._workers()
        return workers.add(worker_spec(url, worker_type, bootstrap_port, kv_connector, kv_engine_id, labels,
                                       kv_events, kv_events_replay))

    def remove_worker(self, worker_id_or_url: str, *, wait: bool = False,
                      timeout: float | None = None) -> dict[str, Any]:
        """Drain, then remove a worker (``DELETE /workers/{id}``): it takes no new requests at
        once; its in-flight requests finish (bounded by ``request_timeout_secs``), then it is gone.

        Returns ``{"id", "url", "status": "draining"}``. With ``wait=True``, blocks until the
        worker is gone, at most ``timeout`` seconds (default: the request timeout plus 10 s),
        else raises :class:`pdgate.WorkerError` with ``code == "drain_timeout"``. Raises
        ``WorkerError`` with ``.status`` 404 for an unknown worker.
        """
        api = self._workers()
        answer = api.remove(worker_id_or_url)
        if wait:
            api.wait_gone(answer["id"], drain_wait_limit(self._config, timeout))
        return answer

    def list_workers(self) -> list[dict[str, Any]]:
        """Every registered worker (``GET /workers``): ``id``, ``url``, ``worker_type``,
        ``source``, ``healthy``, ``enabled``, ``draining``, ``breaker``, ``inflight``, ``load``..."""
        return self._workers().list_workers()

    def get_worker(self, worker_id_or_url: str) -> dict[str, Any]:
        """One worker (``GET /workers/{id}``); ``WorkerError`` with ``.status`` 404 if unknown."""
        return self._workers().get(worker_id_or_url)

    def set_worker_enabled(self, worker_id_or_url: str, enabled: bool) -> dict[str, Any]:
        """Enable or disable a worker (``PUT /workers/{id}``); a disabled worker takes no new
        requests but is not counted as failed. Returns the worker."""
        return self._workers().set_enabled(worker_id_or_url, enabled)

    def __enter__(self) -> Gateway:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"running at {self.url}" if self.running else "stopped"
        mode = "pd" if self._config.get("pd_disaggregation") else "regular"
        return f"<pdgate.Gateway {mode} {state}>"
