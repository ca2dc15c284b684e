"""The executor cache, as the device runtime keeps one: repeatable executors, LRU.

Keys are built by the host devices from the operator, every bound tensor's shape, dtype and
strides, the scalar arguments, the device and the stream; data addresses are not part of a
key, so a hit skips planning for new arrays. A cached executor keeps its plan (and a fused
launch's layout), never arrays: the launch binds its own, so the cache holds no caller's
array nor a pool block's memory. An :class:`~opsched._lru.LRU` (the one cache type): an
evicted executor is destroyed.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from opsched._log import INFO, enabled, get_logger
from opsched._lru import LRU, LRUStatistics

if TYPE_CHECKING:  # (the host devices' executors: a module that imports this one)
    from opsched.devices.host.executor import Executor

__all__ = ["CacheStatistics", "ExecutorCache"]

_log = get_logger("opsched.cache")

#: The executor cache's counters (:meth:`ExecutorCache.statistics`).
CacheStatistics = LRUStatistics


class ExecutorCache(LRU[Hashable, "Executor"]):
    """Repeatable executors by key, least recently used evicted (and destroyed) beyond
    ``limit``; :meth:`~opsched._lru.LRU.lookup` counts hits and misses."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit, on_evict=self._dropped)
        self._clearing = False

    def _dropped(self, executor: Executor) -> None:
        executor.destroy()
        if not self._clearing and enabled(INFO):
            _log.info("executor evicted", op=executor.op.name, cache_size=len(self))

    def clear(self) -> None:
        """Destroy and drop every executor."""
        self._clearing = True
        try:
            super().clear()
        finally:
            self._clearing = False
