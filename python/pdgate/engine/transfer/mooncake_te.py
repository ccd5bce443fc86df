"""Optional data plane: Mooncake Transfer Engine (`mooncake-transfer-engine-non-cuda`, TCP
protocol, P2P handshake: no metadata server).

The whole KV pool (K and V arrays) is registered with the engine at startup. A sink announces
its session and base addresses in its `register` / `pull` frame; the source then writes the
pages straight into the sink's pool with one batched Mooncake write (runs of consecutive pages
merged) and sends a `kv_written` control frame on the side channel. The rendezvous, metadata row,
acks and deadlines stay those of the built-in transport. If the two sides do not both use
Mooncake, the pages travel as TCP frames instead.
"""

from __future__ import annotations

from ..kv import KVPool

INSTALL_HINT = ("--disaggregation-transfer-backend mooncake needs the Mooncake Transfer Engine: "
                "pip install mooncake-transfer-engine-non-cuda (on Debian also apt-get install libibverbs1)")


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first src page, first dst page, count) for runs consecutive on both sides."""
    runs, i = [], 0
    while i < len(src):
        j = i
        while j + 1 < len(src) and src[j + 1] == src[j] + 1 and dst[j + 1] == dst[j] + 1:
            j += 1
        runs.append((src[i], dst[i], j - i + 1))
        i = j + 1
    return runs


class MooncakeBackend:
    name = "mooncake"

    def __init__(self, pool: KVPool, host: str):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise SystemExit(f"{INSTALL_HINT} ({e})") from e
        self.pool = pool
        self.te = TransferEngine()
        rc = self.te.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise SystemExit(f"Mooncake Transfer Engine initialize failed ({rc})")
        for arr in (pool.k, pool.v):
            rc = self.te.register_memory(arr.ctypes.data, arr.nbytes)
            if rc != 0:
                raise SystemExit(f"Mooncake register_memory failed ({rc})")
        self.session = f"{host}:{self.te.get_rpc_port()}"

    def describe(self) -> dict:
        k = self.pool.k
        return {"backend": self.name, "session": self.session, "k_base": k.ctypes.data,
                "v_base": self.pool.v.ctypes.data, "layer_stride": k.strides[0],
                "page_stride": k.strides[1]}

    def segments(self, peer: dict, src: list[int], dst: list[int]):
        """(local addrs, remote addrs, lengths): one per layer, K/V and run of consecutive pages."""
        me, page = self.describe(), self.pool.k.strides[1]
        srcs, dsts, lens = [], [], []
        for kind in ("k_base", "v_base"):
            for layer in range(self.pool.k.shape[0]):
                for s, d, n in page_runs(src, dst):
                    srcs.append(me[kind] + layer * me["layer_stride"] + s * me["page_stride"])
                    dsts.append(peer[kind] + layer * peer["layer_stride"] + d * peer["page_stride"])
                    lens.append(n * page)
        return srcs, dsts, lens

    def write(self, peer: dict, src: list[int], dst: list[int]) -> int:
        """Blocking: write src pages into the peer's dst pages. Returns bytes written."""
        s, d, n = self.segments(peer, src, dst)
        rc = self.te.batch_transfer_sync_write(peer["session"], s, d, n)
        if rc != 0:
            raise RuntimeError(f"Mooncake batch write to {peer['session']} failed ({rc})")
        return sum(n)
