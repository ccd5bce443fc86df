"""A client of a running gateway's own worker API (``/workers``, docs/fleet.md), blocking and async.

``Gateway.add_worker`` and friends go through HTTP rather than a direct call into Rust, so the
Python API and ``curl`` change the registry the same way: the same validation (the engine's
``/server_info`` is read, a first health check is done), the same admin key, the same errors.
Each call is described once (:class:`Call`) and its answer read once (:func:`answer`); the two
clients only differ in how they send it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Mapping, NamedTuple
from urllib.parse import quote

import httpx

from pdgate.errors import GatewayError, WorkerError

__all__ = ["AsyncWorkersApi", "Call", "WorkersApi", "worker_spec"]

# Adding a worker reads the engine's /server_info and /v1/models and health-checks it before
# answering; each of those is bounded by the gateway's own timeouts, so 30 s is generous.
TIMEOUT = httpx.Timeout(30.0, connect=5.0)
DRAIN_POLL_S = 0.05


class Call(NamedTuple):
    """One worker API request: what to send and which statuses mean success."""

    method: str
    path: str
    what: str  # for error messages: "adding worker 'http://...'"
    body: Any = None
    ok: tuple[int, ...] = (200,)


def worker_path(worker_id_or_url: str) -> str:
    """``/workers/{id}``; a URL is percent-encoded whole (``/`` and ``:`` included)."""
    if not worker_id_or_url:
        raise WorkerError("a worker id or URL is required", code="invalid_request")
    return "/workers/" + quote(worker_id_or_url, safe="")


def worker_spec(url: str, worker_type: str | None, bootstrap_port: int | None, kv_connector: str | None,
                kv_engine_id: str | None, labels: Mapping[str, str] | None,
                kv_events: str | None = None, kv_events_replay: str | None = None) -> dict[str, Any]:
    """The ``POST /workers`` body: only what was given, so the gateway's defaults apply."""
    spec: dict[str, Any] = {"url": url}
    optional = {"worker_type": worker_type, "bootstrap_port": bootstrap_port,
                "kv_connector": kv_connector, "kv_engine_id": kv_engine_id,
                "kv_events": kv_events, "kv_events_replay": kv_events_replay}
    spec.update({k: v for k, v in optional.items() if v is not None})
    if labels:
        spec["labels"] = dict(labels)
    return spec


def add_call(spec: dict[str, Any]) -> Call:
    return Call("POST", "/workers", f"adding worker {spec.get('url')!r}", spec, ok=(201,))


def list_call() -> Call:
    return Call("GET", "/workers", "listing workers")


def get_call(worker_id_or_url: str) -> Call:
    return Call("GET", worker_path(worker_id_or_url), f"reading worker {worker_id_or_url!r}")


def set_enabled_call(worker_id_or_url: str, enabled: bool) -> Call:
    what = f"{'enabling' if enabled else 'disabling'} worker {worker_id_or_url!r}"
    return Call("PUT", worker_path(worker_id_or_url), what, {"enabled": bool(enabled)})


def remove_call(worker_id_or_url: str) -> Call:
    return Call("DELETE", worker_path(worker_id_or_url), f"removing worker {worker_id_or_url!r}", ok=(202,))


def _error(resp: httpx.Response, what: str) -> WorkerError:
    code: str | None = None
    message = resp.text.strip()
    try:
        error = resp.json().get("error")
    except ValueError:
        error = None
    if isinstance(error, Mapping):
        code = error.get("code") if isinstance(error.get("code"), str) else None
        message = str(error.get("message") or message)
    return WorkerError(f"{what}: HTTP {resp.status_code}: {message}", status=resp.status_code, code=code)


def answer(call: Call, resp: httpx.Response) -> Any:
    """The JSON of a successful answer; a refusal as :class:`WorkerError`."""
    if resp.status_code not in call.ok:
        raise _error(resp, call.what)
    try:
        return resp.json()
    except ValueError as exc:
        raise GatewayError(f"{call.what}: the gateway answered HTTP {resp.status_code} without JSON") from exc


def unreachable(call: Call, base_url: str, exc: Exception) -> GatewayError:
    return GatewayError(f"{call.what}: the gateway at {base_url} did not answer: {exc!r}")


def drain_timeout(worker_id: str, timeout: float) -> WorkerError:
    return WorkerError(f"worker {worker_id!r} still draining after {timeout:g}s", status=None, code="drain_timeout")


def _headers(admin_api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}


class WorkersApi:
    """Calls ``/workers`` on ``base_url`` with the admin key (when one is configured); blocking."""

    def __init__(self, base_url: str, admin_api_key: str | None = None,
                 timeout: httpx.Timeout = TIMEOUT) -> None:
        self._base_url = base_url.rstrip("/")
        self._headers = _headers(admin_api_key)
        self._timeout = timeout

    def call(self, call: Call) -> Any:
        try:
            resp = httpx.request(call.method, self._base_url + call.path, json=call.body,
                                 headers=self._headers, timeout=self._timeout)
        except httpx.HTTPError as exc:
            raise unreachable(call, self._base_url, exc) from exc
        return answer(call, resp)

    def add(self, spec: dict[str, Any]) -> dict[str, Any]:
        return dict(self.call(add_call(spec)))

    def list_workers(self) -> list[dict[str, Any]]:
        return list(self.call(list_call())["workers"])

    def get(self, worker_id_or_url: str) -> dict[str, Any]:
        return dict(self.call(get_call(worker_id_or_url)))

    def set_enabled(self, worker_id_or_url: str, enabled: bool) -> dict[str, Any]:
        return dict(self.call(set_enabled_call(worker_id_or_url, enabled)))

    def remove(self, worker_id_or_url: str) -> dict[str, Any]:
        return dict(self.call(remove_call(worker_id_or_url)))

    def wait_gone(self, worker_id: str, timeout: float) -> None:
        """Poll until ``GET /workers/{id}`` is 404 (the drain ended and the worker is removed)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.get(worker_id)
            except WorkerError as exc:
                if exc.status == 404:
                    return
                raise
            if time.monotonic() >= deadline:
                raise drain_timeout(worker_id, timeout)
            time.sleep(DRAIN_POLL_S)


class AsyncWorkersApi:
    """The same calls on one ``httpx.AsyncClient`` (connections reused); ``aclose()`` it."""

    def __init__(self, base_url: str, admin_api_key: str | None = None,
                 timeout: httpx.Timeout = TIMEOUT) -> None:
        self._base_url = base_url.rstrip("/")
        self._client = httpx.AsyncClient(base_url=self._base_url, headers=_headers(admin_api_key),
                                         timeout=timeout)

    async def call(self, call: Call) -> Any:
        try:
            resp = await self._client.request(call.method, call.path, json=call.body)
        except httpx.HTTPError as exc:
            raise unreachable(call, self._base_url, exc) from exc
        return answer(call, resp)

    async def add(self, spec: dict[str, Any]) -> dict[str, Any]:
        return dict(await self.call(add_call(spec)))

    async def list_workers(self) -> list[dict[str, Any]]:
        return list((await self.call(list_call()))["workers"])

    async def get(self, worker_id_or_url: str) -> dict[str, Any]:
        return dict(await self.call(get_call(worker_id_or_url)))

    async def set_enabled(self, worker_id_or_url: str, enabled: bool) -> dict[str, Any]:
        return dict(await self.call(set_enabled_call(worker_id_or_url, enabled)))

    async def remove(self, worker_id_or_url: str) -> dict[str, Any]:
        return dict(await self.call(remove_call(worker_id_or_url)))

    async def wait_gone(self, worker_id: str, timeout: float) -> None:
        """Poll until ``GET /workers/{id}`` is 404, sleeping between polls without blocking."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                await self.get(worker_id)
            except WorkerError as exc:
                if exc.status == 404:
                    return
                raise
            if loop.time() >= deadline:
                raise drain_timeout(worker_id, timeout)
            await asyncio.sleep(DRAIN_POLL_S)

    async def aclose(self) -> None:
        await self._client.aclose()
