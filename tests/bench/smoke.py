"""Plumbing of the benchmark scripts' smoke (test_bench_smoke.py): which tools a smoke needs,
the release binaries the gateway scripts drive, and running one script to its end."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# .ci/run sets it: there a missing tool fails the smoke instead of skipping it.
REQUIRED = os.environ.get("PDGATE_BENCH_SMOKE") == "require"
TARGET = Path(os.environ.get("CARGO_TARGET_DIR") or Path.home() / ".cache/pdgate/target")
# A number in a report cell: 12, 3.4, 0.98x.
NUM = r"[0-9]+(?:\.[0-9]+)?"


def require(*tools: str) -> None:
    """Skips (fails under PDGATE_BENCH_SMOKE=require) when a command is not on PATH."""
    missing = [t for t in tools if shutil.which(t, path=env()["PATH"]) is None]
    if not missing:
        return
    why = f"not installed: {', '.join(missing)} (Debian packages nginx-light, wrk, valgrind, heaptrack, linux-perf; pip smg, vllm-router)"
    if REQUIRED:
        pytest.fail(f"PDGATE_BENCH_SMOKE=require and {why}")
    pytest.skip(why)


def env(**extra: str) -> dict[str, str]:
    """The scripts' environment: this interpreter first on PATH (its `python3`, `pdgate`, peers)."""
    bindir = str(Path(sys.executable).parent)
    base = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "PYTHON": sys.executable,
            "CARGO_TARGET_DIR": str(TARGET), "PYTHONUNBUFFERED": "1"}
    return {**base, **extra}


def run(argv: list[str], timeout: float, **extra: str) -> str:
    """Runs a script from the repository root to its end; fails with its output unless it exits 0.
    Returns stdout and stderr, interleaved."""
    before = set(os.listdir(REPO))
    # Its own process group: a script stuck past its timeout goes with its gateways and mocks.
    p = subprocess.Popen(argv, cwd=REPO, env=env(**extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = ""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                out, _ = p.communicate(timeout=10)
                break
        pytest.fail(f"{' '.join(argv)} still running after {timeout:.0f} s:\n{(out or '')[-4000:]}")
    assert p.returncode == 0, f"{' '.join(argv)} exited {p.returncode}:\n{out[-6000:]}"
    # Results go where the smoke says (heaptrack_print once wrote a file named `0` here).
    assert set(os.listdir(REPO)) <= before, f"{' '.join(argv)} left {set(os.listdir(REPO)) - before} in {REPO}"
    return out


def row(out: str, pattern: str) -> re.Match[str]:
    """The output line matching `pattern` (a regex anchored at a line's start; NUM for numbers)."""
    m = re.search("^" + pattern, out, re.M)
    assert m, f"no line matching {pattern!r} in:\n{out[-4000:]}"
    return m


def cargo_build(*args: str, timeout: float = 1800) -> None:
    """A release build into TARGET (a no-op when fresh); slow the first time on two cores."""
    require("cargo")
    p = subprocess.run(["cargo", "build", "--release", "-q", *args], cwd=REPO, env=env(),
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]


def copy_out(built: Path, dest: Path) -> Path:
    """A copy of a binary that a later build with other features cannot overwrite."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, dest)
    return dest
