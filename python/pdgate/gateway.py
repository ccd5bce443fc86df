"""``pdgate.Gateway``: run the Rust gateway inside a Python process.

The keyword options are exactly the names of the gateway's config schema (the same options as
``pdgate launch --help``, with ``-`` written as ``_``); the schema is declared once, in Rust.
"""

from __future__ import annotations

import json
import secrets
from functools import lru_cache
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Mapping, Sequence

from pdgate._native import core
from pdgate.errors import ConfigError, GatewayStateError

if TYPE_CHECKING:
    from pdgate._workers_api import WorkersApi

__all__ = ["Gateway", "config_schema"]


@lru_cache(maxsize=1)
def _schema() -> tuple[dict[str, Any], ...]:
    return tuple(json.loads(core().config_schema())["options"])


def config_schema() -> list[dict[str, Any]]:
    """Every gateway option: ``name``, ``flag``, ``help``, ``default``, ``choices``, ..."""
    return [dict(option) for option in _schema()]


def _option_names() -> frozenset[str]:
    return frozenset(option["name"] for option in _schema())


class Gateway:
    """A pdgate gateway in this process, serving on its own Rust threads.

    ``start()`` returns once the gateway accepts connections and does not block afterwards; the
    GIL is released while the gateway works. Use it as a context manager to stop it reliably::

        with Gateway(pd_disaggregation=True,
                     prefill=[["http://127.0.0.1:30001", 8998]],
                     decode=["http://127.0.0.1:30002"],
                     port=0) as gw:
            httpx.post(gw.url + "/v1/completions", json={...})

    Raises :class:`pdgate.ConfigError` for an unknown option or an invalid value.
    """

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - _option_names())
        if unknown:
            known = ", ".join(sorted(_option_names()))
            raise ConfigError(f"unknown gateway option(s) {', '.join(unknown)}; known options: {known}")
        try:
            text = json.dumps(options)
        except TypeError as exc:
            raise ConfigError(f"gateway options must be JSON-like values: {exc}") from exc
        self._config: dict[str, Any] = json.loads(core().normalize_config(text))
        self._handle: Any = None
        # The worker API is closed over HTTP without an admin key. This process owns the
        # gateway, so it gets a key of its own that nobody else knows: add_worker() and the
        # rest keep working while /workers stays closed to every other client.
        self._admin_key: str | None = self._config.get("admin_api_key") or None
        if self._admin_key is None and not self._config.get("admin_api_open"):
            self._admin_key = secrets.token_urlsafe(32)

    @classmethod
    def from_cli_args(cls, argv: Sequence[str]) -> Gateway:
        """Build from ``pdgate launch`` arguments, e.g. ``["--worker-urls", "http://h:8000"]``.

        Raises :class:`pdgate.CommandLineError` (``exit_code`` 0 for ``--help``/``--version``).
        """
        config = json.loads(core().parse_cli(list(argv)))
        gateway = cls(**config)
        # `pdgate launch`: nobody in this process manages the fleet, so no private key either;
        # the worker API is exactly as the flags say (closed without --admin-api-key).
        gateway._admin_key = gateway._config.get("admin_api_key") or None
        return gateway

    @property
    def config(self) -> dict[str, Any]:
        """The complete configuration, defaults included (a copy)."""
        return json.loads(json.dumps(self._config))

    def start(self) -> Gateway:
        """Bind and serve; returns once accepting. Raises :class:`pdgate.GatewayStartError`."""
        if self._handle is None:
            launched = dict(self._config, admin_api_key=self._admin_key)
            self._handle = core().GatewayHandle(json.dumps(launched))
        self._handle.start()
        return self

    def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (bounded), release the port. Idempotent."""
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
    ) -> dict[str, Any]:
        """Register a worker (``POST /workers``) and return it as ``list_workers()`` shows it.

        ``worker_type`` is required in PD mode and defaults to ``"regular"`` otherwise. The
        gateway reads the engine's ``/server_info`` and health-checks it before answering.
        Raises :class:`pdgate.WorkerError`: ``.status`` 409 if the URL is registered, 400 if
        invalid (e.g. the engine reports another ``disaggregation_mode``), 401/403 for the key.
        """
        spec: dict[str, Any] = {"url": url}
        optional = {"worker_type": worker_type, "bootstrap_port": bootstrap_port,
                    "kv_connector": kv_connector, "kv_engine_id": kv_engine_id}
        spec.update({k: v for k, v in optional.items() if v is not None})
        if labels:
            spec["labels"] = dict(labels)
        return self._workers().add(spec)

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
            limit = timeout if timeout is not None else float(self._config.get("request_timeout_secs") or 0) + 10
            api.wait_gone(answer["id"], limit)
        return answer

    def list_workers(self) -> list[dict[str, Any]]:
        """Every registered worker (``GET /workers``): ``id``, ``url``, ``worker_type``,
        ``source``, ``healthy``, ``enabled``, ``draining``, ``breaker``, ``inflight``, ``load``..."""
        return self._workers().list_workers()

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
