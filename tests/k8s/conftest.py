"""Fixtures for the Kubernetes tier: the fake API server and the official Python client on it."""

from __future__ import annotations

import pathlib
import sys
from typing import Any, Iterator

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from apiserver import FakeApiServer  # noqa: E402

kubernetes = pytest.importorskip("kubernetes", reason="the official Kubernetes client (pip install kubernetes)")


@pytest.fixture
def apiserver() -> Iterator[FakeApiServer]:
    server = FakeApiServer(bookmark_interval=0.5).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def core(apiserver: FakeApiServer, tmp_path: pathlib.Path) -> Iterator[Any]:
    """A `kubernetes.client.CoreV1Api` talking to the fake API server through a kubeconfig."""
    from kubernetes import client, config

    path = apiserver.write_kubeconfig(str(tmp_path / "kubeconfig"))
    conf = client.Configuration()
    config.load_kube_config(config_file=path, client_configuration=conf)
    api = client.ApiClient(conf)
    try:
        yield client.CoreV1Api(api)
    finally:
        api.close()

