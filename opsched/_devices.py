"""Devices, streams and events, in the vocabulary of ``torch.cuda.Stream`` / ``Event``.

A :class:`Device` owns its streams and runs a kernel for a planned launch. The scheduler
never knows which device it has:

- ``"cpu"``: :class:`CpuDevice`, one worker thread per stream running its FIFO of launches;
  numpy releases the GIL in its loops, so streams compute in parallel.
- ``"reference"``: :class:`ReferenceDevice`, for tests: launches run inline, in submission
  order, with the reference kernels; fully deterministic.
- ``"torch:cpu"``, ``"torch:cuda[:i]"``, ``"torch:npu[:i]"``: the framework's operators on
  its own devices (:mod:`opsched._torch_device`; needs ``opsched[torch]``).

Both accept a fault injector (:meth:`Device.inject_faults`): a predicate over the requests of
a launch that makes chosen launches fail, so tests and the stress harness can exercise the
failure paths on either device.

A stream reports each finished launch through the ``on_done`` callback it was given, called
in the stream's thread (or inline): that is the single hand-off point back to the scheduler.
"""

from __future__ import annotations

import abc
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from opsched.ops import Operator

__all__ = [
    "DEVICES",
    "CpuDevice",
    "Device",
    "Event",
    "InjectedFault",
    "ReferenceDevice",
    "Stream",
    "StreamStatistics",
    "make_device",
]

Work = Callable[[], Any]
Done = Callable[[Any, BaseException | None], None]


class InjectedFault(RuntimeError):
    """Raised inside a launch chosen by a device's fault injector."""


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
class _ThreadStream(Stream):
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
class _InlineStream(Stream):
    """A stream that runs each launch at once in the caller's thread."""

    def enqueue(self, work: Work, on_done: Done) -> None:
        self._run(work, on_done)

    def record_event(self) -> Event:
        event = Event()
        event._complete()  # everything enqueued has already run
        return event

    def wait_event(self, event: Event) -> None:
        event.synchronize()


@attrs.define(eq=False)
class Device(abc.ABC):
    """A compute device: streams, a kernel runner and an optional fault injector."""

    name: str
    streams: list[Stream]
    _faulty: Callable[[Sequence[Any]], bool] | None = attrs.field(default=None, init=False)

    #: Whether small launches may run inline on an idle stream (no thread hop).
    inline_capable: bool = attrs.field(default=True, kw_only=True)
    #: The Ascend product the device says it is (an NPU's SoC name), else None.
    reported_product: str | None = attrs.field(default=None, kw_only=True)

    def inject_faults(self, predicate: Callable[[Sequence[Any]], bool] | None) -> None:
        """Make launches fail when ``predicate(requests)`` is true (None: no faults).

        The predicate sees the scheduler requests of a launch (each with ``.op``,
        ``.tensors``, ``.scalars`` and ``.id``). Fused launches that fail are re-run in halves
        until the requests that make the predicate true are isolated, exactly as for a real
        kernel failure. It runs in the stream's thread.
        """
        self._faulty = predicate

    def empty(self, shape: Sequence[int], dtype: np.dtype) -> Any:
        """A new array of ``shape`` and ``dtype`` on this device (a caller's output)."""
        return np.empty(tuple(shape), dtype)

    def check_fault(self, requests: Sequence[Any]) -> None:
        """Raise InjectedFault when the injector picks this launch."""
        faulty = self._faulty
        if faulty is not None and faulty(requests):
            msg = f"injected fault in a launch of {len(requests)} request(s)"
            raise InjectedFault(msg)

    @abc.abstractmethod
    def run_kernel(
        self, op: Operator, plan: Any, tensors: dict[str, np.ndarray], workspace: Any
    ) -> None:
        """Compute ``op`` for ``plan`` into the output tensors."""

    def close(self) -> None:
        """Stop every stream (their threads finish their current work first)."""
        for stream in self.streams:
            stream.close()


@attrs.define(eq=False)
class CpuDevice(Device):
    """The default device: numpy fast kernels, one worker thread per stream."""

    @classmethod
    def create(cls, streams: int) -> CpuDevice:
        """A CPU device with ``streams`` worker streams."""
        return cls("cpu", [_ThreadStream(i) for i in range(streams)])

    def run_kernel(
        self, op: Operator, plan: Any, tensors: dict[str, np.ndarray], workspace: Any
    ) -> None:
        op.run(plan, tensors, workspace)


@attrs.define(eq=False)
class ReferenceDevice(Device):
    """The test device: reference kernels, inline streams, submission order."""

    @classmethod
    def create(cls, streams: int) -> ReferenceDevice:
        """A reference device; ``streams`` inline streams (for statistics only)."""
        return cls("reference", [_InlineStream(i) for i in range(streams)])

    def run_kernel(
        self, op: Operator, plan: Any, tensors: dict[str, np.ndarray], workspace: Any
    ) -> None:
        op.run_reference(plan, tensors)


#: Device names :func:`make_device` accepts (``torch:cuda:N`` / ``torch:npu:N`` too).
DEVICES = ("cpu", "reference", "torch:cpu", "torch:cuda", "torch:npu")


def make_device(name: str, streams: int) -> Device:
    """Create the device called ``name`` with ``streams`` streams.

    Raises:
        ValueError: an unknown device name (the message lists the known ones).
        TypeError: ``name`` is not a string.
    """
    if not isinstance(name, str):
        msg = f"device must be a string such as 'cpu', got {type(name).__qualname__} {name!r}"
        raise TypeError(msg)
    if name == "cpu":
        return CpuDevice.create(streams)
    if name == "reference":
        return ReferenceDevice.create(streams)
    if name.startswith("torch:"):
        from opsched._torch_device import TorchDevice

        return TorchDevice.create(name, streams)
    msg = f"unknown device {name!r}; expected one of {list(DEVICES)}"
    raise ValueError(msg)
