"""Optional data plane: NIXL with its UCX backend (`nixl-cu12` works on CPU memory).

Like the Mooncake data plane: the whole KV pool (`KVPool.kv`) is registered with a NIXL agent at
startup; a sink puts its agent metadata and pool base address in its `register` / `pull` frame;
the source loads the sink's agent once per peer, then posts one NIXL WRITE of the page runs
(usually one region, see `regions`) into the sink's pool and sends a `kv_written` control frame.
Rendezvous, metadata row, acks and deadlines are those of the built-in transport; mixed pairs
fall back to TCP frames.

Progress thread: the nixl Python wrapper starts UCX's progress thread with no poll delay, so it
spins (about 0.7 of a core per process, idle or not). A sink needs it (UCX connection setup is
answered there), a source does not: it only initiates writes and drives their progress itself
when it checks the transfer state. So a prefill engine's agent runs without it, which leaves
the core to the copy (on 2 cores the two spinning threads took ~1.4 cores from everything else).
A sink's progress thread polls every `PROGRESS_DELAY_US` instead of spinning (`make_agent`).
"""

from __future__ import annotations

import base64
import sys
import threading
import time

from ..errors import EngineStartError
from ..kv import KVPool
from .regions import compatible, describe_pool, regions

INSTALL_HINT = ("--disaggregation-transfer-backend nixl needs NIXL: pip install nixl-cu12 "
                "(its UCX backend works on CPU memory)")


def _import_nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise EngineStartError(f"{INSTALL_HINT} ({e})") from e
    return nixl_agent, nixl_agent_config


# The sink's progress thread sleeps this long between polls. The wrapper hard-codes 0 (a busy
# loop: ~0.7 of a core per idle decode engine); 1 ms costs ~0.04 of a core and at most 1 ms on
# a transfer that takes tens of milliseconds.
PROGRESS_DELAY_US = 1000
_agent_lock = threading.Lock()


def make_agent(name: str, progress_thread: bool):
    """A NIXL agent with the UCX backend; `progress_thread=False` for one that only initiates."""
    nixl_agent, nixl_agent_config = _import_nixl()
    config = nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    bindings = getattr(sys.modules.get(nixl_agent.__module__), "nixlBind", None)
    real = getattr(bindings, "nixlAgent", None)
    if real is None:  # another wrapper layout: keep its defaults
        return nixl_agent(name, config)

    def with_delay(agent_name, agent_config):
        # The wrapper sets pthrDelay = 0 just before this call; this is the one place to change it.
        agent_config.pthrDelay = PROGRESS_DELAY_US
        return real(agent_name, agent_config)

    with _agent_lock:  # the swap is process-wide: one construction at a time
        bindings.nixlAgent = with_delay
        try:
            return nixl_agent(name, config)
        finally:
            bindings.nixlAgent = real


class NixlBackend:
    name = "nixl"

    def __init__(self, pool: KVPool, agent_name: str, timeout: float = 60.0,
                 progress_thread: bool = True):
        self.pool, self.timeout = pool, timeout
        self.agent_name = agent_name
        self.agent = make_agent(agent_name, progress_thread)
        self.agent.register_memory([(pool.kv.ctypes.data, pool.kv.nbytes, 0, "")], "DRAM")
        self._meta = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self._peers: dict[str, str] = {}  # metadata digest -> loaded remote agent name
        # The wrapper's agent is built without thread synchronisation (no listener thread), and
        # writes run on executor threads: one write at a time.
        self._lock = threading.Lock()

    def describe(self) -> dict:
        return {"backend": self.name, "agent": self.agent_name, "metadata": self._meta,
                **describe_pool(self.pool)}

    def compatible(self, peer: dict | None) -> bool:
        return compatible(self.describe(), peer)

    def _peer(self, peer: dict) -> str:
        key = peer["agent"] + ":" + peer["metadata"][-32:]
        if key not in self._peers:
            self._peers[key] = self.agent.add_remote_agent(base64.b64decode(peer["metadata"]))
        return self._peers[key]

    def write(self, peer: dict, src: list[int], dst: list[int]) -> int:
        """Blocking: one NIXL WRITE of src pages into the peer's dst pages. Returns bytes."""
        with self._lock:
            return self._write(peer, src, dst)

    def _write(self, peer: dict, src: list[int], dst: list[int]) -> int:
        regs = regions(self.pool, peer, src, dst)
        local = self.agent.get_xfer_descs([(a, n, 0) for a, _, n in regs], "DRAM")
        remote = self.agent.get_xfer_descs([(b, n, 0) for _, b, n in regs], "DRAM")
        name = self._peer(peer)
        handle = self.agent.initialize_xfer("WRITE", local, remote, name, b"kv")
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + self.timeout
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"NIXL write to {peer['agent']} timed out")
                time.sleep(0.0002)
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError(f"NIXL write to {peer['agent']} failed")
        finally:
            self.agent.release_xfer_handle(handle)
        return sum(n for _, _, n in regs)
