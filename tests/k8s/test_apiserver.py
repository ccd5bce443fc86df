"""The fake API server checked against the official Kubernetes Python client, so the fixture the
discovery tests rely on behaves like the real list/watch contract."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from kubernetes import client, watch

from apiserver import FakeApiServer, parse_selector
from pods import create_pod, delete_pod, relabel, set_ready, terminate

NS = "ml"


def events(core: Any, rv: str, timeout: int = 1, **kwargs: Any) -> list[tuple[str, str, str]]:
    """(type, name, resourceVersion) of every event of a watch from `rv` (server-closed after `timeout`)."""
    w = watch.Watch()
    out = []
    for e in w.stream(core.list_namespaced_pod, NS, resource_version=rv, timeout_seconds=timeout, **kwargs):
        if e["type"] == "BOOKMARK":
            out.append(("BOOKMARK", "", e["raw_object"]["metadata"]["resourceVersion"]))
        else:
            out.append((e["type"], e["object"].metadata.name, e["object"].metadata.resource_version))
    return out


def test_create_list_and_selectors(core: Any) -> None:
    rv0 = int(core.list_namespaced_pod(NS).metadata.resource_version)
    a = create_pod(core, NS, "a", {"app": "p", "model": "m1"})
    create_pod(core, NS, "b", {"app": "d"})
    create_pod(core, "other", "c", {"app": "p"})
    assert a.metadata.uid and a.metadata.creation_timestamp and a.status.phase == "Pending"
    listed = core.list_namespaced_pod(NS)
    assert int(listed.metadata.resource_version) == rv0 + 3, "one version per write, monotonic"
    assert [p.metadata.name for p in listed.items] == ["a", "b"]
    assert [p.metadata.name for p in core.list_namespaced_pod(NS, label_selector="app=p").items] == ["a"]
    assert [p.metadata.name for p in core.list_pod_for_all_namespaces(label_selector="app=p").items] == ["a", "c"]
    assert [p.metadata.name for p in core.list_namespaced_pod(NS, label_selector="app in (p,d),model!=m1").items] == ["b"]
    with pytest.raises(client.ApiException) as exc:
        create_pod(core, NS, "a", {})
    assert exc.value.status == 409
    with pytest.raises(client.ApiException) as exc:
        core.read_namespaced_pod("zzz", NS)
    assert exc.value.status == 404


def test_paging_returns_every_item_once(core: Any) -> None:
    for i in range(5):
        create_pod(core, NS, f"p{i}", {"app": "p"})
    page = core.list_namespaced_pod(NS, limit=2)
    names, rv = [p.metadata.name for p in page.items], page.metadata.resource_version
    while page.metadata._continue:
        page = core.list_namespaced_pod(NS, limit=2, _continue=page.metadata._continue)
        names += [p.metadata.name for p in page.items]
        assert page.metadata.resource_version == rv, "every page is of the same list"
    assert names == [f"p{i}" for i in range(5)]


def test_status_subresource_and_no_op_writes(core: Any) -> None:
    create_pod(core, NS, "a", {"app": "p"})
    ready = set_ready(core, NS, "a")
    assert ready.status.phase == "Running" and ready.status.pod_ip == "127.0.0.1"
    # The main resource does not change status; a write that changes nothing keeps the version.
    same = core.patch_namespaced_pod("a", NS, {"status": {"phase": "Failed"}})
    assert same.status.phase == "Running" and same.metadata.resource_version == ready.metadata.resource_version
    stale = core.read_namespaced_pod("a", NS)
    relabel(core, NS, "a", {"x": "1"})
    stale.metadata.labels["y"] = "2"
    with pytest.raises(client.ApiException) as exc:
        core.replace_namespaced_pod("a", NS, stale)
    assert exc.value.status == 409, "replace with a stale resourceVersion conflicts"


def test_watch_replays_from_a_version_and_translates_selector_changes(core: Any) -> None:
    rv = core.list_namespaced_pod(NS, label_selector="app=p").metadata.resource_version
    create_pod(core, NS, "a", {"app": "p"})
    create_pod(core, NS, "b", {"app": "d"})
    set_ready(core, NS, "a")
    relabel(core, NS, "a", {"app": "d"})  # leaves app=p
    relabel(core, NS, "b", {"app": "p"})  # enters app=p
    terminate(core, NS, "b")
    delete_pod(core, NS, "b")
    seen = events(core, rv, label_selector="app=p")
    assert [(t, n) for t, n, _ in seen] == [
        ("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a"), ("ADDED", "b"), ("MODIFIED", "b"), ("DELETED", "b"),
    ]
    versions = [int(v) for _, _, v in seen]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    # Resuming from the middle replays exactly what came after.
    assert [(t, n) for t, n, _ in events(core, str(versions[2]), label_selector="app=p")] == [
        ("ADDED", "b"), ("MODIFIED", "b"), ("DELETED", "b"),
    ]


def test_watch_without_version_starts_with_the_current_objects(core: Any) -> None:
    create_pod(core, NS, "a", {"app": "p"})
    create_pod(core, NS, "b", {"app": "p"})
    delete_pod(core, NS, "a")
    assert [(t, n) for t, n, _ in events(core, "0")] == [("ADDED", "b")]


def test_live_events_bookmarks_and_server_closed_watches(core: Any) -> None:
    rv = core.list_namespaced_pod(NS).metadata.resource_version

    def later() -> None:
        time.sleep(0.3)
        create_pod(core, NS, "live", {"app": "p"})

    threading.Thread(target=later).start()
    started = time.monotonic()
    seen = events(core, rv, timeout=2, allow_watch_bookmarks=True)
    assert 1.5 < time.monotonic() - started < 5, "the server ends the watch after timeoutSeconds"
    assert ("ADDED", "live") in [(t, n) for t, n, _ in seen]
    bookmarks = [int(v) for t, _, v in seen if t == "BOOKMARK"]
    assert bookmarks and bookmarks[-1] >= int(rv) + 1, "bookmarks carry the current version"
    assert not [t for t, _, _ in events(core, rv, timeout=1) if t == "BOOKMARK"], "only when asked for"


def test_expired_version_is_a_410_error_event(apiserver: FakeApiServer, core: Any) -> None:
    rv = core.list_namespaced_pod(NS).metadata.resource_version
    create_pod(core, NS, "a", {"app": "p"})
    apiserver.compact()
    with pytest.raises(client.ApiException) as exc:
        events(core, rv)
    assert exc.value.status == 410 and "too old resource version" in str(exc.value.reason)
    # What a client does after a 410: re-list, and watch from the version the list gave.
    fresh = core.list_namespaced_pod(NS).metadata.resource_version
    assert events(core, fresh) == []


def test_dropped_watches_end_the_client_stream(apiserver: FakeApiServer, core: Any) -> None:
    rv = core.list_namespaced_pod(NS).metadata.resource_version
    done = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            events(core, rv, timeout=30)
        except Exception as exc:  # urllib3 ProtocolError: what a cut connection looks like
            errors.append(exc)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    deadline = time.monotonic() + 5
    while apiserver.watch_count == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert apiserver.drop_watches(abrupt=True) == 1
    assert done.wait(5), "the client noticed the dropped watch"
    assert parse_selector("a=1,!b")({"a": "1"}) and not parse_selector("a=1,!b")({"a": "1", "b": "x"})
