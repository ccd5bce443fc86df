"""The paged KV pool: fixed-size pages, an allocator with exact per-page states.

Every page is in exactly one state, so the counters (free, reserved, in use, pinned) always sum
to the pool size and a leak is visible in `/v1/loads`:
- FREE: available.
- RESERVED: owned by a request, no KV written yet (a decode's destination, or room to grow).
- IN_USE: holds committed KV that attention may read.
- PINNED: the transport may be reading or writing it; it is freed only after the transport
  has drained, never while bytes may still land in it.
"""

from __future__ import annotations

import heapq

import numpy as np

FREE, RESERVED, IN_USE, PINNED = 0, 1, 2, 3
_STATE_NAMES = ("free", "reserved", "in_use", "pinned")


class OutOfPages(Exception):
    """The pool cannot satisfy a reservation right now."""


class KVPool:
    """The KV cache plus the allocator.

    Storage is page-major: one float32 array `kv` of shape
    [pages, 2 (K, V), layers, page_size, kv_heads, head_dim], so everything one page holds is
    contiguous and a run of consecutive pages is one contiguous region (one segment for a
    transfer library). `k` and `v` are views of it indexed [layer, page, slot, kv_head, dim],
    which is all attention needs to know.
    """

    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int):
        self.kv = np.zeros((num_pages, 2, num_layers, page_size, num_kv_heads, head_dim),
                           dtype=np.float32)
        self.k = self.kv[:, 0].swapaxes(0, 1)
        self.v = self.kv[:, 1].swapaxes(0, 1)
        self.page_size = page_size
        self.num_pages = num_pages
        self.state = np.zeros(num_pages, dtype=np.int8)
        self._free: list[int] = list(range(num_pages))  # a min-heap: lowest pages first
        self.counts = [num_pages, 0, 0, 0]

    # ---- sizes -------------------------------------------------------------------------
    @property
    def page_bytes(self) -> int:
        """Bytes of K plus V of one page across all layers (the page stride of `kv`)."""
        return self.kv.strides[0]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- allocator ---------------------------------------------------------------------
    def reserve(self, n: int) -> list[int]:
        """The n lowest free pages, ascending: a request's pages stay contiguous where the pool
        allows, so a transfer moves few, large regions."""
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = [heapq.heappop(self._free) for _ in range(n)]
        self._move(pages, RESERVED, frm=(FREE,))
        return pages

    def commit(self, pages: list[int]) -> None:
        """RESERVED -> IN_USE (KV now written); IN_USE pages are left as they are."""
        self._move([p for p in pages if self.state[p] == RESERVED], IN_USE, frm=(RESERVED,))

    def pin(self, pages: list[int]) -> None:
        self._move(pages, PINNED, frm=(RESERVED, IN_USE))

    def unpin(self, pages: list[int]) -> None:
        """PINNED -> IN_USE, once a transfer has completed successfully."""
        self._move(pages, IN_USE, frm=(PINNED,))

    def free(self, pages: list[int]) -> None:
        self._move(pages, FREE, frm=(RESERVED, IN_USE, PINNED))
        for p in pages:
            heapq.heappush(self._free, p)

    def _move(self, pages: list[int], to: int, frm: tuple[int, ...]) -> None:
        for p in pages:
            s = int(self.state[p])
            if s not in frm:
                raise RuntimeError(f"page {p}: illegal move {_STATE_NAMES[s]} -> {_STATE_NAMES[to]}")
        for p in pages:
            self.counts[int(self.state[p])] -= 1
            self.state[p] = to
            self.counts[to] += 1

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
