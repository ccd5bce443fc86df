"""Die with the parent: a worker started by `pdgate quickstart` (or any `ReferenceWorker`) must
not outlive it, even when the parent is killed with SIGKILL and runs no cleanup.

The launcher passes its pid in `PDGATE_PARENT_PID`. On Linux the worker asks the kernel for a
SIGTERM when its parent dies (PR_SET_PDEATHSIG); everywhere, a daemon thread also polls
`os.getppid()`, since PR_SET_PDEATHSIG fires when the parent *thread* that spawned the worker
exits (a worker started from a thread pool would die early with it) and is not on macOS. So the
kernel signal is only armed when the launcher says it spawned from its main thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

ENV_PARENT_PID = "PDGATE_PARENT_PID"
ENV_MAIN_THREAD = "PDGATE_PARENT_MAIN_THREAD"
_PR_SET_PDEATHSIG = 1
POLL_SECONDS = 0.5


def _arm_pdeathsig() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # the poll below still catches it, within POLL_SECONDS


def _watch(parent: int) -> None:
    stop = threading.Event()
    while not stop.wait(POLL_SECONDS):
        if os.getppid() != parent:
            # SIGTERM to ourselves: the engine's own handler shuts down cleanly (frees ports).
            os.kill(os.getpid(), signal.SIGTERM)
            return


def install_from_env() -> bool:
    """Start watching the parent named in the environment; False when none is named."""
    try:
        parent = int(os.environ.get(ENV_PARENT_PID, ""))
    except ValueError:
        return False
    if os.getppid() != parent:
        # The parent died before we got here.
        os.kill(os.getpid(), signal.SIGTERM)
        return True
    if sys.platform.startswith("linux") and os.environ.get(ENV_MAIN_THREAD) == "1":
        _arm_pdeathsig()
    threading.Thread(target=_watch, args=(parent,), name="pdgate-parent-watch", daemon=True).start()
    return True
