"""The paged KV pool: fixed-size pages, an allocator with exact per-page states.

Every page is in exactly one state, so the counters (free, reserved, in use, pinned, cached)
always sum to the pool size and a leak is visible in `/v1/loads`:
- FREE: available.
- RESERVED: held by a request, no KV written yet (a decode's destination, or room to grow).
- IN_USE: holds committed KV that attention may read.
- PINNED: the transport may be reading or writing it; it is freed only after the transport
  has drained, never while bytes may still land in it.
- CACHED: holds KV of a full page that the prefix cache (`prefix_cache.py`) knows, and no
  request holds it: reusable by a request with the same prefix, evictable (LRU) when a
  reservation needs room.

With the prefix cache a page may be held by several requests at once (a shared prefix), so the
state is derived from three per-page facts: how many requests hold it (`refs`), how many
transfers pin it (`pins`, each recorded against the request that pinned it) and whether KV was
written. A page with a holder or a pin is never evicted and never handed out again; a cached
page is full and never written again (a request that reuses it computes only later positions).
"""

from __future__ import annotations

import heapq
from collections import Counter

import numpy as np

FREE, RESERVED, IN_USE, PINNED, CACHED = 0, 1, 2, 3, 4
_STATE_NAMES = ("free", "reserved", "in_use", "pinned", "cached")


class OutOfPages(Exception):
    """The pool cannot satisfy a reservation right now."""


class KVPool:
    """The KV cache plus the allocator.

    Storage is page-major: one float32 array `kv` of shape
    [pages, 2 (K, V), layers, page_size, kv_heads, head_dim], so everything one page holds is
    contiguous and a run of consecutive pages is one contiguous region (one segment for a
    transfer library). `k` and `v` are views of it indexed [layer, page, slot, kv_head, dim],
    which is all attention needs to know.

    `cache` is the prefix cache (or None): the pool asks it which unheld pages it keeps and
    which to evict when the free list runs short.
    """

    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, cache=None):
        self.kv = np.zeros((num_pages, 2, num_layers, page_size, num_kv_heads, head_dim),
                           dtype=np.float32)
        self.k = self.kv[:, 0].swapaxes(0, 1)
        self.v = self.kv[:, 1].swapaxes(0, 1)
        self.page_size = page_size
        self.num_pages = num_pages
        self.cache = cache
        self.state = np.zeros(num_pages, dtype=np.int8)
        self.refs = np.zeros(num_pages, dtype=np.int32)
        self.pins = np.zeros(num_pages, dtype=np.int32)
        self.written = np.zeros(num_pages, dtype=bool)
        self._pinned_by: dict[int, Counter[int]] = {}  # id(owner) -> pages it pinned (with counts)
        self._free: list[int] = list(range(num_pages))  # a min-heap: lowest pages first
        self.counts = [num_pages, 0, 0, 0, 0]

    # ---- sizes -------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of K plus V of one page across all layers (the page stride of `kv`)."""
        return self.kv.strides[0]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def available(self) -> int:
        """Pages a reservation can get now: free ones plus cached ones nobody holds."""
        return len(self._free) + (self.cache.evictable if self.cache is not None else 0)

    # ---- allocator ---------------------------------------------------------------------
    def reserve(self, n: int) -> list[int]:
        """The n lowest free pages, ascending: a request's pages stay contiguous where the pool
        allows, so a transfer moves few, large regions. Evicts cached pages (least recently
        used first) when the free list is short."""
        if n > self.available:
            raise OutOfPages(f"need {n} pages, {self.available} available of {self.num_pages}")
        while len(self._free) < n:
            p = self.cache.evict()
            self._check(p, self.refs[p] == 0 and self.pins[p] == 0, "evict a held page")
            self._settle(p)
        pages = [heapq.heappop(self._free) for _ in range(n)]
        for p in pages:
            self.refs[p], self.written[p] = 1, False
            self._settle(p)
        return pages

    def share(self, pages: list[int]) -> None:
        """Hold pages the prefix cache matched (they are full and written); a cached page
        nobody held leaves the eviction order."""
        for p in pages:
            self._check(p, self.written[p] and self.cache is not None and self.cache.holds(p),
                        "share a page the cache does not hold")
            if self.refs[p] == 0:
                self.cache.unlink(p)
            self.refs[p] += 1
            self._settle(p)

    def commit(self, pages: list[int]) -> None:
        """KV is now written in these pages (RESERVED -> IN_USE)."""
        for p in pages:
            self._check(p, self.refs[p] > 0, "commit a page nobody holds")
            self.written[p] = True
            self._settle(p)

    def pin(self, pages: list[int], owner=None) -> None:
        """The transport may read or write these pages until `owner` unpins or frees them."""
        for p in pages:
            self._check(p, self.refs[p] > 0, "pin a page nobody holds")
        self._pinned_by.setdefault(id(owner), Counter()).update(pages)
        for p in pages:
            self.pins[p] += 1
            self._settle(p)

    def unpin(self, pages: list[int], owner=None) -> None:
        """A transfer has completed successfully: the pages hold KV that attention may read."""
        mine = self._pinned_by.get(id(owner), Counter())
        for p in pages:
            self._check(p, mine[p] > 0, "unpin a page this owner did not pin")
            mine[p] -= 1
            if not mine[p]:
                del mine[p]
            self.pins[p] -= 1
            self.written[p] = True
            self._settle(p)
        if not mine:
            self._pinned_by.pop(id(owner), None)

    def free(self, pages: list[int], owner=None) -> None:
        """`owner` lets go of its pages (and of the pins it still has on them, once its
        transfer has drained). A page nobody holds any more becomes CACHED if the prefix cache
        keeps it, else FREE."""
        for p in pages:
            self._check(p, self.refs[p] > 0, "free a page nobody holds (double free)")
        mine = self._pinned_by.pop(id(owner), Counter())
        for p, n in mine.items():
            self.pins[p] -= n
        for p in reversed(pages):  # tail first: the deepest pages of a prefix are evicted first
            self.refs[p] -= 1
            if self.refs[p] == 0 and self.cache is not None and self.cache.holds(p):
                self.cache.link(p)
            self._settle(p)
        for p in mine:
            self._settle(p)

    def forget(self, pages: list[int]) -> None:
        """The cache dropped these pages (a flush): unheld ones become FREE."""
        for p in pages:
            self._settle(p)

    def _settle(self, p: int) -> None:
        """Recompute page p's state from its facts and keep the counters exact."""
        if self.pins[p] > 0:
            to = PINNED
        elif self.refs[p] > 0:
            to = IN_USE if self.written[p] else RESERVED
        elif self.cache is not None and self.cache.holds(p):
            to = CACHED
        else:
            to = FREE
        frm = int(self.state[p])
        if to == frm:
            return
        if to == FREE:
            self.written[p] = False
            heapq.heappush(self._free, p)
        self.counts[frm] -= 1
        self.counts[to] += 1
        self.state[p] = to

    def _check(self, p: int, ok, what: str) -> None:
        if not ok:
            raise RuntimeError(f"page {p} ({_STATE_NAMES[int(self.state[p])]}): illegal: {what}")

    def counters(self) -> dict[str, int]:
        out = dict(zip(_STATE_NAMES, self.counts))
        out["total"] = self.num_pages
        out["page_size"] = self.page_size
        return out

    # ---- bytes in and out (the transport's view) -------------------------------------------
    def read_pages(self, pages: list[int]) -> memoryview:
        """The given pages in the pool's own layout ([page, K|V, layer, slot, kv_head, dim],
        float32). Consecutive pages are a view of the pool, not a copy: the caller keeps them
        pinned until the bytes are sent."""
        return memoryview(self.kv[_index(pages)]).cast("B")

    def write_pages(self, pages: list[int], payload: bytes | memoryview) -> None:
        shape = (len(pages),) + self.kv.shape[1:]
        if len(payload) != int(np.prod(shape)) * 4:
            raise ValueError(f"payload of {len(payload)} bytes does not fit {len(pages)} pages")
        self.kv[_index(pages)] = np.frombuffer(payload, dtype=np.float32).reshape(shape)


def _index(pages: list[int]) -> slice | np.ndarray:
    """Consecutive pages as a slice (a view of the pool, no copy), any others as an index array."""
    if pages and pages == list(range(pages[0], pages[0] + len(pages))):
        return slice(pages[0], pages[0] + len(pages))
    return np.asarray(pages, dtype=np.int64)
