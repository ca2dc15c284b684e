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
import os
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import attrs

from opsched._compat import PYTHON_INTERNALS
from opsched._errors import RequestWithdrawnError, SchedulerClosedError
from opsched._log import ERROR, INFO, enabled, get_logger
from opsched.core.loop import FUTURE, LoopEvent
from opsched.core.stats import Counters
from opsched.ops import Operator

if TYPE_CHECKING or PYTHON_INTERNALS:  # (the lean future's states: opsched._compat)
    from concurrent.futures._base import CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED, PENDING

if TYPE_CHECKING:
    from opsched.core.engine import Engine

__all__ = [
    "DONE",
    "EXPIRED",
    "QUEUED",
    "RUNNING",
    "Call",
    "LeanRequestFuture",
    "Pending",
    "Request",
    "RequestFuture",
    "RequestState",
    "finish",
    "new_request_future",
    "past_deadline",
]

_log = get_logger("opsched.scheduler")


class RequestState(enum.Enum):
    """Where a request is."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


#: The members every request's journey compares against, bound once. On Python 3.11 a
#: member read through its class (``RequestState.DONE``) goes through
#: ``EnumType.__getattr__``'s hook, which makes and frees a method wrapper each time:
#: several times a module global's read (Python 3.12 dropped the hook).
QUEUED, RUNNING, DONE = RequestState.QUEUED, RequestState.RUNNING, RequestState.DONE
EXPIRED = RequestState.EXPIRED


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


#: Guards the making of a :class:`RequestFuture`'s condition, and the outcome given to a
#: future that has none (so a thread that makes one afterwards finds the outcome, and one
#: that made it before is told).
_CONDITION_MADE = threading.Lock()


def _new_lock_in_child() -> None:
    """A forked child's own :data:`_CONDITION_MADE`: a thread of the parent may have held
    it at the fork, and nobody in the child would ever let it go."""
    global _CONDITION_MADE, _CLAIMS  # the module's locks, remade once per fork
    _CONDITION_MADE = threading.Lock()
    _CLAIMS = threading.Lock()


#: Guards the one call of ``set_running_or_notify_cancel`` a :class:`RequestFuture` gets
#: (a second call raises): its owner's ``cancel()`` and the loop's :meth:`settle` race.
_CLAIMS = threading.Lock()

os.register_at_fork(after_in_child=_new_lock_in_child)


class RequestFuture(Future[Any]):
    """What a submission from a thread returns: a ``concurrent.futures.Future`` whose
    ``cancel()`` also withdraws its queued request (posted to the loop). No done-callback
    per request: it would keep the request, and its arrays, as long as the future lives.

    This class drives ``Future`` through its public methods only. Where the gate allows
    (:data:`opsched._compat.PYTHON_INTERNALS`), submissions make the leaner
    :class:`LeanRequestFuture` instead (:data:`new_request_future`).
    """

    __slots__ = ("_claimed", "_request", "_withdraw", "checked", "withdrawn")

    def __init__(self) -> None:
        super().__init__()
        #: The checked request, from submission until the loop queues it (the inbox holds
        #: the future alone).
        self.checked: Any = None
        #: Set on the loop once the request is queued, with the request it withdraws
        #: (called with it); both cleared when the request has an outcome.
        self._withdraw: Callable[[Any], object] | None = None
        self._request: Any = None
        #: Set by :meth:`cancel` before it looks at ``_withdraw``: read by the loop, after
        #: it set ``_withdraw``, without taking the future's lock (one sees the other).
        self.withdrawn = False
        self._claimed = False

    def _claim(self) -> bool:
        """``set_running_or_notify_cancel`` once: True when the future may take its
        outcome, False when its owner cancelled it (its waiters are told, once)."""
        with _CLAIMS:
            if self._claimed:
                return False
            self._claimed = True
        return self.set_running_or_notify_cancel()

    def settle(self, result: Any, error: BaseException | None) -> None:
        """Give the future its request's outcome (loop thread): ``error`` when not None,
        else ``result``; nothing when its owner cancelled it first."""
        if not self._claim():
            return
        if error is None:
            self.set_result(result)
        else:
            self.set_exception(error)

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        # No executor will pick it up to notify the waiters of concurrent.futures.wait and
        # as_completed: do it now, as an executor would.
        self._claim()
        self._withdrawn_by_owner()
        return True

    def _withdrawn_by_owner(self) -> None:
        """The owner cancelled: withdraw the queued request (on the loop)."""
        self.withdrawn = True
        withdraw, request = self._withdraw, self._request
        if withdraw is not None:
            self._withdraw = self._request = None
            withdraw(request)


#: A future's states once it has an outcome (``Future.done()``).
_DONE_STATES = (
    frozenset((CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED)) if PYTHON_INTERNALS else frozenset()
)


class LeanRequestFuture(RequestFuture):
    """A :class:`RequestFuture` that is one object until something waits on it (behind
    the gate :data:`opsched._compat.PYTHON_INTERNALS`: it sets ``Future``'s own fields).

    A burst of submissions holds thousands of futures at once, and every tracked object
    they hold makes the garbage collector's full passes, which walk the whole heap, come
    sooner, and a plain ``Future`` is eleven objects. This one is one object until something
    needs its
    condition: a thread that blocks in ``result()`` on it before its outcome,
    ``concurrent.futures.wait`` / ``as_completed``, ``cancel()``, a done-callback. Those
    make it (a :class:`_FutureCondition`) on first use; the loop gives a future that has
    none its outcome without one, under :data:`_CONDITION_MADE`, and a future with an
    outcome answers ``result()`` and ``done()`` without a lock. Its fields are slots, so
    its ``__dict__`` is never made; the list of ``concurrent.futures.wait`` waiters is made
    by the first one to install itself, the list of done-callbacks by the first callback.
    """

    __slots__ = (
        "_cond",
        "_done_callbacks",
        "_exception",
        "_result",
        "_state",
        "_waiter_list",
    )

    def __init__(self) -> None:  # (not Future.__init__: its fields are set here, leaner)
        # Future.__init__'s fields (the same in every supported Python), its condition lazy
        self._cond: _FutureCondition | None = None
        self._state = PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._waiter_list: list[Any] | None = None  # see _waiters
        #: No done-callbacks: an empty tuple (what ``Future`` reads when it runs them),
        #: made a list of its own by the first :meth:`add_done_callback`.
        self._done_callbacks: Any = ()
        #: The checked request, from submission until the loop queues it (the inbox holds
        #: the future alone).
        self.checked: Request | None = None
        #: Set on the loop once the request is queued, with the request it withdraws
        #: (called with it); both cleared when the request has an outcome.
        self._withdraw: Callable[[Any], object] | None = None
        self._request: Any = None
        #: Set by :meth:`cancel` before it looks at ``_withdraw``: read by the loop, after
        #: it set ``_withdraw``, without taking the future's lock (one sees the other).
        self.withdrawn = False
        self._claimed = False

    @property
    def _condition(self) -> _FutureCondition:  # type: ignore[override]  # Future's attribute
        """The future's condition (every ``Future`` method that locks takes it), made on
        first use."""
        condition = self._cond
        if condition is None:
            with _CONDITION_MADE:
                condition = self._cond
                if condition is None:
                    condition = self._cond = _FutureCondition()
        return condition

    @property
    def _waiters(self) -> list[Any]:  # type: ignore[override]  # Future's attribute
        """The waiters of ``concurrent.futures.wait`` / ``as_completed`` (which append to
        it, under the future's lock), made on first use, with the condition: a future with
        a waiter to tell is never settled without it."""
        waiters = self._waiter_list
        if waiters is None:
            self._condition  # noqa: B018  # made, if the caller did not lock it first
            waiters = self._waiter_list = []
        return waiters

    def done(self) -> bool:
        # A state is one attribute, written once the outcome is in place: no lock to take.
        return self._state in _DONE_STATES

    def result(self, timeout: float | None = None) -> Any:
        if self._state == FINISHED and self._exception is None:  # the usual: no lock
            return self._result
        return super().result(timeout)  # waits, times out, raises (under the lock)

    def add_done_callback(self, fn: Callable[[Future[Any]], object]) -> None:
        with self._condition:
            if type(self._done_callbacks) is tuple:
                self._done_callbacks = []
        super().add_done_callback(fn)

    def settle(self, result: Any, error: BaseException | None) -> None:
        """Give the future its request's outcome (loop thread): ``error`` when not None,
        else ``result``; nothing when its owner cancelled it first.

        A future nobody has waited on, cancelled or added a callback to has no condition:
        the outcome is written under :data:`_CONDITION_MADE` alone (there is nobody to
        tell). Otherwise one pass under the future's lock does what ``set_result`` /
        ``set_exception`` do (the outcome, FINISHED, the waiters of
        ``concurrent.futures.wait`` and ``as_completed``, the threads in ``result()``), so
        an owner's ``cancel()`` lands either before it (then nothing is set) or after it
        (then it says False); the done-callbacks run after the lock is let go, as for any
        future. Either way the outcome is written before the state that says it is there.
        (Claiming the future first with ``set_running_or_notify_cancel`` and then calling
        ``set_result`` took the lock three times: 1.5 us a future on the loop thread.)
        """
        if self._cond is None:
            with _CONDITION_MADE:
                if self._cond is None:  # (a cancel() would have made it)
                    self._result, self._exception = result, error
                    self._state = FINISHED
                    return
        condition = self._cond
        assert condition is not None  # made once, never unmade
        with condition:
            if self._state != PENDING:
                return  # cancelled by its owner
            self._result, self._exception = result, error
            self._state = FINISHED
            for waiter in self._waiter_list or ():
                if error is None:
                    waiter.add_result(self)
                else:
                    waiter.add_exception(self)
            if condition._waiters:  # threads in result()
                condition.notify_all()
        if self._done_callbacks:  # an empty tuple until the first is added
            self._invoke_callbacks()  # type: ignore[attr-defined]  # Future's own

    def cancel(self) -> bool:
        if not Future.cancel(self):  # done-callbacks run in there, without the lock held
            return False
        with self._condition:  # of concurrent cancel() calls, one notifies
            if self._state == CANCELLED:
                # No executor will pick it up to notify its waiters (concurrent.futures.wait,
                # as_completed): do it now, as an executor would. A second cancel() finds
                # it notified already and says True.
                self.set_running_or_notify_cancel()
        self._withdrawn_by_owner()
        return True


#: The future a submission from a thread gets: the lean one where the gate allows.
new_request_future: Callable[[], RequestFuture] = (
    LeanRequestFuture if PYTHON_INTERNALS else RequestFuture
)


#: One operator call as its caller made it, before its checks: ``(op, args, out, priority,
#: deadline, timeout)`` (the operator's description; its parameters, in order; where to
#: write the result, None: allocated; higher runs first; an absolute ``time.monotonic()``
#: or None; seconds from now or None). The one value a call travels as from a face to its
#: checks, where it becomes its :class:`Request`: a plain tuple, which a face makes with no
#: Python call (a tuple subclass's constructor cost three times as much, once a request).
Call = tuple[Operator, Sequence[Any], Any, int, "float | None", "float | None"]


@attrs.define(eq=False, slots=True)
class Request:
    """One submitted operator call and its outcome.

    Created by the scheduler after the request passed its checks; the output arrays are
    already bound (the caller's ``out=`` or a fresh array). One is made per request, so
    every field is positional with a plain default (attrs then sets each from a parameter:
    about half the cost of keyword-only fields and factories).
    """

    id: int
    #: When its call passed its checks (``time.monotonic()``).
    enqueued_at: float
    op: Operator
    tensors: dict[str, Any]
    scalars: dict[str, Any]
    key: Hashable
    units: int
    nbytes: int
    priority: int
    deadline: float | None
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
    #: Tasks awaiting it now: the last one to be cancelled withdraws it.
    waiting: int = 0
    #: The caller stopped waiting: the result is dropped when the launch finishes.
    abandoned: bool = False
    #: Launches still to finish for this request once it is launched: its parts when it
    #: is split (set as it is), else one.
    parts_left: int = 1
    #: For requests submitted from threads: the future their submitter holds.
    future: RequestFuture | None = None
    #: For a graph node: ``(graph run, node index)``; its launch reports to the run.
    graph: Any = None
    #: Stream events its launch must wait for (its producers' launches).
    waits: list[Any] | None = None

    @property
    def result(self) -> Any:
        """The output array, or the operator's tuple of outputs (valid once DONE)."""
        return self.op.result(self.tensors)

    def outcome(self) -> Any:
        """What the caller of a completed request gets (converted for its kind of array)."""
        result = self.op.result(self.tensors)
        convert = self.convert
        return result if convert is None else convert(result)

    def returned(self) -> Any:
        """What the waiter of a finished request gets: its outcome, or its error raised."""
        if self.state is DONE:  # outcome(), inlined: this runs per request
            result = self.op.result(self.tensors)
            convert = self.convert
            return result if convert is None else convert(result)
        if self.error is None:  # withdrawn: its last waiter was cancelled
            msg = (
                f"{self.op.name}: the request was withdrawn before it launched (every task "
                "awaiting it was cancelled)"
            )
            raise RequestWithdrawnError(msg)
        raise self.error


def past_deadline(request: Request) -> bool:
    """Whether ``request``'s deadline has passed (then it is never launched)."""
    return request.deadline is not None and request.deadline <= time.monotonic()


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
        if enabled(ERROR):
            _log.error("request finished twice", op=request.op.name, request=request.id)
        return
    request.state = state
    if state is DONE:  # the common case first: one comparison, one counter
        counters.completed += 1
    else:
        if error is not None and request.error is None:
            request.error = error
        counters.count(state.value)
        if state is RequestState.FAILED and enabled(INFO):
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
        if state is DONE:
            run.finished(node_run, None)
        else:
            run.finished(node_run, request.error or SchedulerClosedError("cancelled"))
    future = request.future
    if future is not None:
        future._withdraw = future._request = None  # nothing to withdraw: let go of it
        if future.withdrawn:  # cancelled by its owner: no outcome to build (a lock-free
            return  # hint; settle() checks again under the future's lock)
        if state is DONE:
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

    Returned by the ``*_nowait`` methods. Several tasks may await one ``Pending``; each gets
    the request's outcome. Cancelling an awaiting task withdraws a queued request (or drops
    the result of a running one) only when it was the request's last waiter; a task that
    awaits it after that raises :class:`~opsched.RequestWithdrawnError`.
    """

    __slots__ = ("_engine", "_request")

    def __init__(self, engine: Engine, request: Request) -> None:
        self._engine = engine
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
        return await self._engine.wait(self._request)

    def __await__(self) -> Any:
        return self.wait().__await__()
