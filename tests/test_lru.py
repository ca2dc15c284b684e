"""The one cache type: least recently used evicted first, counted, bounded."""

from __future__ import annotations

import pytest

from opsched._lru import LRU


def test_a_full_cache_evicts_the_least_recently_used_entry():
    dropped: list[str] = []
    cache: LRU[str, str] = LRU(2, on_evict=dropped.append)
    cache.put("a", "A")
    cache.put("b", "B")
    assert cache.lookup("a") == "A"  # a is now the most recent: b goes first
    cache.put("c", "C")
    assert dropped == ["B"] and list(cache) == ["a", "c"]
    assert cache.lookup("b") is None
    stats = cache.statistics()
    assert (stats.hits, stats.misses, stats.evictions, stats.size, stats.limit) == (1, 1, 1, 2, 2)
    assert stats.hit_rate == 0.5


def test_the_hot_path_reads_uncounted_and_leaves_the_order_as_it_was():
    # a request's hot path reads with the dict's own get: no count, no move (an entry in
    # use that reaches the front is evicted, and made again on its next miss)
    cache: LRU[str, int] = LRU(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1
    cache.put("c", 3)
    assert list(cache) == ["b", "c"]
    assert (cache.hits, cache.misses) == (0, 0)


def test_clear_drops_every_entry_through_on_evict_uncounted():
    dropped: list[int] = []
    cache: LRU[str, int] = LRU(4, on_evict=dropped.append)
    for i, key in enumerate("abc"):
        cache.put(key, i)
    cache.clear()
    assert dropped == [0, 1, 2] and len(cache) == 0 and cache.evictions == 0


def test_a_cache_holds_at_least_one_entry():
    with pytest.raises(ValueError, match="limit=0"):
        LRU(0)
