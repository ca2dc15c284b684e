"""Admission: the queue cap, one FIFO of parked submitters, and the thread inbox.

A submitter finds room when fewer than ``max_queued_requests`` are queued (counting those
still in the inbox, and the slots held for woken submitters) and nobody is parked ahead of
it. Otherwise it parks: tasks on a loop event, threads on a thread event, both in the same
FIFO. Each time slots free up, as many parked submitters are woken, in order, as there are
free slots, and each woken one holds its slot until it has queued its request: a newcomer
that arrives before a woken submitter resumes finds no room and parks behind the others,
so requests are admitted first come, first served. No thundering herd, no polling. A
cancelled task passes its wake-up (and its slot) on.

Threads do not touch the queue: they append their checked requests to the inbox, and the
first of a burst posts one drain to the loop, so a burst of thread submissions costs one
hand-off. The lock guards the inbox and the FIFO; the queue itself changes only on the
loop thread.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from opsched._errors import SchedulerClosedError
from opsched.core.batching import RequestQueue
from opsched.core.loop import LoopEvent, LoopHandle, ThreadEvent
from opsched.core.requests import Request, RequestFuture
from opsched.core.stats import Counters

__all__ = ["Admission"]


class Admission:
    """The cap and the parked submitters of one scheduler."""

    __slots__ = (
        "_cap",
        "_loop",
        "_queue",
        "_waiters",
        "_woken",
        "inbox",
        "lock",
        "open",
        "thread_counts",
        "thread_refused",
        "thread_waits",
    )

    def __init__(self, cap: int, queue: RequestQueue, loop: LoopHandle) -> None:
        self._cap = cap
        self._queue = queue
        self._loop = loop
        #: Guards the inbox, the FIFO and the thread-side counters.
        self.lock = threading.Lock()
        self._waiters: collections.deque[LoopEvent | ThreadEvent] = collections.deque()
        #: Futures of checked requests from threads, each holding its request (``checked``),
        #: until the loop queues them (an empty inbox: no thread's request waits).
        self.inbox: collections.deque[RequestFuture] = collections.deque()
        #: Slots held for submitters woken from the FIFO that have not queued yet.
        self._woken = 0
        #: False once the scheduler stops accepting requests.
        self.open = True
        #: Threads that waited for room (counted under the lock).
        self.thread_waits = 0
        #: Calls from threads refused at submit (counted under the lock).
        self.thread_refused = 0
        #: Requests run in their callers' threads (:meth:`Scheduler.call_threadsafe`),
        #: finished under the lock.
        self.thread_counts = Counters()

    def refused_in_thread(self) -> None:
        """Count a call from a thread that its checks refused (any thread)."""
        with self.lock:
            self.thread_refused += 1

    def has_room(self) -> bool:
        """Whether a task may queue now: below the cap, no slot held for a woken submitter
        in the way, and nobody parked ahead of it."""
        return self._queue.live + self._woken < self._cap and not self._waiters

    def full(self) -> bool:
        """Whether the queue is at the cap."""
        return self._queue.live >= self._cap

    async def wait_for_room(self) -> None:
        """Park the calling task until it may queue (FIFO); it then holds a slot, which the
        caller fills by queueing its request before it next awaits.

        Raises:
            SchedulerClosedError: the scheduler closed while it waited.
        """
        if self.has_room():
            return
        if not self.open:
            raise SchedulerClosedError("the scheduler is closing; it accepts no new requests")
        event = self._loop.new_event()
        with self.lock:
            self._waiters.append(event)
        try:
            await event.wait()
        except BaseException:
            if event.is_set():  # woken, then cancelled: hand its slot to the next waiter
                with self.lock:
                    self._woken -= 1
                self.wake()
            else:
                with self.lock:
                    self._waiters.remove(event)
            raise
        with self.lock:
            self._woken -= 1  # the slot becomes its request's, queued before any await
        if not self.open:
            raise SchedulerClosedError("the scheduler is closing; it accepts no new requests")

    def put_threadsafe(
        self, request: Request, future: RequestFuture, drain: Callable[[], None]
    ) -> bool:
        """Hand a thread's checked request to the loop, parking the thread while the queue
        is full; ``drain`` is posted to the loop by the first of a burst.

        Returns:
            False when the loop has ended (nothing will drain the inbox).
        """
        parked: ThreadEvent | None = None
        while True:
            with self.lock:
                if parked is not None:  # woken from the FIFO: its slot was held for it
                    self._woken -= 1
                room = len(self.inbox) + self._queue.live + self._woken < self._cap
                if not self.open or parked is not None or (room and not self._waiters):
                    future.checked = request  # no pair per request: one object less to hold
                    self.inbox.append(future)
                    first = len(self.inbox) == 1
                    break
                self.thread_waits += 1
                parked = ThreadEvent()
                self._waiters.append(parked)
            parked.wait_blocking()
        return not first or self._loop.post(drain)

    def take_inbox(self) -> list[RequestFuture]:
        """Everything threads handed over since the last call (loop thread)."""
        with self.lock:
            items = list(self.inbox)
            self.inbox.clear()
        return items

    def wake(self) -> bool:
        """Wake as many parked submitters as there are free slots, in order, each holding
        its slot until it queues (loop thread).

        Returns:
            Whether room is left for the inbox after that.
        """
        with self.lock:
            free = self._cap - self._queue.live - len(self.inbox) - self._woken
            waiters = self._waiters
            while free > 0 and waiters:
                waiters.popleft().set()
                self._woken += 1
                free -= 1
            return free > 0 and bool(self.inbox)

    def close(self) -> None:
        """Refuse new requests and wake every parked submitter (they raise
        SchedulerClosedError, or find the scheduler closed)."""
        self.open = False
        with self.lock:
            while self._waiters:
                self._waiters.popleft().set()
                self._woken += 1
