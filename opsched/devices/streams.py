"""Streams and events, in the vocabulary of ``torch.cuda.Stream`` / ``Event``.

A :class:`Stream` is a FIFO of launches. :class:`ThreadStream` runs it on one worker thread
(the cpu device, and the torch devices' host side); :class:`InlineStream` runs each launch at
once in the caller's thread (the reference device). A stream reports each finished launch
through the ``on_done`` callback it was given, called in the stream's thread (or inline): that
is the single hand-off point back to the scheduler.

This module knows nothing of operators, kernels or the scheduler.
"""

from __future__ import annotations

import abc
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

__all__ = ["Event", "InlineStream", "Stream", "StreamStatistics", "ThreadStream"]

Work = Callable[[], Any]
Done = Callable[[Any, BaseException | None], None]


@attrs.frozen
class StreamStatistics:
    """A stream's counters.

    Attributes:
        index: the stream's number on its device.
        launches: launches run to completion (successful or not).
        busy_seconds: time spent running them.
    """

    index: int
    launches: int
    busy_seconds: float


@attrs.define(eq=False)
class Event:
    """A point in a stream's work; complete once the stream has run everything before it."""

    _flag: threading.Event = attrs.field(factory=threading.Event, init=False)

    def query(self) -> bool:
        """True when the work recorded before this event has completed."""
        return self._flag.is_set()

    def synchronize(self) -> None:
        """Block the calling thread until the event completes."""
        self._flag.wait()

    def _complete(self) -> None:
        self._flag.set()


@attrs.define(eq=False)
class Stream(abc.ABC):
    """A FIFO of launches on a device."""

    index: int
    _launches: int = attrs.field(default=0, init=False)
    _busy: float = attrs.field(default=0.0, init=False)

    @abc.abstractmethod
    def enqueue(self, work: Work, on_done: Done) -> None:
        """Run ``work`` after everything already enqueued, then ``on_done(result, error)``."""

    @abc.abstractmethod
    def record_event(self) -> Event:
        """Return an event that completes when the work enqueued so far has run."""

    @abc.abstractmethod
    def wait_event(self, event: Event) -> None:
        """Make work enqueued from now on wait until ``event`` completes."""

    def synchronize(self) -> None:
        """Block until everything enqueued so far has run."""
        self.record_event().synchronize()

    def run_inline(self, work: Work, on_done: Done) -> None:
        """Run ``work`` now in the calling thread; only on an idle stream."""
        self._run(work, on_done)

    def close(self) -> None:  # noqa: B027 - optional hook, default does nothing
        """Stop accepting work and release the stream's thread, if it has one."""

    def statistics(self) -> StreamStatistics:
        """Launch count and busy time so far."""
        return StreamStatistics(self.index, self._launches, self._busy)

    def _run(self, work: Work, on_done: Done) -> None:
        start = time.perf_counter()
        result: Any = None
        error: BaseException | None = None
        try:
            result = work()
        except BaseException as exc:  # the launch boundary: every failure goes to on_done
            error = exc
        self._busy += time.perf_counter() - start
        self._launches += 1
        on_done(result, error)


@attrs.define(eq=False)
class ThreadStream(Stream):
    """A stream run by one worker thread."""

    _queue: queue.SimpleQueue[tuple[str, Any, Any] | None] = attrs.field(
        factory=queue.SimpleQueue, init=False
    )
    _thread: threading.Thread | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        self._thread = threading.Thread(
            target=self._worker, name=f"opsched-stream-{self.index}", daemon=True
        )
        self._thread.start()

    def enqueue(self, work: Work, on_done: Done) -> None:
        self._queue.put(("run", work, on_done))

    def record_event(self) -> Event:
        event = Event()
        self._queue.put(("record", event, None))
        return event

    def wait_event(self, event: Event) -> None:
        self._queue.put(("wait", event, None))

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _worker(self) -> None:
        _lower_priority()
        while (item := self._queue.get()) is not None:
            kind, a, b = item
            if kind == "run":
                self._run(a, b)
            elif kind == "record":
                a._complete()
            else:
                a.synchronize()


#: How much lower than the event loop's the stream threads' OS priority is (nice levels).
STREAM_NICENESS = 5


def _lower_priority() -> None:
    """Give this stream thread a lower OS priority than the event-loop thread.

    With as many busy streams as cores, the loop thread would otherwise wait out whole
    scheduler time slices; a lower priority lets it run as soon as it is runnable, which
    keeps the loop responsive while kernels compute. Linux sets niceness per thread; where
    that is not available this does nothing.
    """
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + STREAM_NICENESS)
    except (AttributeError, OSError):
        pass


@attrs.define(eq=False)
class InlineStream(Stream):
    """A stream that runs each launch at once in the caller's thread."""

    def enqueue(self, work: Work, on_done: Done) -> None:
        self._run(work, on_done)

    def record_event(self) -> Event:
        event = Event()
        event._complete()  # everything enqueued has already run
        return event

    def wait_event(self, event: Event) -> None:
        event.synchronize()


