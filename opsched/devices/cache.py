"""The executor cache, as the device runtime keeps one: repeatable executors, LRU.

Keys are built by the scheduler from the operator, every bound tensor's shape, dtype and
strides, the scalar arguments, the device and the stream; data addresses are not part of a
key, so a hit skips planning for new arrays. A cached executor keeps its plan (and a fused
launch's layout), never arrays: the launch binds its own, so the cache holds no caller's
array nor a pool block's memory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import attrs

from opsched._log import INFO, enabled, get_logger
from opsched.ops.executor import Executor

__all__ = ["CacheStatistics", "ExecutorCache"]

_log = get_logger("opsched.cache")


@attrs.frozen
class CacheStatistics:
    """Executor cache counters.

    Attributes:
        hits: lookups that found an executor.
        misses: lookups that had to plan a new one.
        evictions: executors dropped (and destroyed) because the cache was full.
        size: executors held now.
        limit: the most it holds (``executor_cache_limit``).
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


@attrs.define(eq=False)
class ExecutorCache:
    """Repeatable executors by key, least recently used evicted beyond ``limit``."""

    limit: int
    _entries: OrderedDict[Hashable, Executor] = attrs.field(factory=OrderedDict, init=False)
    _hits: int = attrs.field(default=0, init=False)
    _misses: int = attrs.field(default=0, init=False)
    _evictions: int = attrs.field(default=0, init=False)

    def get(self, key: Hashable) -> Executor | None:
        """The executor for ``key``, marked most recently used, or None (a miss)."""
        executor = self._entries.get(key)
        if executor is None:
            self._misses += 1
            return None
        self._hits += 1
        self._entries.move_to_end(key)
        return executor

    def put(self, key: Hashable, executor: Executor) -> None:
        """Keep a repeatable ``executor`` under ``key``, evicting the oldest when full."""
        self._entries[key] = executor
        while len(self._entries) > self.limit:
            _, old = self._entries.popitem(last=False)
            old.destroy()
            self._evictions += 1
            if enabled(INFO):
                _log.info("executor evicted", op=old.op.name, cache_size=len(self._entries))

    def clear(self) -> None:
        """Destroy and drop every executor."""
        for executor in self._entries.values():
            executor.destroy()
        self._entries.clear()

    def statistics(self) -> CacheStatistics:
        """A frozen snapshot of the counters."""
        return CacheStatistics(
            self._hits, self._misses, self._evictions, len(self._entries), self.limit
        )
