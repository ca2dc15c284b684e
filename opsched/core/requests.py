"""Requests: the record of one submitted call, its awaitable handle, and how it finishes.

A :class:`Request` is created once its arguments passed their checks; its output arrays are
already bound. Whatever happens to it (completed, failed, expired, cancelled), it ends
through :func:`finish`, the one function that records the outcome, counts it and wakes its
waiter: the awaiting task's event, a thread's future, or the graph run it belongs to.

This module knows nothing of devices, operators by name, or batching policy.
"""

from __future__ import annotations

import collections
import enum
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from concurrent.futures._base import PENDING
from typing import TYPE_CHECKING, Any

import attrs

from opsched._errors import SchedulerClosedError
from opsched._log import enabled, get_logger
from opsched.core.loop import LoopEvent, ThreadEvent
from opsched.core.stats import Counters
from opsched.ops import Operator

if TYPE_CHECKING:
    from opsched.core.scheduler import Scheduler

__all__ = ["Pending", "Request", "RequestFuture", "RequestState", "finish"]

_log = get_logger("opsched.scheduler")


def _unbound_event() -> LoopEvent:
    """For requests built outside a scheduler (tests of the pure policy)."""
    return ThreadEvent()


class RequestState(enum.Enum):
    """Where a request is."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


class _FutureCondition(threading.Condition):
    """The condition of a :class:`RequestFuture`: a ``threading.Condition`` over a plain
    lock whose methods live on the class instead of being bound per instance (Condition's
    own ``__init__`` makes five bound methods). A burst of submissions holds thousands of
    futures at once, and every object they hold makes the garbage collector's full passes,
    which walk the whole heap, come sooner."""

    def __init__(self) -> None:  # no super().__init__(): its bound methods are the cost
        self._lock = threading.Lock()
        self._waiters: collections.deque[Any] = collections.deque()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()


class RequestFuture(Future[Any]):
    """What a submission from a thread returns: a ``concurrent.futures.Future`` whose
    ``cancel()`` also withdraws its queued request (posted to the loop). No done-callback
    per request: it would keep the request, and its arrays, as long as the future lives.
    Its condition is a :class:`_FutureCondition` (six objects per future instead of
    eleven)."""

    #: The checked request, from submission until the loop queues it (the inbox holds
    #: the future alone).
    checked: tuple[Any, ...] | None = None
    #: Set on the loop once the request is queued, with the request it withdraws
    #: (called with it); both cleared when the request has an outcome.
    _withdraw: Callable[[Any], object] | None = None
    _request: Any = None
    #: Set by :meth:`cancel` before it looks at ``_withdraw``: read by the loop, after it
    #: set ``_withdraw``, without taking the future's lock (one of the two sees the other).
    withdrawn = False

    def __init__(self) -> None:
        # Future.__init__'s fields (the same in every supported Python), its condition lean
        self._condition = _FutureCondition()
        self._state = PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._waiters: list[Any] = []
        self._done_callbacks: list[Any] = []

    def cancel(self) -> bool:
        cancelled = super().cancel()
        if cancelled:
            # No executor will pick it up to notify its waiters (concurrent.futures.wait,
            # as_completed): do it now, as an executor would.
            self.set_running_or_notify_cancel()
            self.withdrawn = True
            withdraw, request = self._withdraw, self._request
            if withdraw is not None:
                self._withdraw = self._request = None
                withdraw(request)
        return cancelled


@attrs.define(eq=False, slots=True)
class Request:
    """One submitted operator call and its outcome.

    Created by the scheduler after the request passed its checks; the output arrays are
    already bound (the caller's ``out=`` or a fresh array).
    """

    id: int
    op: Operator
    tensors: dict[str, Any]
    scalars: dict[str, Any]
    key: Hashable
    units: int
    nbytes: int
    priority: int
    deadline: float | None
    enqueued_at: float
    state: RequestState = RequestState.QUEUED
    error: BaseException | None = None
    #: Set when the request reached a final state (the loop's native event).
    done: LoopEvent = attrs.field(factory=_unbound_event, kw_only=True)
    #: The caller stopped waiting: the result is dropped when the launch finishes.
    abandoned: bool = False
    #: Launches (split parts) still running for this request.
    parts_left: int = 0
    launched_at: float = 0.0
    #: For requests submitted from threads: the future their submitter holds.
    future: RequestFuture | None = None
    #: What its checks depended on (shapes, dtypes, scalars); None when not hashable.
    signature: Hashable | None = attrs.field(default=None, kw_only=True)
    #: For a graph node: ``(graph run, node run)``; its launch reports to them.
    graph: Any = None
    #: Stream events its launch must wait for (its producers' launches).
    waits: list[Any] | None = None
    #: Turns the device's result into what the caller gets (None: as it is).
    convert: Any = attrs.field(default=None, kw_only=True)

    @property
    def result(self) -> Any:
        """The output array, or the operator's tuple of outputs (valid once DONE)."""
        return self.op.result(self.tensors)

    def outcome(self) -> Any:
        """What the caller of a completed request gets (converted for its kind of array)."""
        result = self.result
        convert = self.convert
        return result if convert is None else convert(result)

    def returned(self) -> Any:
        """What the waiter of a finished request gets: its outcome, or its error raised."""
        if self.state is RequestState.DONE:  # outcome(), inlined: this runs per request
            result = self.op.result(self.tensors)
            convert = self.convert
            return result if convert is None else convert(result)
        assert self.error is not None
        raise self.error


def finish(
    request: Request,
    state: RequestState,
    counters: Counters,
    error: BaseException | None = None,
) -> None:
    """End ``request`` in ``state``: record it, count it, wake its waiter.

    Args:
        request: a request not yet final.
        state: DONE, FAILED, CANCELLED or EXPIRED.
        counters: the scheduler's counters; the outcome is counted there.
        error: the error its waiter raises (kept if one was already recorded).
    """
    if request.done.is_set():  # finished before: an internal error, counted, never delivered
        counters.finished_twice += 1
        if enabled():
            _log.error("request finished twice", op=request.op.name, request=request.id)
        return
    request.state = state
    if state is RequestState.DONE:  # the common case first: one comparison, one counter
        counters.completed += 1
    else:
        if error is not None and request.error is None:
            request.error = error
        counters.count(state.value)
        if state is RequestState.FAILED and enabled():
            _log.info("request failed", op=request.op.name, error=str(request.error))
    request.done.set()
    if request.graph is not None:
        run, node_run = request.graph
        if state is RequestState.DONE:
            run.finished(node_run, None)
        else:
            run.finished(node_run, request.error or SchedulerClosedError("cancelled"))
    future = request.future
    if future is not None:
        future._withdraw = future._request = None  # nothing to withdraw: let go of it
        if future.done():  # cancelled by its owner
            return
        if state is RequestState.DONE:
            future.set_result(request.outcome())
        elif request.error is not None:
            future.set_exception(request.error)
        else:
            future.cancel()


class Pending:
    """A submitted request: ``await pending`` (or ``await pending.wait()``) gives its result.

    Returned by the ``*_nowait`` methods. Cancelling the awaiting task withdraws a queued
    request (or drops the result of a running one).
    """

    __slots__ = ("_request", "_scheduler")

    def __init__(self, scheduler: Scheduler, request: Request) -> None:
        self._scheduler = scheduler
        self._request = request

    @property
    def state(self) -> RequestState:
        """Where the request is."""
        return self._request.state

    def done(self) -> bool:
        """Whether the request reached a final state."""
        return self._request.done.is_set()

    async def wait(self) -> Any:
        """Wait for the result; see :meth:`Scheduler.submit` for what it raises."""
        return await self._scheduler._wait(self._request)

    def __await__(self) -> Any:
        return self.wait().__await__()
