"""What the optional data planes move: contiguous byte regions of the page-major KV pool.

Both sides register their whole pool (`KVPool.kv`, one array) with the library and describe it
as a base address plus a page stride. A transfer of source pages `src` into destination pages
`dst` becomes one region per run of pages consecutive on both sides; with the allocator handing
out the lowest free pages, a request is usually one run, so one region of all its layers, K and
V. (With the old layer-major layout the same request was 2 x layers regions, and a descending
page list made it one per page and layer: 2048 regions of 16 KiB for a 2048-token `small`
prompt, which the libraries move at a fraction of their large-write throughput.)
"""

from __future__ import annotations

from ..kv import KVPool

# Tells a peer how our pool is laid out in memory; a peer that says otherwise gets TCP frames.
POOL_LAYOUT = "page-major:[page,kv,layer,slot,kv_head,dim]"


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(first src page, first dst page, count) of runs consecutive on both sides.

    The pairs are taken in source order, so a page list in any order (say descending) still
    merges into the fewest runs; which page goes where is unchanged."""
    pairs = sorted(zip(src, dst))
    runs: list[tuple[int, int, int]] = []
    for s, d in pairs:
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def describe_pool(pool: KVPool) -> dict:
    return {"base": pool.kv.ctypes.data, "page_stride": pool.page_bytes, "pool_layout": POOL_LAYOUT}


def compatible(ours: dict, peer: dict | None) -> bool:
    """Whether the peer runs the same data plane over a pool laid out like ours."""
    return bool(peer) and all(peer.get(k) == ours[k]
                              for k in ("backend", "pool_layout", "page_stride"))


def regions(pool: KVPool, peer: dict, src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(local address, remote address, length) of each region to write."""
    base, stride, rbase = pool.kv.ctypes.data, pool.page_bytes, peer["base"]
    return [(base + s * stride, rbase + d * stride, n * stride) for s, d, n in page_runs(src, dst)]
