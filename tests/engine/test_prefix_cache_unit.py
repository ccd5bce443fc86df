"""In-process tests of the prefix cache and the pool's shared pages (no subprocesses)."""

from __future__ import annotations

import pytest

from pdgate.engine.kv import KVPool, OutOfPages
from pdgate.engine.prefix_cache import PrefixCache, external_hash, page_digest

pytestmark = pytest.mark.timeout(30)
PS = 4


def make(num_pages: int = 8):
    events: list[dict] = []
    cache = PrefixCache(PS, events.append)
    return KVPool(num_pages, PS, 1, 1, 2, cache), cache, events


def compute(pool: KVPool, cache: PrefixCache, tokens: list[int], owner) -> tuple[list[int], list[bytes]]:
    """What a request that computed all of `tokens` leaves behind: held pages, filled cache."""
    pages = pool.reserve(pool.pages_for(len(tokens)))
    pool.commit(pages)
    digests: list[bytes] = []
    cache.fill(tokens, pages, digests, len(tokens))
    return pages, digests


def idle(pool: KVPool) -> bool:
    c = pool.counters()
    return c["reserved"] == c["in_use"] == c["pinned"] == 0 and c["free"] + c["cached"] == c["total"]


def test_hash_chain_names_the_whole_prefix():
    a, b = page_digest(None, [1, 2, 3, 4]), page_digest(None, [9, 2, 3, 4])
    assert page_digest(a, [5, 6, 7, 8]) != page_digest(b, [5, 6, 7, 8])  # same page, other prefix
    assert page_digest(a, [5, 6, 7, 8]) == page_digest(a, [5, 6, 7, 8])
    h = external_hash(a)
    assert 0 <= h < 1 << 64 and h == int.from_bytes(a[-8:], "big")


def test_full_pages_are_cached_and_reused_up_to_the_last_prompt_token():
    pool, cache, events = make()
    toks = list(range(10))  # two full pages and a partial one
    pages, _ = compute(pool, cache, toks, "a")
    assert [e["type"] for e in events] == ["BlockStored"]
    ev = events[0]
    assert ev["token_ids"] == toks[:8] and ev["block_size"] == PS and ev["parent_block_hash"] is None
    assert ev["block_hashes"] == [external_hash(page_digest(None, toks[:4])),
                                  external_hash(page_digest(page_digest(None, toks[:4]), toks[4:8]))]
    pool.free(pages, "a")
    assert pool.counters()["cached"] == 2 and pool.counters()["free"] == 6 and idle(pool)
    # a prompt of exactly 8 tokens may reuse only the first page: its last token is computed
    hit, _ = cache.match(toks[:8], 7)
    assert hit == pages[:1]
    hit, digests = cache.match(toks + [99], 10)
    assert hit == pages[:2] and len(digests) == 2
    pool.share(hit)
    assert pool.counters()["in_use"] == 2 and cache.evictable == 0
    # a prompt that differs in the first page matches nothing
    assert cache.match([7] + toks[1:], 9)[0] == []


def test_lru_eviction_under_pressure_spares_held_pages_and_is_reported():
    pool, cache, events = make(8)
    a, _ = compute(pool, cache, list(range(8)), "a")          # pages 0, 1
    b, _ = compute(pool, cache, list(range(100, 108)), "b")   # pages 2, 3
    pool.free(a, "a")
    pool.free(b, "b")
    hit, _ = cache.match(list(range(100, 109)), 8)
    pool.share(hit)                                           # b's pages held again
    events.clear()
    got = pool.reserve(6)                                     # 4 free + a's 2 cached pages
    assert sorted(got) == [0, 1, 4, 5, 6, 7]
    assert [e["type"] for e in events] == ["BlockRemoved", "BlockRemoved"]
    # tail first: a's second page goes before its first
    assert events[0]["block_hashes"] == [external_hash(page_digest(page_digest(None, range(4)), range(4, 8)))]
    with pytest.raises(OutOfPages):
        pool.reserve(1)                                       # b's pages are held: never evicted
    pool.free(got, "c")
    pool.free(hit, "d")
    assert idle(pool) and pool.counters()["cached"] == 2


def test_a_page_pinned_by_a_transfer_is_never_evicted_nor_handed_out():
    pool, cache, _ = make(4)
    prefix = list(range(8))
    a, _ = compute(pool, cache, prefix + [50], "a")           # pages 0, 1 cached, 2 private
    pool.pin(a, "a")                                          # a's transfer reads all three
    hit, _ = cache.match(prefix + [60], 8)
    pool.share(hit)                                           # b shares the pinned prefix
    assert pool.counters()["pinned"] == 3
    pool.free(hit, "b")                                       # b lets go: a's pins remain
    assert pool.counters()["pinned"] == 3
    with pytest.raises(OutOfPages):
        pool.reserve(2)
    assert pool.reserve(1) == [3]
    pool.free(a, "a")                                         # transfer drained, a lets go
    assert pool.counters()["cached"] == 2 and pool.counters()["pinned"] == 0


def test_sink_pins_are_per_owner_and_unpin_makes_kv_readable():
    pool, _, _ = make(4)
    dst = pool.reserve(2)
    pool.pin(dst, "sink")
    with pytest.raises(RuntimeError):
        pool.unpin(dst, "someone else")
    pool.unpin(dst, "sink")
    assert pool.counters()["in_use"] == 2
    pool.free(dst, "sink")
    with pytest.raises(RuntimeError):
        pool.free(dst, "sink")                                # double free is a bug, never silent
    assert pool.counters()["free"] == 4  # not cached: never filled


def test_a_prefix_computed_twice_is_cached_once():
    pool, cache, events = make(8)
    a, _ = compute(pool, cache, list(range(8)), "a")
    b, _ = compute(pool, cache, list(range(8)), "b")          # computed at the same time as a
    assert len(events) == 1
    pool.free(b, "b")
    assert pool.counters()["free"] == 6 and pool.counters()["cached"] == 0  # b's copy is not kept
    pool.free(a, "a")
    assert pool.counters()["cached"] == 2


def test_extension_reports_its_parent_and_clear_empties_everything():
    pool, cache, events = make(8)
    first, digests = compute(pool, cache, list(range(4)), "a")
    # the same request grows by a page (decoded tokens): the new page names its parent
    more = pool.reserve(1)
    pool.commit(more)
    cache.fill(list(range(8)), first + more, digests, 8)
    assert events[-1]["parent_block_hash"] == external_hash(digests[0])
    assert events[-1]["token_ids"] == [4, 5, 6, 7]
    pool.free(first + more, "a")
    pool.forget(cache.clear())
    assert events[-1] == {"type": "AllBlocksCleared"}
    assert pool.counters()["free"] == 8 and cache.match(list(range(9)), 8)[0] == []
