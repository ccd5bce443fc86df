"""Optional data plane: Mooncake Transfer Engine (`mooncake-transfer-engine-non-cuda`, TCP
protocol, P2P handshake: no metadata server).

The whole KV pool (`KVPool.kv`, one page-major array) is registered with the engine at startup. A
sink announces its session and pool base address in its `register` / `pull` frame; the source
then writes the pages straight into the sink's pool, one region per run of consecutive pages
(usually one for the whole request, see `regions`), and sends a `kv_written` control frame on
the side channel. The rendezvous, metadata row, acks and deadlines stay those of the built-in
transport. If the two sides do not both use Mooncake, the pages travel as TCP frames instead.

EPD embeddings use the same engine with memory of their own (`embed_plane`): `register` adds
a buffer at startup and `write_bytes` writes one region.
"""

from __future__ import annotations

import numpy as np

from ..errors import EngineStartError
from ..kv import KVPool
from .regions import compatible, describe_pool, regions

INSTALL_HINT = ("--disaggregation-transfer-backend mooncake needs the Mooncake Transfer Engine: "
                "pip install mooncake-transfer-engine-non-cuda (on Debian also apt-get install libibverbs1)")


class MooncakeBackend:
    name = "mooncake"

    def __init__(self, pool: KVPool, host: str):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise EngineStartError(f"{INSTALL_HINT} ({e})") from e
        self.pool = pool
        self.te = TransferEngine()
        rc = self.te.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise EngineStartError(f"Mooncake Transfer Engine initialize failed ({rc})")
        rc = self.te.register_memory(pool.kv.ctypes.data, pool.kv.nbytes)
        if rc != 0:
            raise EngineStartError(f"Mooncake register_memory failed ({rc})")
        self.session = f"{host}:{self.te.get_rpc_port()}"

    def register(self, buf: np.ndarray) -> None:
        """Register more memory a peer may write into (once, at startup: it is costly)."""
        rc = self.te.register_memory(buf.ctypes.data, buf.nbytes)
        if rc != 0:
            raise EngineStartError(f"Mooncake register_memory failed ({rc})")

    def write_bytes(self, session: str, local: int, remote: int, length: int) -> None:
        """Blocking: write `length` bytes at local address `local` to `remote` in the peer's
        registered memory. The peer's engine refuses an address outside what it registered."""
        rc = self.te.transfer_sync_write(session, local, remote, length)
        if rc != 0:
            raise RuntimeError(f"Mooncake write to {session} failed ({rc})")

    def describe(self) -> dict:
        return {"backend": self.name, "session": self.session, **describe_pool(self.pool)}

    def compatible(self, peer: dict | None) -> bool:
        return compatible(self.describe(), peer)

    def write(self, peer: dict, src: list[int], dst: list[int]) -> int:
        """Blocking: write src pages into the peer's dst pages. Returns bytes written."""
        local, remote, lens = map(list, zip(*regions(self.pool, peer, src, dst)))
        if len(lens) == 1:
            rc = self.te.transfer_sync_write(peer["session"], local[0], remote[0], lens[0])
        else:
            rc = self.te.batch_transfer_sync_write(peer["session"], local, remote, lens)
        if rc != 0:
            raise RuntimeError(f"Mooncake write to {peer['session']} failed ({rc})")
        return sum(lens)
