"""A small Kubernetes API server for Pods, faithful to the real list/watch contract.

There is no kube-apiserver on the test machines, so this stands in for one. What it implements,
as the real server does (k8s.io/apiserver, the watch cache):

- one monotonic ``resourceVersion`` for every change (create, update, patch, delete);
- ``GET /api/v1/pods`` and ``/api/v1/namespaces/{ns}/pods``: list with ``labelSelector``
  (``=``, ``==``, ``!=``, ``in``, ``notin``, exists, ``!`` not exists), ``limit``/``continue``
  paging, ``resourceVersion`` (``""``/``"0"``: current state; ``resourceVersionMatch=Exact``
  with an expired version: 410);
- ``?watch=true``: without ``resourceVersion`` (or ``"0"``) synthetic ADDED events for the current
  objects, then live events; with ``resourceVersion=N`` a replay of every event after N, then live;
  an N older than the retained history gives a watch ERROR event carrying a Status with code 410
  and reason Expired ("too old resource version: N (M)"), as the watch cache sends it;
- per-watcher selector translation: an object that leaves the selector is a DELETED event (with
  its previous state and the new resourceVersion), one that enters it is an ADDED event;
- BOOKMARK events (``allowWatchBookmarks=true``) carrying the current resourceVersion, only after
  every earlier event was sent to that watcher;
- watches closed by the server after ``timeoutSeconds`` (or ``max_watch_seconds``);
- pods: create (201, uid, creationTimestamp, ``status.phase: Pending``), get, replace (409 on a
  stale resourceVersion), patch (merge / strategic-merge as a JSON merge patch, json-patch), the
  ``status`` subresource (only it changes ``status``; the main resource keeps it), delete: with a
  grace period the pod is only marked terminating (``deletionTimestamp``, a MODIFIED event) until
  a delete with ``gracePeriodSeconds=0`` removes it (what the kubelet does after the grace period).

Test controls: ``compact()`` (forget history: older versions now give 410), ``drop_watches()``
(cut every open watch, abruptly or cleanly), ``unavailable`` (list and watch answer 503 while
writes still work: changes happen while no watcher can see them), ``watch_count``,
``write_kubeconfig(path)``.
The server runs on its own thread and event loop; it binds 127.0.0.1 on a free port.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Optional

from aiohttp import web

Obj = dict[str, Any]

__all__ = ["FakeApiServer", "parse_selector"]


def _now(offset: float = 0.0) -> str:
    return (datetime.now(timezone.utc) + timedelta(seconds=offset)).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> Obj:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _split_requirements(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    out.append(cur)
    return [r.strip() for r in out if r.strip()]


_SET_RE = re.compile(r"^([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)$")


def parse_selector(text: Optional[str]) -> Callable[[dict[str, str]], bool]:
    """A label selector as a predicate over a label dict (raises ValueError when malformed)."""
    tests: list[Callable[[dict[str, str]], bool]] = []
    for req in _split_requirements(text or ""):
        m = _SET_RE.match(req)
        if m:
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
            if op == "in":
                tests.append(lambda l, k=key, vs=values: l.get(k) in vs)
            else:
                tests.append(lambda l, k=key, vs=values: l.get(k) not in vs)
        elif "!=" in req:
            k, v = (s.strip() for s in req.split("!=", 1))
            tests.append(lambda l, k=k, v=v: l.get(k) != v)
        elif "=" in req:
            k, v = (s.strip() for s in req.replace("==", "=").split("=", 1))
            if not k:
                raise ValueError(f"bad selector requirement {req!r}")
            tests.append(lambda l, k=k, v=v: l.get(k) == v)
        elif req.startswith("!"):
            tests.append(lambda l, k=req[1:].strip(): k not in l)
        elif re.match(r"^[\w./-]+$", req):
            tests.append(lambda l, k=req: k in l)
        else:
            raise ValueError(f"bad selector requirement {req!r}")
    return lambda labels: all(t(labels) for t in tests)


def _labels(obj: Optional[Obj]) -> dict[str, str]:
    return ((obj or {}).get("metadata") or {}).get("labels") or {}


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge_patch(out.get(k), v)
    return out


def _json_patch(doc: Obj, ops: list[Obj]) -> Obj:
    """RFC 6902 JSON patch (add, replace, remove, test) on objects and lists."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
        parent: Any = doc
        for p in parts[:-1]:
            parent = parent[int(p)] if isinstance(parent, list) else parent.setdefault(p, {})
        last = parts[-1]
        kind = op["op"]
        if kind == "test":
            cur = parent[int(last)] if isinstance(parent, list) else parent.get(last)
            if cur != op.get("value"):
                raise ValueError(f"test failed at {op['path']}")
        elif isinstance(parent, list):
            idx = len(parent) if last == "-" else int(last)
            if kind == "add":
                parent.insert(idx, op["value"])
            elif kind == "replace":
                parent[idx] = op["value"]
            elif kind == "remove":
                del parent[idx]
        elif kind in ("add", "replace"):
            parent[last] = op["value"]
        elif kind == "remove":
            parent.pop(last, None)
        else:
            raise ValueError(f"unsupported json-patch op {kind!r}")
    return doc


@dataclass
class _Event:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj
    old: Optional[Obj]


@dataclass(eq=False)
class _Watcher:
    namespace: Optional[str]
    matches: Callable[[dict[str, str]], bool]
    bookmarks: bool
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: Optional[web.Request] = None
    closing: Optional[str] = None  # "clean" or "abrupt"


class FakeApiServer:
    """The Pod list/watch API of a Kubernetes API server, on 127.0.0.1 (see the module doc)."""

    def __init__(self, bookmark_interval: float = 1.0, max_watch_seconds: Optional[float] = None) -> None:
        self.bookmark_interval = bookmark_interval
        self.max_watch_seconds = max_watch_seconds
        self._rv = 1
        self._compacted = 0  # versions <= this (other than the current one) are gone
        self._objects: dict[tuple[str, str], Obj] = {}
        self._history: list[_Event] = []
        self._watchers: set[_Watcher] = set()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._runner: Optional[web.AppRunner] = None
        self.port: Optional[int] = None
        self.requests: list[str] = []  # "METHOD path?query", for tests that check what clients sent
        # While set, list and watch answer 503 (an API server restarting); writes still work, so
        # a test can change pods while the watchers cannot see it.
        self.unavailable = False

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "FakeApiServer":
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="fake-apiserver", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fake API server did not start")
        return self

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/api/v1/pods", self._list_or_watch)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._list_or_watch)
        app.router.add_post("/api/v1/namespaces/{ns}/pods", self._create)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}", self._get)
        for sub in ("", "/status"):
            app.router.add_put("/api/v1/namespaces/{ns}/pods/{name}" + sub, self._replace)
            app.router.add_patch("/api/v1/namespaces/{ns}/pods/{name}" + sub, self._patch)
        app.router.add_delete("/api/v1/namespaces/{ns}/pods/{name}", self._delete)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._bookmarker = asyncio.ensure_future(self._bookmark_loop())

    def stop(self) -> None:
        if self._loop is None:
            return
        self.drop_watches(abrupt=True)

        async def shutdown() -> None:
            self._bookmarker.cancel()
            if self._runner is not None:
                await self._runner.cleanup()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(10)
            self._loop = None

    def __enter__(self) -> "FakeApiServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _call(self, fn: Callable[[], Any]) -> Any:
        """Runs `fn` on the server's loop (all state lives there) and returns its result."""
        assert self._loop is not None

        async def wrapper() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(wrapper(), self._loop).result(10)

    # -- test controls ---------------------------------------------------------------------

    def compact(self) -> int:
        """Forgets the event history: watches from any older resourceVersion now get 410."""

        def do() -> int:
            self._history.clear()
            self._compacted = self._rv
            return self._rv

        return self._call(do)

    def drop_watches(self, abrupt: bool = True) -> int:
        """Ends every open watch: `abrupt` cuts the connection, else the stream ends cleanly."""

        def do() -> int:
            for w in list(self._watchers):
                w.closing = "abrupt" if abrupt else "clean"
                w.queue.put_nowait(None)
            return len(self._watchers)

        return self._call(do)

    @property
    def watch_count(self) -> int:
        return self._call(lambda: len(self._watchers))

    @property
    def resource_version(self) -> int:
        return self._call(lambda: self._rv)

    def write_kubeconfig(self, path: str, namespace: str = "default") -> str:
        config = {
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}],
        }
        with open(path, "w") as f:
            json.dump(config, f)  # JSON is YAML: any kubeconfig reader takes it
        return path

    # -- storage (event loop only) ---------------------------------------------------------

    def _commit(self, type_: str, obj: Obj, old: Optional[Obj]) -> Obj:
        self._rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self._rv)
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if type_ == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = obj
        event = _Event(self._rv, type_, obj, old)
        self._history.append(event)
        for w in self._watchers:
            w.queue.put_nowait(event)
        return obj

    @staticmethod
    def _view(event: _Event, w: _Watcher) -> Optional[tuple[str, Obj]]:
        """What one watcher sees of an event (namespace and selector applied)."""
        if w.namespace is not None and event.obj["metadata"]["namespace"] != w.namespace:
            return None
        now, before = w.matches(_labels(event.obj)), event.old is not None and w.matches(_labels(event.old))
        if event.type == "MODIFIED":
            if now and before:
                return "MODIFIED", event.obj
            if now:
                return "ADDED", event.obj
            if before:
                old = copy.deepcopy(event.old)
                old["metadata"]["resourceVersion"] = str(event.rv)
                return "DELETED", old
            return None
        return (event.type, event.obj) if now else None

    def _matching(self, ns: Optional[str], matches: Callable[[dict[str, str]], bool]) -> list[Obj]:
        items = [o for (n, _), o in sorted(self._objects.items()) if (ns is None or n == ns) and matches(_labels(o))]
        return copy.deepcopy(items)

    # -- handlers --------------------------------------------------------------------------

    @staticmethod
    def _error(code: int, reason: str, message: str) -> web.Response:
        return web.json_response(_status(code, reason, message), status=code)

    def _not_found(self, ns: str, name: str) -> web.Response:
        return self._error(404, "NotFound", f'pods "{name}" not found')

    async def _list_or_watch(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(f"{request.method} {request.path_qs}")
        if self.unavailable:
            return self._error(503, "ServiceUnavailable", "the server is currently unable to handle the request")
        q = request.query
        try:
            matches = parse_selector(q.get("labelSelector"))
        except ValueError as exc:
            return self._error(400, "BadRequest", f"unable to parse requirement: {exc}")
        ns = request.match_info.get("ns")
        if q.get("watch", "").lower() in ("true", "1"):
            return await self._watch(request, ns, matches)
        return self._list(q, ns, matches)

    def _list(self, q: Any, ns: Optional[str], matches: Callable[[dict[str, str]], bool]) -> web.Response:
        rv = q.get("resourceVersion", "")
        if q.get("resourceVersionMatch") == "Exact" and rv and int(rv) != self._rv and int(rv) <= self._compacted:
            return self._error(410, "Expired", f"too old resource version: {rv} ({self._rv})")
        items = self._matching(ns, matches)
        list_rv, start = self._rv, 0
        if q.get("continue"):
            try:
                token = json.loads(base64.b64decode(q["continue"]))
                list_rv, start = int(token["rv"]), int(token["start"])
            except (ValueError, KeyError):
                return self._error(400, "BadRequest", "invalid continue token")
            if list_rv < self._compacted:
                return self._error(410, "Expired", "The provided continue parameter is too old")
        limit = int(q.get("limit", "0") or 0)
        meta: Obj = {"resourceVersion": str(list_rv)}
        if limit > 0 and start + limit < len(items):
            meta["continue"] = base64.b64encode(json.dumps({"rv": list_rv, "start": start + limit}).encode()).decode()
            meta["remainingItemCount"] = len(items) - start - limit
            items = items[start:start + limit]
        else:
            items = items[start:]
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": items})

    async def _watch(self, request: web.Request, ns: Optional[str], matches: Callable[[dict[str, str]], bool]) -> web.StreamResponse:
        q = request.query
        w = _Watcher(ns, matches, q.get("allowWatchBookmarks", "").lower() in ("true", "1"), request=request)
        rv = q.get("resourceVersion", "")
        # Backlog first, computed in the same loop step as the registration: nothing falls between.
        if rv in ("", "0"):
            backlog: list[tuple[str, Obj]] = [("ADDED", o) for o in self._matching(ns, matches)]
            expired = False
        else:
            expired = int(rv) < self._compacted
            backlog = [v for e in self._history if e.rv > int(rv) for v in [self._view(e, w)] if v]
        self._watchers.add(w)
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        try:
            await resp.prepare(request)
            if expired:
                await self._send(resp, "ERROR", _status(410, "Expired", f"too old resource version: {rv} ({self._rv})"))
                return resp
            for type_, obj in backlog:
                await self._send(resp, type_, obj)
            await self._stream(request, resp, w)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self._watchers.discard(w)
        return resp

    async def _stream(self, request: web.Request, resp: web.StreamResponse, w: _Watcher) -> None:
        limits = [float(request.query["timeoutSeconds"])] if request.query.get("timeoutSeconds") else []
        if self.max_watch_seconds:
            limits.append(self.max_watch_seconds)
        deadline = time.monotonic() + min(limits) if limits else None
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return  # server-closed watch: the stream ends cleanly
            try:
                item = await asyncio.wait_for(w.queue.get(), left)
            except asyncio.TimeoutError:
                return
            if item is None:
                if w.closing == "abrupt" and request.transport is not None:
                    request.transport.abort()
                    raise ConnectionResetError("watch dropped")
                return
            if isinstance(item, tuple):  # ("BOOKMARK", rv)
                meta = {"resourceVersion": str(item[1])}
                await self._send(resp, "BOOKMARK", {"kind": "Pod", "apiVersion": "v1", "metadata": meta})
                continue
            view = self._view(item, w)
            if view:
                await self._send(resp, *view)

    @staticmethod
    async def _send(resp: web.StreamResponse, type_: str, obj: Obj) -> None:
        await resp.write(json.dumps({"type": type_, "object": obj}).encode() + b"\n")

    async def _bookmark_loop(self) -> None:
        while True:
            await asyncio.sleep(self.bookmark_interval)
            for w in self._watchers:
                if w.bookmarks:
                    # Queued behind every event already sent to this watcher: the version is safe.
                    w.queue.put_nowait(("BOOKMARK", self._rv))

    async def _body(self, request: web.Request) -> Any:
        try:
            return await request.json()
        except (json.JSONDecodeError, ValueError):
            return None

    async def _create(self, request: web.Request) -> web.Response:
        ns = request.match_info["ns"]
        body = await self._body(request)
        if not isinstance(body, dict) or not (body.get("metadata") or {}).get("name"):
            return self._error(422, "Invalid", "Pod is invalid: metadata.name: Required value")
        name = body["metadata"]["name"]
        if (ns, name) in self._objects:
            return self._error(409, "AlreadyExists", f'pods "{name}" already exists')
        obj = copy.deepcopy(body)
        obj["kind"], obj["apiVersion"] = "Pod", "v1"
        meta = obj["metadata"]
        meta.update({"namespace": ns, "uid": str(uuid.uuid4()), "creationTimestamp": _now()})
        for k in ("resourceVersion", "deletionTimestamp", "deletionGracePeriodSeconds"):
            meta.pop(k, None)
        obj.setdefault("spec", {})
        obj["status"] = {"phase": "Pending"}  # status is the kubelet's, set through /status
        return web.json_response(self._commit("ADDED", obj, None), status=201)

    async def _get(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        obj = self._objects.get((ns, name))
        return web.json_response(obj) if obj else self._not_found(ns, name)

    def _update(self, request: web.Request, old: Obj, new: Obj) -> web.Response:
        """Writes `new` over `old` as the main resource or the status subresource does."""
        is_status = request.path.endswith("/status")
        sent_rv = (new.get("metadata") or {}).get("resourceVersion")
        if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
            return self._error(409, "Conflict", f'Operation cannot be fulfilled on pods "{old["metadata"]["name"]}": '
                               "the object has been modified; please apply your changes to the latest version and try again")
        merged = copy.deepcopy(old)
        if is_status:
            merged["status"] = copy.deepcopy(new.get("status") or {})
        else:
            meta = new.get("metadata") or {}
            for k in ("labels", "annotations"):
                if meta.get(k) is None:
                    merged["metadata"].pop(k, None)
                else:
                    merged["metadata"][k] = meta[k]
            merged["spec"] = copy.deepcopy(new.get("spec") or old.get("spec") or {})
        if merged == old:
            return web.json_response(old)  # a no-op write changes nothing, not even the version
        return web.json_response(self._commit("MODIFIED", merged, old))

    async def _replace(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        old = self._objects.get((ns, name))
        body = await self._body(request)
        if old is None:
            return self._not_found(ns, name)
        if not isinstance(body, dict):
            return self._error(400, "BadRequest", "body must be a Pod")
        return self._update(request, old, body)

    async def _patch(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        old = self._objects.get((ns, name))
        body = await self._body(request)
        if old is None:
            return self._not_found(ns, name)
        try:
            if request.content_type == "application/json-patch+json":
                new = _json_patch(old, body)
            elif request.content_type in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                new = _merge_patch(old, body)
            else:
                return self._error(415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {request.content_type}")
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            return self._error(422, "Invalid", f"patch failed: {exc}")
        # A patch carries no resourceVersion precondition unless it sets one explicitly.
        if isinstance(body, dict) and not (body.get("metadata") or {}).get("resourceVersion"):
            new.setdefault("metadata", {})["resourceVersion"] = old["metadata"]["resourceVersion"]
        return self._update(request, old, new)

    async def _delete(self, request: web.Request) -> web.Response:
        ns, name = request.match_info["ns"], request.match_info["name"]
        old = self._objects.get((ns, name))
        if old is None:
            return self._not_found(ns, name)
        body = await self._body(request) or {}
        grace = request.query.get("gracePeriodSeconds", body.get("gracePeriodSeconds"))
        if grace is None:
            grace = (old.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
        grace = int(grace)
        if grace > 0:
            if old["metadata"].get("deletionTimestamp"):
                return web.json_response(old)
            marked = copy.deepcopy(old)
            marked["metadata"]["deletionTimestamp"] = _now(grace)
            marked["metadata"]["deletionGracePeriodSeconds"] = grace
            return web.json_response(self._commit("MODIFIED", marked, old))
        return web.json_response(self._commit("DELETED", old, old))
