"""The workspace pool: a caching allocator in the style of PyTorch's.

Sizes are rounded up to size classes (four per power of two), so recurring launches reuse
blocks; a request may also take a free block of up to twice its class. A free block belongs
to the stream that last used it and is reused there without synchronisation; it moves to
another stream only once the event of its last launch has completed. ``limit`` caps the
bytes the pool holds (in use plus cached): at the cap it first frees cached blocks, and if
that is not enough :meth:`WorkspacePool.allocate` returns None and the caller waits for
blocks to come back. It never exceeds the cap and never fails.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from opsched._log import INFO, enabled, get_logger

__all__ = ["Block", "PoolStatistics", "WorkspacePool", "size_class"]

_log = get_logger("opsched.pool")

MIN_BLOCK = 512


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to its size class: 512 B, then four steps per power of two."""
    if nbytes <= MIN_BLOCK:
        return MIN_BLOCK
    top = 1 << (nbytes - 1).bit_length()  # the next power of two
    step = top // 8  # classes at 5/8, 6/8, 7/8 and 8/8 of it
    return -(-nbytes // step) * step


@attrs.define(eq=False)
class Block:
    """One workspace allocation, owned by a stream while free."""

    nbytes: int
    array: np.ndarray
    stream: int
    #: Completes when the last launch that used the block has finished (None: nothing ran).
    last_event: Any = None
    #: Views the scheduler carved this block into, by layout (reused while the block lives).
    views: dict[Any, Any] = attrs.field(factory=dict)
    #: False for an overflow block: outside the cap, dropped (not cached) on release.
    pooled: bool = True


@attrs.frozen
class PoolStatistics:
    """A snapshot of a pool's counters (bytes unless noted).

    Attributes:
        current: bytes the pool holds now, in use or cached (torch's "reserved").
        peak: the most ``current`` has been since creation or :meth:`reset_peak_stats`.
        in_use: bytes handed out to launches and not yet returned.
        allocated: bytes ever allocated from the system.
        freed: bytes ever released back to the system.
        hits: allocations served from a cached block.
        misses: allocations that needed a new block.
        cached_blocks: free blocks held for reuse.
        limit: the cap on ``current``.
        overflows: blocks handed out beyond the cap as a last resort (see
            :meth:`WorkspacePool.allocate`).
    """

    current: int
    peak: int
    in_use: int
    allocated: int
    freed: int
    hits: int
    misses: int
    cached_blocks: int
    limit: int
    overflows: int


@attrs.define(eq=False)
class WorkspacePool:
    """A per-device caching allocator of workspace blocks (see module doc)."""

    limit: int
    _free: dict[int, dict[int, list[Block]]] = attrs.field(factory=dict, init=False)
    _current: int = attrs.field(default=0, init=False)
    _peak: int = attrs.field(default=0, init=False)
    _in_use: int = attrs.field(default=0, init=False)
    _allocated: int = attrs.field(default=0, init=False)
    _freed: int = attrs.field(default=0, init=False)
    _hits: int = attrs.field(default=0, init=False)
    _misses: int = attrs.field(default=0, init=False)
    _cached: int = attrs.field(default=0, init=False)
    _overflows: int = attrs.field(default=0, init=False)

    def allocate(self, nbytes: int, stream: int, *, overflow: bool = False) -> Block | None:
        """Return a block of at least ``nbytes`` for ``stream``, or None at the cap.

        With ``overflow``, a request that does not fit gets a block outside the cap instead
        of None: the caller's last resort when nothing in flight will ever return memory.
        Such a block is dropped, not cached, when released.
        """
        cls = size_class(nbytes)
        block = self._take_cached(cls, stream)
        if block is not None:
            self._hits += 1
        else:
            if self._current + cls > self.limit and not self._evict(cls):
                if not overflow:
                    return None
                self._overflows += 1
                self._in_use += cls
                return Block(cls, np.empty(cls, np.uint8), stream, pooled=False)
            self._misses += 1
            block = Block(cls, np.empty(cls, np.uint8), stream)
            self._current += cls
            self._allocated += cls
            self._peak = max(self._peak, self._current)
            if enabled(INFO):
                _log.info("workspace pool grew", block_bytes=cls, pool_bytes=self._current)
        self._in_use += block.nbytes  # a reused block may be larger than the class asked for
        return block

    def release(self, block: Block, event: Any = None) -> None:
        """Return ``block``; ``event`` completes when its last launch finishes."""
        block.last_event = event
        self._in_use -= block.nbytes
        if not block.pooled:
            return  # an overflow block: never held by the pool
        self._free.setdefault(block.stream, {}).setdefault(block.nbytes, []).append(block)
        self._cached += 1

    @property
    def current(self) -> int:
        """Bytes the pool holds now (in use or cached)."""
        return self._current

    @property
    def in_use(self) -> int:
        """Bytes handed out to launches and not yet returned."""
        return self._in_use

    def fits(self, nbytes: int) -> bool:
        """Whether one request of ``nbytes`` can ever be served under the cap."""
        return size_class(nbytes) <= self.limit

    def empty_cache(self) -> None:
        """Release every cached block whose last launch has finished (torch's name)."""
        for by_size in self._free.values():
            for blocks in by_size.values():
                keep = [b for b in blocks if not _done(b)]
                for b in blocks:
                    if _done(b):
                        self._drop(b)
                blocks[:] = keep

    def reset_peak_stats(self) -> None:
        """Restart ``peak`` from ``current`` (torch's name)."""
        self._peak = self._current

    def statistics(self) -> PoolStatistics:
        """A frozen snapshot of the counters."""
        return PoolStatistics(
            current=self._current,
            peak=self._peak,
            in_use=self._in_use,
            allocated=self._allocated,
            freed=self._freed,
            hits=self._hits,
            misses=self._misses,
            cached_blocks=self._cached,
            limit=self.limit,
            overflows=self._overflows,
        )

    def memory_stats(self) -> dict[str, int]:
        """The counters as a dict with torch-style keys (see :class:`PoolStatistics`)."""
        return attrs.asdict(self.statistics())

    def _take_cached(self, cls: int, stream: int) -> Block | None:
        mine = self._free.get(stream, {})
        own = mine.get(cls)
        if own:
            self._cached -= 1
            return own.pop()
        # No free block of the exact class on this stream: take the smallest larger one up
        # to twice the size (as torch's allocator does), before trying other streams.
        larger = [size for size, blocks in mine.items() if blocks and cls < size <= 2 * cls]
        if larger:
            self._cached -= 1
            return mine[min(larger)].pop()
        for other, by_size in self._free.items():
            blocks = by_size.get(cls)
            if other == stream or not blocks:
                continue
            for i, b in enumerate(blocks):
                if _done(b):  # its last launch finished: safe to move to another stream
                    del blocks[i]
                    self._cached -= 1
                    b.stream = stream
                    return b
        return None

    def _evict(self, need: int) -> bool:
        """Free cached, finished blocks until ``need`` more bytes fit; report success."""
        for by_size in self._free.values():
            for blocks in by_size.values():
                while blocks and self._current + need > self.limit:
                    i = next((i for i, b in enumerate(blocks) if _done(b)), None)
                    if i is None:
                        break
                    self._drop(blocks.pop(i))
        return self._current + need <= self.limit

    def _drop(self, block: Block) -> None:
        self._current -= block.nbytes
        self._freed += block.nbytes
        self._cached -= 1


def _done(block: Block) -> bool:
    return block.last_event is None or block.last_event.query()
