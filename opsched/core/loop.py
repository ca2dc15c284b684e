"""The event loop seen from outside: call soon, and call soon from another thread.

Stream threads hand each finished launch back to the loop with one non-blocking call. anyio
offers only blocking cross-thread calls, so this module binds the running backend's own
primitive: ``loop.call_soon_threadsafe`` on asyncio, ``TrioToken.run_sync_soon`` on trio.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
import weakref
from collections.abc import Awaitable, Callable, Hashable, Sized
from typing import Any, Protocol

import attrs

from opsched._compat import ANYIO_INTERNALS, PYTHON_INTERNALS

__all__ = ["FUTURE", "LoopEvent", "LoopHandle", "ThreadEvent", "current_loop", "upgrade_waiter"]

#: The type of the bare asyncio future a request's only awaiting task waits on
#: (:attr:`LoopHandle.new_future`): woken with ``set_result``, not ``set``.
FUTURE = asyncio.Future
_BASE_CREATE_FUTURE = asyncio.BaseEventLoop.create_future

#: What :attr:`LoopHandle.ready` says where the loop does not tell: "many".
UNKNOWN_READY = 1 << 30


class LoopEvent(Protocol):
    """What the scheduler needs of an event: ``asyncio.Event`` and ``trio.Event`` both fit.

    The scheduler uses the running loop's own event class: constructing one is ten times
    cheaper than ``anyio.Event()``, which looks up the backend on every construction.
    """

    def set(self) -> None: ...

    def is_set(self) -> bool: ...

    async def wait(self) -> Any: ...


class _AsyncioEvent:
    """asyncio.Event, minus a coroutine frame per wait: ``wait()`` returns a future.

    Each waiter gets its own future, so cancelling a waiter never affects the event. A
    request's event has one waiter: it takes a slot, not a list.
    """

    __slots__ = ("_flag", "_loop", "_more", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._flag = False
        self._waiter: asyncio.Future[None] | None = None
        self._more: list[asyncio.Future[None]] | None = None

    def set(self) -> None:
        if not self._flag:
            self._flag = True
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            for fut in self._more or ():
                if not fut.done():
                    fut.set_result(None)
            self._waiter = self._more = None

    def is_set(self) -> bool:
        return self._flag

    def wait(self) -> Any:
        fut = self._loop.create_future()
        if self._flag:
            fut.set_result(None)
        elif self._waiter is None:
            self._waiter = fut
        elif self._more is None:
            self._more = [fut]
        else:
            self._more.append(fut)
        return fut


def upgrade_waiter(waiter: Any, new_event: Callable[[], LoopEvent]) -> LoopEvent:
    """A new event for the tasks waiting on a request; when ``waiter`` is the bare future
    its first task waits on (:attr:`LoopHandle.new_future`), one that wakes it too."""
    event = new_event()
    if type(waiter) is FUTURE and isinstance(event, _AsyncioEvent):
        event._waiter = waiter
    return event


class ThreadEvent:
    """An event for a thread, never awaited: a parked submitting thread's, or the done
    event of requests built outside any loop (tests)."""

    def __init__(self) -> None:
        self._flag = threading.Event()

    def set(self) -> None:
        self._flag.set()

    def is_set(self) -> bool:
        return self._flag.is_set()

    def wait_blocking(self) -> None:
        """Block the calling thread until :meth:`set`."""
        self._flag.wait()

    async def wait(self) -> None:
        msg = "this request belongs to no scheduler; nothing can await it"
        raise RuntimeError(msg)


#: What a handle made without a loop waits on: nothing can await it (tests build such).
_NO_LOOP = ThreadEvent()


@attrs.frozen
class LoopHandle:
    """Ways to reach the loop a scheduler lives on."""

    #: Identifies the loop (the asyncio loop, or the trio token).
    key: Hashable
    _soon: Callable[..., Any]
    _threadsafe: Callable[..., Any]
    #: The backend's name, "asyncio" or "trio".
    library: str
    _later: Callable[..., Any] | None = None
    #: A new event of the loop's own kind (set and awaited on the loop thread). Plain
    #: callables, not methods: these run for every request.
    new_event: Callable[[], LoopEvent] = ThreadEvent  # always given: the loop's own class
    #: How many callbacks are ready to run on the loop right now: how many could still
    #: submit before the loop's next step (0: deferring work to that step gains nothing,
    #: no other task can add to it first). asyncio: its ready queue's length (a private
    #: attribute, read defensively: without it, :data:`UNKNOWN_READY`); trio: 0 when no
    #: task is runnable, else :data:`UNKNOWN_READY` (its statistics count the next batch's
    #: tasks, not the rest of the batch running now).
    ready: Callable[[], int] = lambda: UNKNOWN_READY  # always given
    #: An awaitable that yields to the loop once (and delivers a pending cancellation):
    #: ``asyncio.sleep(0)`` or ``trio.lowlevel.checkpoint()``, called as it is (no
    #: coroutine of ours around it: a request that ran at submit yields through it).
    checkpoint: Callable[[], Awaitable[Any]] = lambda: _NO_LOOP.wait()  # always given
    #: A bare future of the loop (asyncio), for the one task awaiting a request without a
    #: deadline: half the cost of an event and its future (made, awaited, woken: 0.5 us a
    #: request). None where the loop has none (trio): then the request gets an event.
    new_future: Callable[[], Any] | None = None
    #: After a wait completed: whether the caller's anyio cancel scope was cancelled
    #: meanwhile, so that it must pass a :attr:`checkpoint`; asked only while
    #: :attr:`scoped` is not empty (never on trio, where waits are cancellation points).
    cancelled: Callable[[], bool] = lambda: False  # always given
    #: Not empty while some task of the loop may be in an anyio cancel scope: anyio's own
    #: table of such tasks behind the gate, else a constant "maybe" (asyncio) or empty
    #: (trio). Read with ``bool()``: no Python call a request.
    scoped: Sized = ()
    #: The loop's exception handler (asyncio's ``call_exception_handler``); None on trio.
    _handler: Callable[[dict[str, Any]], Any] | None = None

    def call_later(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop ``delay`` seconds from now (call from the loop).

        Only on asyncio; on trio a no-op (timers there live in the waiting coroutines, and
        the sync facade always runs on asyncio).
        """
        if self._later is not None:
            self._later(max(0.0, delay), fn, *args)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop after the current step (call from the loop)."""
        self._soon(fn, *args)

    def report(self, exc: Exception, message: str) -> None:
        """Report ``exc``, raised by the scheduler's own bookkeeping on the loop thread,
        instead of raising it into the code that was running: to asyncio's exception
        handler (which logs it to the standard library's ``logging`` by default); on trio,
        which has none (a callback that raises ends the run as an internal error of
        trio's), to ``logging`` directly, logger ``opsched`` (printed to stderr when
        nothing is configured). Not structlog: that may be what raised."""
        if self._handler is not None:
            self._handler({"message": message, "exception": exc})
        else:
            logging.getLogger("opsched").error(message, exc_info=exc)

    def post(self, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` on the loop, from any thread; False once the loop has ended."""
        try:
            self._threadsafe(fn, *args)
        except RuntimeError:  # asyncio: loop closed; trio: RunFinishedError
            return False
        return True


def current_loop() -> LoopHandle:
    """The handle of the running event loop.

    Raises:
        RuntimeError: no event loop runs in this thread, or it is neither asyncio nor trio.
    """
    trio = sys.modules.get("trio")  # only a program that imported trio can be running it
    if trio is not None:
        try:
            token = trio.lowlevel.current_trio_token()
        except RuntimeError:
            pass
        else:

            def trio_ready() -> int:
                runnable = trio.lowlevel.current_statistics().tasks_runnable
                return 0 if runnable == 0 else UNKNOWN_READY

            return LoopHandle(
                token,
                token.run_sync_soon,
                token.run_sync_soon,
                "trio",
                None,
                trio.Event,
                trio_ready,
                trio.lowlevel.checkpoint,
            )
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        msg = "opsched's async API must be called from a running asyncio or trio event loop"
        raise RuntimeError(msg) from None
    # asyncio's ready queue, where its internals are the checked ones (opsched._compat)
    ready = getattr(loop, "_ready", None) if PYTHON_INTERNALS else None

    # the ready queue's own __len__: no Python frame a call
    ready_count = ready.__len__ if ready is not None else (lambda: UNKNOWN_READY)

    return LoopHandle(
        loop,
        loop.call_soon,
        loop.call_soon_threadsafe,
        "asyncio",
        loop.call_later,
        functools.partial(_AsyncioEvent, loop),
        ready_count,
        functools.partial(asyncio.sleep, 0),
        # asyncio's own futures only (FUTURE: what finish() wakes with set_result)
        loop.create_future if type(loop).create_future is _BASE_CREATE_FUTURE else None,
        *_anyio_cancel_check(loop),
        loop.call_exception_handler,
    )


def _anyio_cancel_check(loop: asyncio.AbstractEventLoop) -> tuple[Callable[[], bool], Sized]:
    """After a wait on asyncio: whether the task's anyio cancel scope was cancelled.

    On asyncio, anyio delivers a cancel scope's cancellation only to a task whose awaited
    future is still pending: a request that finished just before would hand its result to a
    caller whose scope was cancelled. The check runs after every wait, so it must be cheap:
    a plain function that reads the task's scope chain (anyio's own test, done
    synchronously); the caller then yields to the loop only when a scope really was
    cancelled, where anyio's ``checkpoint_if_cancelled`` is a coroutine per call (~7 us).
    Past the gate (:data:`opsched._compat.ANYIO_INTERNALS`), or in an anyio without those
    internals, the check says "always": every wait then checkpoints.

    Returns the check and what :attr:`LoopHandle.scoped` reads: anyio's table of tasks in
    its task groups and cancel scopes where it is a plain dict, else "maybe".
    """
    if not ANYIO_INTERNALS:
        return _always, _MAYBE
    try:
        from anyio._backends._asyncio import _task_states

        _task_states.get  # noqa: B018 - the internal this relies on
    except Exception:
        return _always, _MAYBE
    # The two lookups done per wait, without their Python-level wrappers where the
    # internals are as expected: the WeakKeyDictionary's own dict (keys: weak references,
    # equal to a new reference to the same task), and asyncio's current task per loop.
    states = getattr(_task_states, "data", None)
    tasks = getattr(asyncio.tasks, "_current_tasks", None) if PYTHON_INTERNALS else None
    if not isinstance(states, dict) or not isinstance(tasks, dict):
        states = tasks = None
    current_task = asyncio.current_task
    ref = weakref.ref

    def cancelled() -> bool:
        if states is None or tasks is None:
            task = current_task()
            state = _task_states.get(task) if task is not None else None
        elif not states:  # no task is in an anyio task group or cancel scope
            return False
        else:
            task = tasks.get(loop)
            state = states.get(ref(task)) if task is not None else None
        scope = state.cancel_scope if state is not None else None
        while scope is not None:
            if scope.cancel_called:
                return True
            if scope.shield:
                return False
            scope = scope._parent_scope
        return False

    return cancelled, (states if states is not None else _MAYBE)


#: :attr:`LoopHandle.scoped` where nothing tells: any task may be in a scope.
_MAYBE = (True,)


def _always() -> bool:
    return True
