"""A client of a running gateway's own worker API (``/workers``, docs/fleet.md).

``Gateway.add_worker`` and friends go through HTTP rather than a direct call into Rust, so the
Python API and ``curl`` change the registry the same way: the same validation (the engine's
``/server_info`` is read, a first health check is done), the same admin key, the same errors.
"""

from __future__ import annotations

import time
from typing import Any, Mapping
from urllib.parse import quote

import httpx

from pdgate.errors import GatewayError, WorkerError

__all__ = ["WorkersApi"]

# Adding a worker reads the engine's /server_info and /v1/models and health-checks it before
# answering; each of those is bounded by the gateway's own timeouts, so 30 s is generous.
TIMEOUT = httpx.Timeout(30.0, connect=5.0)
DRAIN_POLL_S = 0.05


def worker_path(worker_id_or_url: str) -> str:
    """``/workers/{id}``; a URL is percent-encoded whole (``/`` and ``:`` included)."""
    if not worker_id_or_url:
        raise WorkerError("a worker id or URL is required", code="invalid_request")
    return "/workers/" + quote(worker_id_or_url, safe="")


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


class WorkersApi:
    """Calls ``/workers`` on ``base_url`` with the admin key (when one is configured)."""

    def __init__(self, base_url: str, admin_api_key: str | None = None,
                 timeout: httpx.Timeout = TIMEOUT) -> None:
        headers = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}
        self._base_url = base_url.rstrip("/")
        self._headers = headers
        self._timeout = timeout

    def _call(self, method: str, path: str, what: str, body: Any = None, ok: tuple[int, ...] = (200,)) -> Any:
        try:
            resp = httpx.request(method, self._base_url + path, json=body, headers=self._headers,
                                 timeout=self._timeout)
        except httpx.HTTPError as exc:
            raise GatewayError(f"{what}: the gateway at {self._base_url} did not answer: {exc!r}") from exc
        if resp.status_code not in ok:
            raise _error(resp, what)
        try:
            return resp.json()
        except ValueError as exc:
            raise GatewayError(f"{what}: the gateway answered HTTP {resp.status_code} without JSON") from exc

    def add(self, spec: dict[str, Any]) -> dict[str, Any]:
        return self._call("POST", "/workers", f"adding worker {spec.get('url')!r}", spec, ok=(201,))

    def list_workers(self) -> list[dict[str, Any]]:
        return list(self._call("GET", "/workers", "listing workers")["workers"])

    def get(self, worker_id_or_url: str) -> dict[str, Any]:
        return self._call("GET", worker_path(worker_id_or_url), f"reading worker {worker_id_or_url!r}")

    def set_enabled(self, worker_id_or_url: str, enabled: bool) -> dict[str, Any]:
        what = f"{'enabling' if enabled else 'disabling'} worker {worker_id_or_url!r}"
        return self._call("PUT", worker_path(worker_id_or_url), what, {"enabled": bool(enabled)})

    def remove(self, worker_id_or_url: str) -> dict[str, Any]:
        return self._call("DELETE", worker_path(worker_id_or_url), f"removing worker {worker_id_or_url!r}",
                          ok=(202,))

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
                raise WorkerError(f"worker {worker_id!r} still draining after {timeout:g}s",
                                  status=None, code="drain_timeout")
            time.sleep(DRAIN_POLL_S)
