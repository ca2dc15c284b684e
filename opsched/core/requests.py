"""Requests: the record of one submitted call, its awaitable handle, and how it finishes.

A :class:`Request` is created once its arguments passed their checks; its output arrays are
already bound. Whatever happens to it (completed, failed, expired, cancelled), it ends
through :func:`finish`, the one function that records the outcome, counts it and wakes its
waiter: the awaiting task's event, a thread's future, or the graph run it belongs to.

This module knows nothing of devices, operators by name, or batching policy.
"""

from __future__ import annotations

import _thread
import asyncio
import collections
import enum
import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from concurrent.futures._base import CANCELLED, FINISHED, PENDING
from typing import TYPE_CHECKING, Any

import attrs

from opsched._errors import SchedulerClosedError
from opsched._log import enabled, get_logger
from opsched.core.loop import FUTURE, LoopEvent
from opsched.core.stats import Counters
from opsched.ops import Operator

if TYPE_CHECKING:
    from opsched.core.scheduler import Scheduler

__all__ = ["Pending", "Request", "RequestFuture", "RequestState", "finish"]

_log = get_logger("opsched.scheduler")


class RequestState(enum.Enum):
    """Where a request is."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


# typeshed marks _thread.RLock final; CPython's type takes subclasses (Py_TPFLAGS_BASETYPE)
class _FutureCondition(_thread.RLock):  # type: ignore[misc]
    """The condition of a :class:`RequestFuture`: a ``threading.Condition`` that is its
    own lock. A burst of submissions holds thousands of futures at once, and every object
    they hold makes the garbage collector's full passes, which walk the whole heap, come
    sooner: a ``threading.Condition`` is three tracked objects (itself, its ``__dict__``,
    its waiters' deque) around a lock; this is one, with the deque made by the first
    ``wait``. Entering it is the lock's own C method, not a Python-level ``__enter__``.

    The waiting and notifying are ``threading.Condition``'s own functions (which use
    ``_waiters``, ``_is_owned``, ``_release_save`` and ``_acquire_restore``: the last three
    are the reentrant lock's, as for a ``Condition()`` built over its default ``RLock``).
    """

    __slots__ = ("_waiters",)

    def __init__(self) -> None:
        self._waiters: collections.deque[Any] | None = None

    def wait(self, timeout: float | None = None) -> bool:
        if self._waiters is None:
            self._waiters = collections.deque()
        return threading.Condition.wait(self, timeout)  # type: ignore[arg-type]

    wait_for = threading.Condition.wait_for

    def notify(self, n: int = 1) -> None:
        if not self._is_owned():  # type: ignore[attr-defined]
            raise RuntimeError("cannot notify on un-acquired lock")
        if self._waiters:
            threading.Condition.notify(self, n)  # type: ignore[arg-type]

    def notify_all(self) -> None:
        self.notify(len(self._waiters) if self._waiters else 0)


#: Conditions of futures that are gone, for new futures to take (at most
#: :data:`_IDLE_CONDITIONS_KEPT`, about 110 bytes each). A burst of submissions holds
#: thousands of futures, and each new object a burst keeps alive is promoted to the garbage
#: collector's oldest generation, whose growth by a quarter triggers a pass over the whole
#: heap: a condition taken from here is old already, so a burst of futures promotes one
#: object a future instead of two (measured: eight 25,600-future bursts in a row, torch
#: imported, 15.0 -> 13.1 us a request; full passes in 15 of 16 bursts -> 10 of 16).
_IDLE_CONDITIONS: list[_FutureCondition] = []
_IDLE_CONDITIONS_KEPT = 32768


class RequestFuture(Future[Any]):
    """What a submission from a thread returns: a ``concurrent.futures.Future`` whose
    ``cancel()`` also withdraws its queued request (posted to the loop). No done-callback
    per request: it would keep the request, and its arrays, as long as the future lives.

    A burst of submissions holds thousands of futures at once, and the garbage collector's
    passes walk every tracked object they hold (measured: about 3 of a tiny request's 14 us
    in a 25,600-future burst): this one is two, itself and its
    :class:`_FutureCondition` (a plain ``Future`` is eleven), and the condition is one a
    future that is gone left (:data:`_IDLE_CONDITIONS`) when there is one. Its fields are
    slots, so its ``__dict__`` is never made; the list of ``concurrent.futures.wait``
    waiters is made by the first one to install itself, the list of done-callbacks by the
    first callback.
    """

    __slots__ = (
        "_condition", "_done_callbacks", "_exception", "_request", "_result", "_state",
        "_waiter_list", "_withdraw", "checked", "withdrawn",
    )  # fmt: skip

    def __init__(self) -> None:
        # Future.__init__'s fields (the same in every supported Python), its condition lean
        try:  # a condition of a future that is gone (see _IDLE_CONDITIONS), else a new one
            self._condition = _IDLE_CONDITIONS.pop()  # type: ignore[assignment]  # its API
        except IndexError:
            self._condition = _FutureCondition()  # type: ignore[assignment]
        self._state = PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._waiter_list: list[Any] | None = None  # see _waiters
        #: No done-callbacks: an empty tuple (what ``Future`` reads when it runs them),
        #: made a list of its own by the first :meth:`add_done_callback`.
        self._done_callbacks: Any = ()
        #: The checked request, from submission until the loop queues it (the inbox holds
        #: the future alone).
        self.checked: tuple[Any, ...] | None = None
        #: Set on the loop once the request is queued, with the request it withdraws
        #: (called with it); both cleared when the request has an outcome.
        self._withdraw: Callable[[Any], object] | None = None
        self._request: Any = None
        #: Set by :meth:`cancel` before it looks at ``_withdraw``: read by the loop, after
        #: it set ``_withdraw``, without taking the future's lock (one sees the other).
        self.withdrawn = False

    def __del__(
        self, idle: list[_FutureCondition] = _IDLE_CONDITIONS, kept: int = _IDLE_CONDITIONS_KEPT
    ) -> None:
        # Its condition is idle: whoever locks or waits on a future holds the future (the
        # lists are bound as defaults: still there while the interpreter shuts down).
        if len(idle) < kept:
            condition = self._condition
            condition._waiters = None  # type: ignore[attr-defined]
            idle.append(condition)  # type: ignore[arg-type]

    @property
    def _waiters(self) -> list[Any]:  # type: ignore[override]  # Future's attribute
        """The waiters of ``concurrent.futures.wait`` / ``as_completed`` (which append to
        it, under the future's lock), made on first use."""
        waiters = self._waiter_list
        if waiters is None:
            waiters = self._waiter_list = []
        return waiters

    def add_done_callback(self, fn: Callable[[Future[Any]], object]) -> None:
        with self._condition:
            if type(self._done_callbacks) is tuple:
                self._done_callbacks = []
        super().add_done_callback(fn)

    def settle(self, result: Any, error: BaseException | None) -> None:
        """Give the future its request's outcome (loop thread): ``error`` when not None,
        else ``result``; nothing when its owner cancelled it first.

        One pass under the future's lock does what ``set_result`` / ``set_exception`` do
        (the outcome, FINISHED, the waiters of ``concurrent.futures.wait`` and
        ``as_completed``, the threads in ``result()``), so an owner's ``cancel()`` lands
        either before it (then nothing is set) or after it (then it says False); the
        done-callbacks run after the lock is let go, as for any future. (Claiming the
        future first with ``set_running_or_notify_cancel`` and then calling ``set_result``
        took the lock three times: 1.5 us a future on the loop thread.)
        """
        condition = self._condition
        with condition:
            if self._state != PENDING:
                return  # cancelled by its owner
            self._state = FINISHED
            waiters = self._waiter_list or ()
            if error is None:
                self._result = result
                for waiter in waiters:
                    waiter.add_result(self)
            else:
                self._exception = error
                for waiter in waiters:
                    waiter.add_exception(self)
            if condition._waiters:  # type: ignore[attr-defined]  # threads in result()
                condition.notify_all()
        if self._done_callbacks:  # an empty tuple until the first is added
            self._invoke_callbacks()  # type: ignore[attr-defined]  # Future's own

    def cancel(self) -> bool:
        if not super().cancel():  # done-callbacks run in there, without the lock held
            return False
        with self._condition:  # of concurrent cancel() calls, one notifies
            if self._state == CANCELLED:
                # No executor will pick it up to notify its waiters (concurrent.futures.wait,
                # as_completed): do it now, as an executor would. A second cancel() finds
                # it notified already and says True.
                self.set_running_or_notify_cancel()
        self.withdrawn = True
        withdraw, request = self._withdraw, self._request
        if withdraw is not None:
            self._withdraw = self._request = None
            withdraw(request)
        return True


@attrs.define(eq=False, slots=True)
class Request:
    """One submitted operator call and its outcome.

    Created by the scheduler after the request passed its checks; the output arrays are
    already bound (the caller's ``out=`` or a fresh array). One is made per request, so
    every field is positional with a plain default (attrs then sets each from a parameter:
    about half the cost of keyword-only fields and factories).
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
    #: What its checks depended on (shapes, dtypes, scalars); None when not hashable.
    signature: Hashable | None = None
    #: Turns the device's result into what the caller gets (None: as it is).
    convert: Any = None
    state: RequestState = RequestState.QUEUED
    error: BaseException | None = None
    #: Set once the request reached a final state (:func:`finish`).
    finished: bool = False
    #: What wakes the coroutines awaiting it, made by the first of them
    #: (:meth:`Scheduler._wait`): a bare asyncio future for one task without a deadline
    #: (:data:`~opsched.core.loop.FUTURE`), else an event of the loop's own kind. A request
    #: waited on by a thread's future or a graph run, or finished before anyone waits,
    #: never makes one.
    waiter: LoopEvent | asyncio.Future[None] | None = None
    #: The caller stopped waiting: the result is dropped when the launch finishes.
    abandoned: bool = False
    #: Launches (split parts) still running for this request.
    parts_left: int = 0
    launched_at: float = 0.0
    #: For requests submitted from threads: the future their submitter holds.
    future: RequestFuture | None = None
    #: For a graph node: ``(graph run, node run)``; its launch reports to them.
    graph: Any = None
    #: Stream events its launch must wait for (its producers' launches).
    waits: list[Any] | None = None

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
    if request.finished:  # finished before: an internal error, counted, never delivered
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
    request.finished = True
    waiter = request.waiter
    if waiter is not None:
        if isinstance(waiter, FUTURE):  # the bare future of the one task awaiting it
            if not waiter.done():  # (cancelled with its task: nothing to wake)
                waiter.set_result(None)
        else:
            waiter.set()
    if request.graph is not None:
        run, node_run = request.graph
        if state is RequestState.DONE:
            run.finished(node_run, None)
        else:
            run.finished(node_run, request.error or SchedulerClosedError("cancelled"))
    future = request.future
    if future is not None:
        future._withdraw = future._request = None  # nothing to withdraw: let go of it
        if future.withdrawn:  # cancelled by its owner: no outcome to build (a lock-free
            return  # hint; settle() checks again under the future's lock)
        if state is RequestState.DONE:
            # The device's conversion of its result can fail (a copy off an accelerator,
            # say): that is its caller's error alone, as a coroutine's caller gets it at
            # its await, never an exception into the launch's completion.
            try:
                outcome = request.outcome()
            except Exception as exc:
                future.settle(None, exc)
            else:
                future.settle(outcome, None)
        elif request.error is not None:
            future.settle(None, request.error)
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
        return self._request.finished

    async def wait(self) -> Any:
        """Wait for the result; see :meth:`Scheduler.submit` for what it raises."""
        return await self._scheduler._wait(self._request)

    def __await__(self) -> Any:
        return self.wait().__await__()
