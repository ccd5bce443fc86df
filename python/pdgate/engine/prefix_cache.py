"""The prefix cache: full KV pages shared between requests with the same token prefix.

A full page is named by a hash chain, as vLLM names its blocks: the digest of a page is
sha256(parent page's digest + the page's token ids), the first page's parent being a fixed
root, so a digest stands for the whole prefix up to the end of its page. The cache maps
digests to pages. A request reuses the longest chain of cached pages of its prompt, up to the
last full page before its last prompt token (that token is always computed, so the request has
logits to sample from and never writes into a shared page). Pages are registered as they fill
(prompt or generated tokens), when their KV is computed.

Who holds a page is the pool's business (`kv.KVPool`: reference counts and pins); the cache
keeps the pages nobody holds in least-recently-used order and gives up the oldest when the pool
needs room. Each registration and eviction is reported to `on_event` as a vLLM KV event
(`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, see `kv_events.py`); block hashes on the
wire are the digests' low 64 bits as unsigned integers, as vLLM sends them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Callable

import numpy as np

ROOT = hashlib.sha256(b"pdgate prefix cache root").digest()
# vLLM's name for the tier of the engine's own KV cache (its other media are offload tiers).
MEDIUM = "GPU"


def page_digest(parent: bytes | None, tokens) -> bytes:
    return hashlib.sha256((parent or ROOT) + np.asarray(tokens, dtype="<u4").tobytes()).digest()


def external_hash(digest: bytes) -> int:
    """The 64-bit block hash KV events carry (vLLM: the digest's low 8 bytes, unsigned)."""
    return int.from_bytes(digest, "big") & ((1 << 64) - 1)


class PrefixCache:
    def __init__(self, page_size: int, on_event: Callable[[dict], None] | None = None):
        self.page_size = page_size
        self.on_event = on_event
        self._page_of: dict[bytes, int] = {}
        self._digest_of: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unheld cached pages, oldest first
        self.query_tokens = 0
        self.hit_tokens = 0
        self.evicted = 0

    # ---- what the pool asks ------------------------------------------------------------
    @property
    def evictable(self) -> int:
        return len(self._lru)

    def holds(self, page: int) -> bool:
        return page in self._digest_of

    def link(self, page: int) -> None:
        """Nobody holds `page` any more: it is now the most recently used evictable page."""
        self._lru[page] = None
        self._lru.move_to_end(page)

    def unlink(self, page: int) -> None:
        self._lru.pop(page, None)

    def evict(self) -> int:
        page, _ = self._lru.popitem(last=False)
        digest = self._digest_of.pop(page)
        del self._page_of[digest]
        self.evicted += 1
        self._emit({"type": "BlockRemoved", "block_hashes": [external_hash(digest)], "medium": MEDIUM})
        return page

    # ---- what requests ask -------------------------------------------------------------
    def match(self, tokens: list[int], max_tokens: int) -> tuple[list[int], list[bytes]]:
        """The cached pages of the longest cached prefix of `tokens` within `max_tokens`, and
        their digests. The caller must hold the pages (`KVPool.share`) before anything else
        can evict them."""
        ps, pages, digests, parent = self.page_size, [], [], None
        for i in range(max(0, max_tokens) // ps):
            d = page_digest(parent, tokens[i * ps:(i + 1) * ps])
            p = self._page_of.get(d)
            if p is None:
                break
            pages.append(p)
            digests.append(d)
            parent = d
        self.query_tokens += len(tokens)
        self.hit_tokens += len(pages) * ps
        return pages, digests

    def fill(self, tokens: list[int], pages: list[int], digests: list[bytes], computed: int) -> None:
        """Register the pages that became full with computed KV (`computed` tokens of `tokens`
        are in `pages`). `digests` holds the digests of the pages already seen, and grows.

        A page whose prefix is already cached in another page (two requests computed it at
        once) stays private to its request and is freed with it."""
        ps, run = self.page_size, []
        full = min(computed // ps, len(pages))
        for i in range(len(digests), full):
            parent = digests[-1] if digests else None
            toks = tokens[i * ps:(i + 1) * ps]
            d = page_digest(parent, toks)
            digests.append(d)
            if d in self._page_of or pages[i] in self._digest_of:
                self._stored(run)
                run = []
                continue
            self._page_of[d], self._digest_of[pages[i]] = pages[i], d
            run.append((parent, d, toks))
        self._stored(run)

    def clear(self) -> list[int]:
        """Forget every page (a flush); returns them. Held pages stay with their holders and
        are freed, not cached, when they let go."""
        pages = list(self._digest_of)
        self._page_of.clear()
        self._digest_of.clear()
        self._lru.clear()
        self._emit({"type": "AllBlocksCleared"})
        return pages

    def stats(self) -> dict:
        return {"enabled": True, "cached_pages": len(self._digest_of), "evictable_pages": len(self._lru),
                "query_tokens": self.query_tokens, "hit_tokens": self.hit_tokens, "evicted_pages": self.evicted}

    # ---- events ------------------------------------------------------------------------
    def _stored(self, run: list[tuple[bytes | None, bytes, list[int]]]) -> None:
        if not run:
            return
        parent = run[0][0]
        self._emit({"type": "BlockStored", "block_hashes": [external_hash(d) for _, d, _ in run],
                    "parent_block_hash": None if parent is None else external_hash(parent),
                    "token_ids": [t for _, _, toks in run for t in toks],
                    "block_size": self.page_size, "lora_id": None, "medium": MEDIUM, "lora_name": None})

    def _emit(self, event: dict) -> None:
        if self.on_event is not None:
            self.on_event(event)
