"""Pod helpers for tests, written with the official Kubernetes client: what a kubelet and a user
would do to pods (create, make ready, relabel, mark terminating, delete)."""

from __future__ import annotations

from typing import Any, Optional

__all__ = ["create_pod", "delete_pod", "relabel", "set_ready", "terminate"]


def create_pod(core: Any, ns: str, name: str, labels: dict[str, str],
               annotations: Optional[dict[str, str]] = None) -> Any:
    body = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "labels": labels, "annotations": annotations or {}},
        "spec": {"containers": [{"name": "engine", "image": "pdgate:latest"}]},
    }
    return core.create_namespaced_pod(ns, body)


def set_ready(core: Any, ns: str, name: str, ready: bool = True, ip: str = "127.0.0.1",
              phase: str = "Running") -> Any:
    """What the kubelet reports: phase, pod IP and the Ready condition (status subresource)."""
    status = {
        "phase": phase, "podIP": ip, "podIPs": [{"ip": ip}],
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"},
                       {"type": "ContainersReady", "status": "True" if ready else "False"}],
    }
    return core.patch_namespaced_pod_status(name, ns, {"status": status})


def relabel(core: Any, ns: str, name: str, labels: dict[str, Optional[str]]) -> Any:
    """Merges `labels` into the pod's labels (None removes a label)."""
    return core.patch_namespaced_pod(name, ns, {"metadata": {"labels": labels}})


def terminate(core: Any, ns: str, name: str, grace: int = 30) -> Any:
    """A delete with a grace period: the pod is marked terminating (deletionTimestamp)."""
    from kubernetes import client

    return core.delete_namespaced_pod(name, ns, body=client.V1DeleteOptions(grace_period_seconds=grace))


def delete_pod(core: Any, ns: str, name: str) -> Any:
    """The final delete (what the kubelet does once the containers stopped)."""
    from kubernetes import client

    return core.delete_namespaced_pod(name, ns, body=client.V1DeleteOptions(grace_period_seconds=0))
