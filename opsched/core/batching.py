"""Requests, the queue, and batch formation: a plain synchronous step, no event loop.

:func:`form_batches` takes the queue and the idle streams and returns the launches to start
now, changing queue state and nothing else. It is where the policy lives:

- the next batch serves the fusion key whose head request has the highest priority (FIFO
  among equals), so priorities hold across operators;
- a request larger than ``fuse_max_bytes`` launches alone, and one of at least
  ``split_min_bytes`` is split across the idle streams when its layout allows;
- otherwise queued requests of one key fuse, up to ``max_batch_requests`` and
  ``max_batch_bytes``, spread over the idle streams when each share would move at least
  :data:`MIN_SPREAD_BYTES`;
- with ``max_delay_us > 0`` a key whose oldest request is younger than the delay waits for
  company (unless its batch is already full, or one of its requests has a deadline before
  the wait would end: a deadline bounds how long a request is held);
- requests whose deadline has passed leave the queue as expired, never launched.

It knows requests only as records with a fusion key, units and bytes: no device, no
operator by name, no event loop.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
import math
import operator
import weakref
from collections.abc import Hashable
from typing import Any

import attrs

from opsched.core.config import SchedulerConfig
from opsched.core.requests import Request, RequestState

__all__ = ["MIN_SPREAD_BYTES", "SMALL_FUSED_BYTES", "Batch", "RequestQueue", "form_batches"]

#: A fused batch is spread over several idle streams only when each share moves at least
#: this many bytes: below it the per-launch Python work (which holds the GIL) outweighs the
#: parallel kernel time.
MIN_SPREAD_BYTES = 1 << 20

#: On a device that runs small launches inline, a fused batch of requests of at most this
#: many bytes each takes at most ``inline_max_bytes``, so that it runs inline. Its work is
#: mostly per-request gathering and handing back, which holds the GIL: on a stream thread
#: it only contends with the loop thread admitting the next requests. Larger requests keep
#: the full ``max_batch_bytes``: their kernels run without the GIL, on the streams in
#: parallel, where capping them would cost more than it saves.
SMALL_FUSED_BYTES = 64 << 10


@attrs.define(eq=False, slots=True)
class Batch:
    """One launch to start: requests (or one request's part) on one stream."""

    requests: list[Request]
    stream: int
    key: Hashable
    fused: bool
    #: For a split request: this part's tensors and scalars.
    part: tuple[dict[str, Any], dict[str, Any]] | None = None
    #: When it started (``time.monotonic()``; set by whoever starts it).
    launched_at: float = 0.0

    @property
    def units(self) -> int:
        """Units of fused capacity the batch needs."""
        return sum([r.units for r in self.requests])

    @property
    def nbytes(self) -> int:
        """Bytes the batch reads and writes."""
        if self.part is not None:
            tensors = self.part[0]
            return sum(t.nbytes for t in tensors.values())
        return sum([r.nbytes for r in self.requests])


@attrs.define(eq=False)
class RequestQueue:
    """Queued requests: per fusion key, one FIFO lane per priority, highest first.

    Within a key, requests go in order of (-priority, id), as a heap would give them; a
    lane is a deque in id order (requests are pushed in id order, except those put back
    after a launch could not start, which go to their place), so queueing and taking a
    request is an append and a ``popleft``, no heap entry made or sifted per request.

    Removal (cancel, expiry) is lazy: the request's state changes and the entry is
    skipped when reached. ``len()`` counts live requests.

    Which key goes next (:meth:`best_key`) comes from a heap of the keys' heads, so a queue
    of many shapes costs a heap step per launch, not a look at every key: each key stands
    on it by a lower bound of its head's ``(-priority, id)`` (a key's head only rises as
    requests leave; a push that lowers it lists the key again), raised to the true head
    when it reaches the top. Entries a later listing outdated are dropped at the top.

    Requests with a deadline are also on one heap by deadline (:meth:`expire_due`,
    :meth:`next_deadline`): the scheduler keeps one timer for all of them, at the earliest,
    instead of one per request. The heap refers to them weakly (it keeps no request, nor
    its arrays, alive once the request is done); entries of requests that left the queue
    are dropped when they reach the top, and all at once when they outnumber the queued.
    """

    #: Per key: its lanes by priority, in order of priority, highest first.
    _lanes: dict[Hashable, dict[int, collections.deque[Request]]] = attrs.field(factory=dict)
    _bytes: dict[Hashable, int] = attrs.field(factory=dict)
    #: Per key with deadlines: the earliest deadline of a request queued under it since the
    #: key appeared (never raised when that request leaves: an early bound is safe).
    _earliest: dict[Hashable, float] = attrs.field(factory=dict)
    #: Live requests (``len()``; read as an attribute on the hot path, never written outside).
    live: int = 0
    #: Entries still in lanes whose request left the queue in place (:meth:`discard`), not
    #: yet dropped: while there are none, :meth:`take` weighs a lane's front at once.
    _dead: int = 0
    peak: int = 0
    #: When a list, every popped request is also appended to it (the dispatcher's record of
    #: what a batch formation round took, to fail them if the round raises).
    taken: list[Request] | None = None
    #: ``(deadline, id, weak reference to the request)`` of requests queued with a
    #: deadline: a heap.
    _deadlines: list[tuple[float, int, weakref.ref[Request]]] = attrs.field(factory=list)
    #: ``(-priority, id, key)`` per key (see the class's docstring): a heap.
    _heads: list[tuple[int, int, Hashable]] = attrs.field(factory=list)
    #: Per key: the ``(-priority, id)`` it stands on the heads' heap by.
    _listed: dict[Hashable, tuple[int, int]] = attrs.field(factory=dict)

    def __len__(self) -> int:
        return self.live

    def push(self, request: Request) -> None:
        """Queue ``request``."""
        key = request.key
        lanes = self._lanes.get(key)
        if lanes is None:
            lanes = self._lanes[key] = {}
        lane = lanes.get(request.priority)
        if lane and lane[-1].id < request.id:
            # the common case: the newest request behind others of its key and priority,
            # which stand on the heads' heap before it (its key's head is unchanged)
            lane.append(request)
        else:
            if lane is None:
                lane = _new_lane(lanes, request.priority)
            if not lane:
                lane.append(request)
            else:  # put back after its launch could not start: to its place by id
                lane.insert(bisect.bisect(lane, request.id, key=_request_id), request)
            listed = self._listed.get(key)
            entry = (-request.priority, request.id)
            if listed is None or entry < listed:  # a new key, or a head that came before
                self._list(key, entry)
        self._bytes[key] = self._bytes.get(key, 0) + request.nbytes
        self.live += 1
        if self.live > self.peak:
            self.peak = self.live
        if request.deadline is not None:
            earliest = self._earliest.get(key)
            if earliest is None or request.deadline < earliest:
                self._earliest[key] = request.deadline
            deadlines = self._deadlines
            heapq.heappush(deadlines, (request.deadline, request.id, weakref.ref(request)))
            if len(deadlines) > 2 * self.live + 64:  # mostly requests gone: keep the rest
                self._deadlines = [e for e in deadlines if _queued(e[2]())]
                heapq.heapify(self._deadlines)

    def push_all(self, requests: list[Request]) -> None:
        """Queue new ``requests`` (made in this order, so in order of id), as :meth:`push`
        each. Those after the first that share its key and priority and have no deadline
        (a launch's graph consumers, the usual case) join its lane behind it at once."""
        first = requests[0]
        self.push(first)
        rest = requests[1:]
        if not rest:
            return
        key, priority = first.key, first.priority
        lane = self._lanes[key][priority]
        if lane[-1] is first and all(
            [r.key == key and r.priority == priority and r.deadline is None for r in rest]
        ):  # behind ``first``, in order of id: its key's head is unchanged
            lane.extend(rest)
            self._bytes[key] += sum([r.nbytes for r in rest])
            self.live += len(rest)
            if self.live > self.peak:
                self.peak = self.live
        else:
            for request in rest:
                self.push(request)

    def _list(self, key: Hashable, entry: tuple[int, int]) -> None:
        self._listed[key] = entry
        heads = self._heads
        heapq.heappush(heads, (*entry, key))
        if len(heads) > 2 * len(self._listed) + 64:  # mostly outdated entries: keep the rest
            self._heads = [(*e, k) for k, e in self._listed.items()]
            heapq.heapify(self._heads)

    def expire_due(self, now: float) -> list[Request]:
        """Take every queued request whose deadline is at or before ``now`` out of the
        queue, left EXPIRED, and return them (in order of deadline)."""
        deadlines, expired = self._deadlines, []
        while deadlines and deadlines[0][0] <= now:
            request = heapq.heappop(deadlines)[2]()
            if request is not None and request.state is RequestState.QUEUED:
                self.discard(request, RequestState.EXPIRED)
                expired.append(request)
        return expired

    def next_deadline(self) -> float | None:
        """The earliest deadline of a queued request, or None."""
        deadlines = self._deadlines
        while deadlines and not _queued(deadlines[0][2]()):
            heapq.heappop(deadlines)
        return deadlines[0][0] if deadlines else None

    def discard(self, request: Request, state: RequestState) -> None:
        """Take a queued ``request`` out (lazily), leaving it in ``state``."""
        request.state = state
        self._bytes[request.key] -= request.nbytes
        self.live -= 1
        self._dead += 1

    def head(self, key: Hashable) -> Request | None:
        """The next live request of ``key``, dropping dead entries on the way."""
        lanes = self._lanes.get(key)
        if lanes is None:
            return None
        for priority, lane in list(lanes.items()):
            while lane:
                request = lane[0]
                if request.state is RequestState.QUEUED:
                    return request
                lane.popleft()
                self._dead -= 1
            del lanes[priority]
        self._forget(key)
        return None

    def pop(self, key: Hashable) -> Request:
        """Remove and return the head of ``key`` (call :meth:`head` first)."""
        lanes = self._lanes[key]
        priority, lane = next(iter(lanes.items()))
        request = lane.popleft()
        self._bytes[key] -= request.nbytes
        if not lane:
            del lanes[priority]
            if not lanes:
                self._forget(key)
        self.live -= 1
        if self.taken is not None:
            self.taken.append(request)
        return request

    def take(
        self, key: Hashable, limit: int, fuse_max_bytes: int, max_batch_bytes: int, now: float
    ) -> tuple[list[Request], list[Request]]:
        """Pop up to ``limit`` fusible requests of ``key`` in order, while each is at most
        ``fuse_max_bytes`` and together at most ``max_batch_bytes`` (the first always
        goes). Returns ``(taken, expired)``: requests whose deadline passed are popped
        too, left EXPIRED, not taken. One loop over the lanes, no method call per request.
        """
        taken: list[Request] = []
        expired: list[Request] = []
        lanes = self._lanes.get(key)
        if lanes is None:
            return taken, expired
        record = self.taken
        if len(lanes) == 1 and not self._dead and key not in self._earliest:
            # One lane, every entry live, no deadline: the loop below would take its
            # longest run of at most ``limit`` requests within the bytes (the first always
            # goes), unless it met one too large to fuse. Weigh them in C and take them so.
            (lane,) = lanes.values()
            head = list(itertools.islice(lane, limit))
            sizes = list(map(_nbytes, head))
            if sizes and max(sizes) <= fuse_max_bytes:  # (the loop answers a limit of 0)
                ends = list(itertools.accumulate(sizes))
                count = max(1, bisect.bisect_right(ends, max_batch_bytes))
                if count == len(lane):
                    taken = head
                    self._forget(key)
                else:
                    taken = head[:count]
                    popleft = lane.popleft
                    for _ in range(count):
                        popleft()
                    self._bytes[key] -= ends[count - 1]
                if record is not None:
                    record.extend(taken)
                self.live -= count
                return taken, expired
        queued = RequestState.QUEUED
        nbytes = popped = gone = 0  # bytes taken; requests and bytes out of the queue
        for priority, lane in list(lanes.items()):
            while lane and len(taken) < limit:
                request = lane[0]
                if request.state is not queued:  # cancelled or expired in place: drop it
                    lane.popleft()
                    self._dead -= 1
                    continue
                size = request.nbytes
                if size > fuse_max_bytes or (taken and nbytes + size > max_batch_bytes):
                    break
                lane.popleft()
                popped += 1
                gone += size
                if record is not None:
                    record.append(request)
                deadline = request.deadline
                if deadline is not None and deadline <= now:
                    request.state = RequestState.EXPIRED
                    expired.append(request)
                    continue
                taken.append(request)
                nbytes += size
            if lane:
                break  # the batch is full (or the next one does not fit): the rest waits
            del lanes[priority]
        self._bytes[key] -= gone
        self.live -= popped
        if not lanes:
            self._forget(key)
        return taken, expired

    def _forget(self, key: Hashable) -> None:
        """Drop ``key``, whose lanes are all empty."""
        del self._lanes[key]
        self._bytes.pop(key, None)
        self._earliest.pop(key, None)
        self._listed.pop(key, None)

    def earliest_deadline(self, key: Hashable) -> float | None:
        """No later than the earliest deadline of a live request of ``key`` (None: none of
        them has one)."""
        return self._earliest.get(key)

    def queued_bytes(self, key: Hashable) -> int:
        """Bytes of the live requests of ``key``."""
        return self._bytes.get(key, 0)

    def count(self, key: Hashable) -> int:
        """Entries of ``key`` (an upper bound on its live requests)."""
        return sum(len(lane) for lane in self._lanes.get(key, {}).values())

    def best_key(self) -> Hashable | None:
        """The key whose head request goes next: highest priority, then oldest."""
        heads, listed = self._heads, self._listed
        while heads:
            priority, rid, key = heads[0]
            if listed.get(key) != (priority, rid):  # outdated, or the key left
                heapq.heappop(heads)
                continue
            head = self.head(key)
            if head is None:  # (head() forgot the key)
                heapq.heappop(heads)
                continue
            entry = (-head.priority, head.id)
            if entry == (priority, rid):
                return key  # every other key's head is at or above its own entry
            listed[key] = entry  # its head moved on: stand in line by the new one
            heapq.heapreplace(heads, (*entry, key))
        return None

    def keys(self) -> list[Hashable]:
        """Keys with entries, in no particular order."""
        return list(self._lanes)

    def drain(self) -> list[Request]:
        """Remove and return every live request."""
        out = [r for lanes in self._lanes.values() for lane in lanes.values() for r in lane]
        self._lanes.clear()
        self._bytes.clear()
        self._earliest.clear()
        self._deadlines.clear()
        self._heads.clear()
        self._listed.clear()
        self.live = self._dead = 0
        return [r for r in out if r.state is RequestState.QUEUED]


def _new_lane(
    lanes: dict[int, collections.deque[Request]], priority: int
) -> collections.deque[Request]:
    """Add the lane of ``priority`` to a key's ``lanes``, keeping them highest first."""
    lane: collections.deque[Request] = collections.deque()
    lanes[priority] = lane
    if len(lanes) > 1:
        ordered = sorted(lanes.items(), key=lambda item: -item[0])
        lanes.clear()
        lanes.update(ordered)
    return lane


def _queued(request: Request | None) -> bool:
    return request is not None and request.state is RequestState.QUEUED


def _request_id(request: Request) -> int:
    return request.id


#: A request's bytes (read in C: :meth:`RequestQueue.take` weighs a whole lane at once).
_nbytes = operator.attrgetter("nbytes")


def form_batches(
    queue: RequestQueue,
    idle: list[int],
    config: SchedulerConfig,
    now: float,
    inline: bool = False,
) -> tuple[list[Batch], list[Request], float | None]:
    """Decide the launches to start on the ``idle`` streams.

    Args:
        queue: the queued requests; popped requests leave it.
        idle: indices of idle streams; streams given a batch are removed from it.
        config: the policy knobs.
        now: the current ``time.monotonic()``.
        inline: the device runs launches up to ``inline_max_bytes`` inline, and a fused
            batch of small requests is kept under it (:data:`SMALL_FUSED_BYTES`).

    Returns:
        ``(batches, expired, wake_at)``: launches to start, requests whose deadline passed
        (already out of the queue, state EXPIRED), and when to call again because a key is
        waiting out ``max_delay_us`` (None: no need).
    """
    batches: list[Batch] = []
    expired: list[Request] = []
    wake_at: float | None = None
    delay = config.max_delay_us / 1e6
    held: set[Hashable] = set()  # keys waiting for company this round
    while idle and queue.live:
        key = _best_key(queue, held)
        if key is None:
            break
        head = queue.head(key)
        assert head is not None
        if head.deadline is not None and head.deadline <= now:
            queue.pop(key)
            head.state = RequestState.EXPIRED
            expired.append(head)
            continue
        if head.nbytes > config.fuse_max_bytes:
            queue.pop(key)
            batches.extend(_solo(head, idle, config))
            continue
        if (
            delay
            and now - head.enqueued_at < delay
            and queue.count(key) < (config.max_batch_requests)
            and not _due_within(queue.earliest_deadline(key), head.enqueued_at + delay)
        ):
            held.add(key)
            due = head.enqueued_at + delay
            wake_at = due if wake_at is None else min(wake_at, due)
            continue
        limit = config.max_batch_requests
        ways = min(len(idle), queue.queued_bytes(key) // MIN_SPREAD_BYTES)
        if ways > 1:
            limit = min(limit, math.ceil(queue.count(key) / ways))
        budget = config.max_batch_bytes
        if inline and head.nbytes <= min(SMALL_FUSED_BYTES, config.inline_max_bytes // 2):
            budget = min(budget, config.inline_max_bytes)
        batch = _take(queue, key, limit, budget, config, now, expired)
        if batch:
            # A lone request runs on its own arrays: no gather, no scatter (same bits).
            batches.append(Batch(batch, idle.pop(0), key, fused=len(batch) > 1))
    return batches, expired, wake_at


def _due_within(deadline: float | None, hold_until: float) -> bool:
    """Whether a request's ``deadline`` comes before a hold for company would end: its
    key launches now instead (a deadline bounds how long a request is held)."""
    return deadline is not None and deadline <= hold_until


def _best_key(queue: RequestQueue, held: set[Hashable]) -> Hashable | None:
    if not held:
        return queue.best_key()
    best: tuple[int, int] | None = None
    best_key: Hashable | None = None
    for key in queue.keys():  # noqa: SIM118 - a method of ours, not dict.keys
        if key in held:
            continue
        head = queue.head(key)
        if head is not None and (best is None or (-head.priority, head.id) < best):
            best, best_key = (-head.priority, head.id), key
    return best_key


def _take(
    queue: RequestQueue,
    key: Hashable,
    limit: int,
    budget: int,
    config: SchedulerConfig,
    now: float,
    expired: list[Request],
) -> list[Request]:
    """Pop up to ``limit`` fusible requests of ``key`` within ``budget`` bytes."""
    taken, late = queue.take(key, limit, config.fuse_max_bytes, budget, now)
    expired.extend(late)
    return taken


def _solo(request: Request, idle: list[int], config: SchedulerConfig) -> list[Batch]:
    """A large request: alone on one stream, or split across the idle streams."""
    if (
        request.nbytes >= config.split_min_bytes
        and len(idle) > 1
        and request.graph is None
        and all(request.tensors[name] is not None for name in request.op.outputs)
    ):  # a device may leave outputs to the launch (then it runs whole)
        parts = request.op.split(request.tensors, request.scalars, len(idle))
        if parts:
            request.parts_left = len(parts)
            return [Batch([request], idle.pop(0), request.key, False, part) for part in parts]
    request.parts_left = 1
    return [Batch([request], idle.pop(0), request.key, fused=False)]
