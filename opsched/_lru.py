"""The one cache type: bounded, least recently used evicted first, counted.

Every cache opsched keeps of what a call signature (an operator's shapes, dtypes and
scalars) decided is an :class:`LRU`: a scheduler's checked calls, a host device's solo
plans and executors, the two-phase API's plans, the table of canonical signatures. One
eviction rule and one set of counters for all of them.

An :class:`LRU` is an ``OrderedDict``, oldest first. :meth:`LRU.lookup` finds an entry,
moves it to the back and counts the hit or miss. :meth:`LRU.put` adds an entry and evicts
the oldest beyond the limit. A request's hot path reads with the dict's own C method,
``found = cache.get(key)``, uncounted, and does not move what it finds: its caches fill only
on a miss (after the full work the entry saves), so an entry in use that reaches the front
is evicted and made again once per ``limit`` misses, where keeping its place would cost
every hit a second hash of its key and a move.

A host device's solo plans are read and filled by callers' threads: a race costs at most
an entry made twice or a miscounted counter, and never raises into the caller.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import TypeVar

import attrs

__all__ = ["LRU", "LRUStatistics"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@attrs.frozen
class LRUStatistics:
    """A cache's counters.

    Attributes:
        hits: lookups that found an entry.
        misses: lookups that found none.
        evictions: entries dropped, least recently used first, because the cache was full.
        size: entries held now.
        limit: the most it holds.
    """

    hits: int
    misses: int
    evictions: int
    size: int
    limit: int

    @property
    def hit_rate(self) -> float:
        """hits / (hits + misses), 0.0 before any lookup."""
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class LRU(OrderedDict[K, V]):
    """At most ``limit`` entries; ``on_evict`` is called with each value dropped (by
    eviction or :meth:`clear`)."""

    def __init__(self, limit: int, on_evict: Callable[[V], object] | None = None) -> None:
        super().__init__()
        if limit < 1:
            msg = f"an LRU cache holds at least one entry, got limit={limit}"
            raise ValueError(msg)
        self.limit = limit
        self.on_evict = on_evict
        self.hits = self.misses = self.evictions = 0

    def lookup(self, key: K) -> V | None:
        """The value for ``key``, now the most recently used; None on a miss. Counted."""
        value = self.get(key)
        if value is None:
            self.misses += 1
            return None
        self.hits += 1
        try:  # (as the hot paths do it: no Python call)  # noqa: SIM105
            self.move_to_end(key)
        except KeyError:  # evicted by another thread meanwhile: still a hit
            pass
        return value

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` under ``key``, evicting the least recently used when full."""
        self[key] = value
        while len(self) > self.limit:
            try:
                _, old = self.popitem(last=False)
            except KeyError:  # emptied by another thread meanwhile
                return
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(old)

    def clear(self) -> None:
        """Drop every entry (each through ``on_evict``; not counted as evictions)."""
        values = list(self.values())
        super().clear()
        if self.on_evict is not None:
            for value in values:
                self.on_evict(value)

    def statistics(self) -> LRUStatistics:
        """A snapshot of the counters."""
        return LRUStatistics(self.hits, self.misses, self.evictions, len(self), self.limit)
