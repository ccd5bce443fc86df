"""``pdgate.AsyncGateway``: the embedded gateway for asyncio programs.

The same gateway and options as :class:`pdgate.Gateway`; every call that waits is awaitable and
none blocks the event loop. Starting and stopping the native gateway (binding, then draining
in-flight requests for up to 10 s) run in a worker thread (the Rust side releases the GIL while
it waits); fleet calls go through one ``httpx.AsyncClient``, made in that thread too. Properties never touch the native
handle: they read what ``start()`` recorded, so they cannot wait on a start or stop in progress.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, TypeVar

from pdgate._native import core
from pdgate._config import normalize_options
from pdgate.errors import GatewayStateError
from pdgate.gateway import drain_wait_limit, private_admin_key

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from pdgate._options import GatewayOptions
    from pdgate._workers_api import AsyncWorkersApi

__all__ = ["AsyncGateway"]

T = TypeVar("T")


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking call in the loop's default executor, so the loop keeps running."""
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))


def _open_workers_api(url: str, admin_key: str | None) -> AsyncWorkersApi:
    """The fleet client, made off the event loop: importing httpx, building its TLS context (it
    reads the CA bundle) and importing the async network backend its first request would import
    take from tens of ms to over a second on a busy machine, all of it blocking."""
    from pdgate._workers_api import AsyncWorkersApi

    for backend in ("anyio", "anyio._backends._asyncio"):  # what httpcore loads on first use
        try:
            importlib.import_module(backend)
        except ImportError:  # another httpcore backend: it is then imported on first use
            pass
    return AsyncWorkersApi(url, admin_key)


def _start_blocking(handle: Any, admin_key: str | None) -> tuple[str, int, AsyncWorkersApi]:
    """Start the native gateway; its URL, port and fleet client. Blocking: run in a thread."""
    handle.start()
    try:
        url, port = str(handle.url), int(handle.port)
        return url, port, _open_workers_api(url, admin_key)
    except BaseException:
        handle.stop()  # a gateway nobody can manage is not left serving
        raise


class AsyncGateway:
    """A pdgate gateway in this process, driven from asyncio::

        async with pdgate.AsyncGateway(pd_disaggregation=True, port=0) as gw:
            await gw.add_worker("http://127.0.0.1:30001", "prefill", bootstrap_port=8998)
            await gw.add_worker("http://127.0.0.1:30002", "decode")
            async with httpx.AsyncClient(base_url=gw.url) as client:
                await client.post("/v1/completions", json={...})

    Options and errors are those of :class:`pdgate.Gateway` (validated here, at construction,
    which does no IO). One ``AsyncGateway`` belongs to one event loop. Stop it with ``async with``
    or ``await stop()``: one garbage-collected while running is stopped by the native handle's
    destructor, which blocks whichever thread collects it.
    """

    def __init__(self, **options: Unpack[GatewayOptions]) -> None:
        self._config: dict[str, Any] = normalize_options(options)
        self._admin_key = private_admin_key(self._config)
        self._handle: Any = None
        self._url: str | None = None
        self._port: int | None = None
        self._workers_api: AsyncWorkersApi | None = None
        self._native_start: asyncio.Future[tuple[str, int, AsyncWorkersApi]] | None = None
        # start() and stop() take turns: a stop during a start waits for it, then stops. Made
        # on first use, inside the loop that uses it (Python 3.9 binds a lock to a loop).
        self._lifecycle_lock: asyncio.Lock | None = None

    @property
    def _lifecycle(self) -> asyncio.Lock:
        if self._lifecycle_lock is None:
            self._lifecycle_lock = asyncio.Lock()
        return self._lifecycle_lock

    @property
    def config(self) -> dict[str, Any]:
        """The complete configuration, defaults included (a copy)."""
        copy: dict[str, Any] = json.loads(json.dumps(self._config))
        return copy

    @property
    def running(self) -> bool:
        return self._url is not None

    @property
    def url(self) -> str | None:
        """``http://host:port`` for clients on this machine, or ``None`` when not running."""
        return self._url

    @property
    def port(self) -> int | None:
        """The bound port (the real one when configured with ``port=0``), or ``None``."""
        return self._port

    async def start(self) -> AsyncGateway:
        """Bind and serve; returns once accepting. Raises :class:`pdgate.GatewayStartError`,
        or :class:`pdgate.GatewayStateError` when already running."""
        async with self._lifecycle:
            if self._handle is None:
                launched = dict(self._config, admin_api_key=self._admin_key)
                self._handle = core().GatewayHandle(json.dumps(launched))
            url, self._port, self._workers_api = await self._start_native(self._handle)
            self._url = url
        return self

    async def _start_native(self, handle: Any) -> tuple[str, int, AsyncWorkersApi]:
        """:func:`_start_blocking` in a thread. If the awaiting task is cancelled meanwhile, the
        start still finishes in its thread; the gateway is then stopped, not left serving unowned."""
        loop = asyncio.get_running_loop()
        # Kept so that a test can wait for a cancelled start's thread to finish.
        self._native_start = started = loop.run_in_executor(None, _start_blocking, handle, self._admin_key)
        try:
            return await asyncio.shield(started)
        except asyncio.CancelledError:
            def stop_if_started(done: asyncio.Future[tuple[str, int, AsyncWorkersApi]]) -> None:
                if not done.cancelled() and done.exception() is None:
                    loop.run_in_executor(None, handle.stop)

            started.add_done_callback(stop_if_started)
            raise

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (bounded), release the port. Idempotent."""
        async with self._lifecycle:
            workers, self._workers_api = self._workers_api, None
            self._url = self._port = None
            if workers is not None:
                await workers.aclose()
            if self._handle is not None:
                await _in_thread(self._handle.stop)

    def _workers(self) -> AsyncWorkersApi:
        if self._workers_api is None:
            raise GatewayStateError("the gateway is not running: start() it before managing workers")
        return self._workers_api

    # ---- the fleet: this gateway's own /workers API (docs/fleet.md), awaitable ----------------

    async def add_worker(
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
        """Register a worker (``POST /workers``); see :meth:`pdgate.Gateway.add_worker`."""
        from pdgate._workers_api import worker_spec

        workers = self._workers()
        return await workers.add(worker_spec(url, worker_type, bootstrap_port, kv_connector, kv_engine_id, labels,
                                       kv_events, kv_events_replay))

    async def remove_worker(self, worker_id_or_url: str, *, wait: bool = False,
                            timeout: float | None = None) -> dict[str, Any]:
        """Drain, then remove a worker (``DELETE /workers/{id}``); with ``wait=True`` returns
        once it is gone; see :meth:`pdgate.Gateway.remove_worker`."""
        workers = self._workers()
        answer = await workers.remove(worker_id_or_url)
        if wait:
            await workers.wait_gone(answer["id"], drain_wait_limit(self._config, timeout))
        return answer

    async def list_workers(self) -> list[dict[str, Any]]:
        """Every registered worker (``GET /workers``); see :meth:`pdgate.Gateway.list_workers`."""
        return await self._workers().list_workers()

    async def get_worker(self, worker_id_or_url: str) -> dict[str, Any]:
        """One worker (``GET /workers/{id}``); ``WorkerError`` with ``.status`` 404 if unknown."""
        return await self._workers().get(worker_id_or_url)

    async def set_worker_enabled(self, worker_id_or_url: str, enabled: bool) -> dict[str, Any]:
        """Enable or disable a worker (``PUT /workers/{id}``). Returns the worker."""
        return await self._workers().set_enabled(worker_id_or_url, enabled)

    async def __aenter__(self) -> AsyncGateway:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    def __repr__(self) -> str:
        state = f"running at {self._url}" if self.running else "stopped"
        mode = "pd" if self._config.get("pd_disaggregation") else "regular"
        return f"<pdgate.AsyncGateway {mode} {state}>"
