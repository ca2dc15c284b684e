"""Streams and events, in the vocabulary of ``torch.cuda.Stream`` / ``Event``.

A :class:`Stream` is a FIFO of launches. :class:`ThreadStream` runs it on one worker thread
(the cpu device, and torch:cpu); :class:`FrameworkStream` is a thread that issues its
launches onto a framework's stream (torch:cuda, torch:npu) and waits for other streams on
the device; :class:`InlineStream` runs each launch at once in the caller's thread (the
reference device). A stream reports each finished launch through the ``on_done`` callback it
was given, called in the stream's thread (or inline): that is the single hand-off point back
to the scheduler.

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

__all__ = [
    "Event",
    "FrameworkStream",
    "InlineStream",
    "IssuedEvent",
    "Stream",
    "StreamStatistics",
    "ThreadStream",
]

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

    @property
    def worker(self) -> int | None:
        """The identity of the stream's worker thread (None once closed)."""
        return self._thread.ident if self._thread is not None else None

    def _started(self) -> None:
        """Runs first in the worker thread, before any launch (a hook)."""

    def _worker(self) -> None:
        _lower_priority()
        self._started()
        while (item := self._queue.get()) is not None:
            kind, a, b = item
            if kind == "run":
                self._run(a, b)
            else:
                self._handle(kind, a)
            # An idle stream holds nothing: bound here until the next item arrived, the
            # launch's work kept its requests, and their arrays, alive after their results
            # went back.
            item = a = b = None

    def _handle(self, kind: str, a: Any) -> None:
        """An item that is not a launch: an event to record or to wait for."""
        if kind == "record":
            a._complete()
        else:
            a.synchronize()


@attrs.define(eq=False)
class IssuedEvent(Event):
    """An event on a :class:`FrameworkStream`: it completes as any event does, and names
    the launches before it (``seq`` of them), so that another stream of the device can wait
    for them on the device as soon as they are issued."""

    stream: FrameworkStream = attrs.field(kw_only=True)
    seq: int = attrs.field(kw_only=True)


@attrs.define(eq=False)
class FrameworkStream(ThreadStream):
    """A worker thread that issues its launches onto ``framework``, a framework stream
    (``torch.cuda.Stream``, torch_npu's): graph edges wait on the device.

    A launch calls :meth:`issued` with a framework event once its kernels are queued (then
    it may block its own thread until they finish, to report completion). A stream told to
    :meth:`wait_event` for an :class:`IssuedEvent` of another stream waits in its thread
    only until those launches are *issued*, then makes ``framework`` wait for their event
    on the device: its next launch is queued before its producers finish. Other events are
    waited for on the host, as :class:`ThreadStream` does.
    """

    framework: Any = attrs.field(default=None, kw_only=True)
    #: Binds the worker thread to the device and to ``framework`` (its current device and
    #: stream), once, before its first launch: every launch the thread issues then goes
    #: there without a context switch per launch, and never touches another device.
    bind: Callable[[], None] | None = attrs.field(default=None, kw_only=True)
    #: What ``bind`` raised, if it did: every launch on the stream fails with it.
    bind_error: BaseException | None = attrs.field(default=None, init=False)
    _enqueued: int = attrs.field(default=0, init=False)  # by the loop thread
    _issued: int = attrs.field(default=0, init=False)  # by the worker, under _cond
    _issued_event: Any = attrs.field(default=None, init=False)
    _pending: bool = attrs.field(default=False, init=False)
    _cond: threading.Condition = attrs.field(factory=threading.Condition, init=False)

    def _started(self) -> None:
        if self.bind is not None:
            try:
                self.bind()
            except Exception as exc:  # reported by every launch, never lost in the thread
                self.bind_error = exc

    def enqueue(self, work: Work, on_done: Done) -> None:
        self._enqueued += 1
        super().enqueue(work, on_done)

    def record_event(self) -> Event:
        event = IssuedEvent(stream=self, seq=self._enqueued)
        self._queue.put(("record", event, None))
        return event

    def wait_event(self, event: Event) -> None:
        if isinstance(event, IssuedEvent) and event.stream is not self:
            self._queue.put(("device", event, None))
        elif not isinstance(event, IssuedEvent):  # own events: stream order suffices
            super().wait_event(event)

    def issued(self, framework_event: Any) -> None:
        """The running launch's work is queued on ``framework``; ``framework_event`` was
        recorded after it (called once per launch, in this stream's thread)."""
        self._pending = False
        with self._cond:
            self._issued += 1
            self._issued_event = framework_event
            self._cond.notify_all()

    def issued_event(self, seq: int) -> Any:
        """Block until ``seq`` launches have been issued; return the framework event
        recorded after the latest (it covers them), or None when the latest had nothing to
        issue (it has finished on the host)."""
        with self._cond:
            self._cond.wait_for(lambda: self._issued >= seq)
            return self._issued_event

    def _run(self, work: Work, on_done: Done) -> None:
        self._pending = True
        try:
            super()._run(work, on_done)
        finally:
            if self._pending:  # failed or issued nothing: done on the host already
                self.issued(None)

    def _handle(self, kind: str, a: Any) -> None:
        if kind == "device":
            framework_event = a.stream.issued_event(a.seq)
            if framework_event is not None:
                self.framework.wait_event(framework_event)
        else:
            super()._handle(kind, a)


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
