"""pdgate.workers.VllmWorker without vLLM: what a restart keeps and what it takes anew."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pdgate.errors import WorkerStartError
from pdgate.workers import VllmWorker


def test_a_restart_keeps_its_url_and_takes_a_new_nixl_side_channel_port(tmp_path: Path) -> None:
    """A fault test's revive restarts a killed worker: the gateway knows it by its URL, so that
    stays; its NIXL side channel port is learnt by peers per request, and the old one may have
    become another process's port since the kill, so a restart takes a new one. (A Python
    without vLLM exits at once: each start fails fast, which is all this needs.)"""
    w = VllmWorker(str(tmp_path), "decode", python=sys.executable)
    url, ports = w.url, []
    for _ in range(2):
        with pytest.raises(WorkerStartError, match="vLLM exited"):
            w.start(timeout=60)
        ports.append(int(w.environment()["VLLM_NIXL_SIDE_CHANNEL_PORT"]))
    assert w.url == url
    assert ports[0] != ports[1]
