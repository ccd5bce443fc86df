"""Optional data plane: NIXL with its UCX backend (`nixl-cu12` works on CPU memory).

Like the Mooncake data plane: the whole KV pool is registered with a NIXL agent at startup; a
sink puts its agent metadata and pool addresses in its `register` / `pull` frame; the source
loads the sink's agent, then posts one NIXL WRITE of the page runs into the sink's pool and
sends a `kv_written` control frame. Rendezvous, metadata row, acks and deadlines are those of
the built-in transport; mixed pairs fall back to TCP frames.
"""

from __future__ import annotations

import base64
import time

from ..kv import KVPool
from .mooncake_te import page_runs

INSTALL_HINT = ("--disaggregation-transfer-backend nixl needs NIXL: pip install nixl-cu12 "
                "(its UCX backend works on CPU memory)")


def _import_nixl():
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise SystemExit(f"{INSTALL_HINT} ({e})") from e
    return nixl_agent, nixl_agent_config


class NixlBackend:
    name = "nixl"

    def __init__(self, pool: KVPool, agent_name: str, timeout: float = 60.0):
        nixl_agent, nixl_agent_config = _import_nixl()
        self.pool, self.timeout = pool, timeout
        self.agent_name = agent_name
        self.agent = nixl_agent(agent_name, nixl_agent_config(backends=["UCX"]))
        self.agent.register_memory([(a.ctypes.data, a.nbytes, 0, "") for a in (pool.k, pool.v)], "DRAM")
        self._meta = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self._peers: dict[str, str] = {}  # metadata digest -> loaded remote agent name

    def describe(self) -> dict:
        k = self.pool.k
        return {"backend": self.name, "agent": self.agent_name, "metadata": self._meta,
                "k_base": k.ctypes.data, "v_base": self.pool.v.ctypes.data,
                "layer_stride": k.strides[0], "page_stride": k.strides[1]}

    def _peer(self, peer: dict) -> str:
        key = peer["agent"] + ":" + peer["metadata"][-32:]
        if key not in self._peers:
            self._peers[key] = self.agent.add_remote_agent(base64.b64decode(peer["metadata"]))
        return self._peers[key]

    def write(self, peer: dict, src: list[int], dst: list[int]) -> int:
        """Blocking: one NIXL WRITE of src pages into the peer's dst pages. Returns bytes."""
        me, page = self.describe(), self.pool.k.strides[1]
        local, remote = [], []
        for kind in ("k_base", "v_base"):
            for layer in range(self.pool.k.shape[0]):
                for s, d, n in page_runs(src, dst):
                    local.append((me[kind] + layer * me["layer_stride"] + s * me["page_stride"], n * page, 0))
                    remote.append((peer[kind] + layer * peer["layer_stride"] + d * peer["page_stride"], n * page, 0))
        name = self._peer(peer)
        handle = self.agent.initialize_xfer("WRITE", self.agent.get_xfer_descs(local, "DRAM"),
                                            self.agent.get_xfer_descs(remote, "DRAM"), name, b"kv")
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
        return sum(n for _, n, _ in local)
