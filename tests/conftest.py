"""Shared test plumbing: subprocesses that are always killed. Standard library only, so every
test tier (engine, gateway) can use it without the compiled extension."""

from __future__ import annotations

import subprocess
from typing import Iterator

import pytest


class Processes:
    """Starts subprocesses for one test and kills every one of them afterwards."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def popen(self, args: list[str], **kwargs: object) -> subprocess.Popen:
        proc = subprocess.Popen(args, **kwargs)  # type: ignore[call-overload]
        self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        # SIGTERM first so a process can stop its own children (e.g. quickstart's workers),
        # then SIGKILL whatever is still there.
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            for stream in (proc.stdout, proc.stderr, proc.stdin):
                if stream is not None:
                    stream.close()


@pytest.fixture
def processes() -> Iterator[Processes]:
    procs = Processes()
    try:
        yield procs
    finally:
        procs.kill_all()
