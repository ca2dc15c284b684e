"""The synchronous facade: the same scheduler, driven from ordinary threads.

It only drives the async core: every call goes through the core's public methods
(``submit_threadsafe``, ``run``, ``statistics``) on the portal's loop thread.

One event-loop thread (anyio's blocking portal) runs the async core; every blocking call is
a trip to it, so there is exactly one implementation of scheduling. Works from any thread,
including one whose own asyncio loop is running (a notebook). A call from the portal's own
loop thread would deadlock, so it raises RuntimeError instead.

    import opsched.sync

    dx = opsched.sync.group_norm_grad(x, dy, gamma, mean, rstd)      # default scheduler

    with opsched.sync.open_scheduler(streams=2) as sched:
        futures = [sched.submit_glu_backward(g, a) for g, a in work]  # queue thousands...
        results = [f.result() for f in futures]                      # ...fused together
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import os
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from threading import get_ident
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import anyio.from_thread
import numpy as np

from opsched import ops
from opsched._api import Graph, Scheduler, open_engine
from opsched._errors import SchedulerClosedError
from opsched.core.config import SchedulerConfig
from opsched.core.engine import Engine
from opsched.core.graph import Node
from opsched.core.stats import SchedulerStatistics
from opsched.ops import Operator, entry_point

__all__ = [
    "SyncScheduler",
    "glu_backward",
    "group_norm_backward",
    "group_norm_grad",
    "open_scheduler",
    "run",
]


#: How many forks separate this process from the one that imported the module: a portal
#: made before a fork is unusable after it. A counter, because ``os.getpid()`` is a system
#: call and the check runs on every call.
_FORKS = [0]


def _count_fork() -> None:
    _FORKS[0] += 1


os.register_at_fork(after_in_child=_count_fork)


class _Portal:
    """An event loop on a daemon thread of its own, reached through anyio's blocking portal,
    and whether it can still be called: not after it closed, and not from a process forked
    after it started (its thread does not exist there: a call would wait forever).

    The thread is ours rather than ``anyio.from_thread.start_blocking_portal``'s so that
    nothing but :meth:`close` ever stops it: a generator's cleanup run by the garbage
    collector in a forked child, or while Python finalizes, would wait for that thread.
    """

    def __init__(self) -> None:
        ready: Future[anyio.from_thread.BlockingPortal] = Future()

        async def serve() -> None:
            async with anyio.from_thread.BlockingPortal() as portal:
                ready.set_result(portal)
                await portal.sleep_until_stopped()

        def run() -> None:
            try:
                anyio.run(serve)
            except BaseException as exc:  # reported to the opener, not lost in the thread
                if not ready.done():
                    ready.set_exception(exc)

        self._thread = threading.Thread(target=run, name="opsched-portal", daemon=True)
        self._thread.start()
        self.portal = ready.result()
        self.thread_id = self._thread.ident
        self.pid = os.getpid()
        self.forks = _FORKS[0]
        self.closed = False

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.check_thread()
        return self.portal.call(lambda: fn(*args, **kwargs))

    def close(self) -> None:
        """Stop the loop and join its thread (in this process only; idempotent)."""
        already, self.closed = self.closed, True
        if already or self.pid != os.getpid():  # a forked child has no thread to stop
            return
        with contextlib.suppress(RuntimeError):  # the loop already ended
            self.portal.call(self.portal.stop)
        self._thread.join()

    def check_thread(self) -> None:
        """Raise unless this thread may call through the portal now.

        Raises:
            SchedulerClosedError: the scheduler is closed, or belongs to the process this
                one was forked from.
            RuntimeError: called from the portal's own loop thread (it would deadlock).
        """
        if self.closed:
            raise SchedulerClosedError("this opsched.sync scheduler is closed")
        if self.forks != _FORKS[0]:
            msg = (
                f"this opsched.sync scheduler belongs to process {self.pid}; its threads did "
                f"not survive the fork into process {os.getpid()}: open a new one here (the "
                "opsched.sync functions use a fresh default scheduler)"
            )
            raise SchedulerClosedError(msg)
        if threading.get_ident() == self.thread_id:
            msg = (
                "opsched.sync was called from the scheduler's own event-loop thread, where "
                "it would deadlock; await the async API there instead"
            )
            raise RuntimeError(msg)


P = ParamSpec("P")
R = TypeVar("R")


def _threadsafe(
    op: Operator, method: Callable[Concatenate[Scheduler, P], Coroutine[Any, Any, R]]
) -> Callable[Concatenate[SyncScheduler, P], Future[R]]:
    """``method``'s twin for threads: queue, return a ``concurrent.futures.Future``."""

    def submit(
        facade: SyncScheduler,
        /,
        *args: Any,
        out: Any = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
        **named: Any,
    ) -> Future[Any]:
        portal = facade._portal
        if portal.closed or portal.forks != _FORKS[0] or get_ident() == portal.thread_id:
            portal.check_thread()  # raises: see there
        if named:  # operator arguments given by name
            args = op.bind(args, named)
        call = (op, args, out, priority, deadline, timeout)
        return facade._engine.submit_threadsafe(call)

    doc = (
        f"Queue a {op.name}; the future resolves with its result (or raises its error).\n\n"
        f"Arguments as :meth:`Scheduler.{op.method}`. Bad arguments raise here, at once; "
        "``future.cancel()`` withdraws a queued request."
    )
    returns = f"Future[{inspect.signature(method).return_annotation}]"
    name = f"submit_{op.method}"
    return cast(Any, entry_point(submit, method, name, doc, first="facade", returns=returns))


def _blocking(
    op: Operator, method: Callable[Concatenate[Scheduler, P], Coroutine[Any, Any, R]]
) -> Callable[Concatenate[SyncScheduler, P], R]:
    """``method``'s blocking twin: a lone call on an idle scheduler runs in the calling
    thread, a call on a busy one is queued and fuses (:meth:`Scheduler.call_threadsafe`)."""

    def call(
        facade: SyncScheduler,
        /,
        *args: Any,
        out: Any = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
        **named: Any,
    ) -> Any:
        portal = facade._portal
        if portal.closed or portal.forks != _FORKS[0] or get_ident() == portal.thread_id:
            portal.check_thread()  # raises: see there
        if named:  # operator arguments given by name
            args = op.bind(args, named)
        return facade._engine.call_threadsafe((op, args, out, priority, deadline, timeout))

    doc = f"Blocking :meth:`Scheduler.{op.method}` (same arguments and errors)."
    return cast(Any, entry_point(call, method, op.method, doc, first="facade"))


class SyncScheduler:
    """Blocking methods over a :class:`~opsched.Scheduler` running in a portal thread.

    ``submit_*`` return ``concurrent.futures.Future`` at once; the blocking methods are
    ``submit_*(...).result()``. Requests submitted from many threads fuse together.
    """

    def __init__(self, portal: _Portal, scheduler: Scheduler, engine: Engine) -> None:
        self._portal = portal
        self._scheduler = scheduler
        #: Where its calls go (the scheduler's engine), as the async methods' do.
        self._engine = engine

    @property
    def scheduler(self) -> Scheduler:
        """The async scheduler behind this facade."""
        return self._scheduler

    # BEGIN GENERATED sync scheduler: scripts/gen_entry_points.py writes this; do not edit
    glu_backward = _blocking(ops.GLU_BACKWARD, Scheduler.glu_backward)
    submit_glu_backward = _threadsafe(ops.GLU_BACKWARD, Scheduler.glu_backward)
    group_norm_grad = _blocking(ops.GROUP_NORM_GRAD, Scheduler.group_norm_grad)
    submit_group_norm_grad = _threadsafe(ops.GROUP_NORM_GRAD, Scheduler.group_norm_grad)
    group_norm_backward = _blocking(ops.GROUP_NORM_BACKWARD, Scheduler.group_norm_backward)
    submit_group_norm_backward = _threadsafe(ops.GROUP_NORM_BACKWARD, Scheduler.group_norm_backward)
    # END GENERATED sync scheduler

    def run(self, graph: Graph, outputs: Sequence[Node], **kw: Any) -> list[np.ndarray]:
        """Blocking :meth:`Scheduler.run` of a graph (same arguments and errors; a closed
        scheduler raises SchedulerClosedError)."""
        result: list[np.ndarray] = self._portal.call(
            functools.partial(self._scheduler.run, graph, outputs, **kw)
        )
        return result

    def statistics(self) -> SchedulerStatistics:
        """The scheduler's statistics snapshot (after it closed: ``.scheduler.statistics()``
        gives the final counters)."""
        stats: SchedulerStatistics = self._portal.call(self._scheduler.statistics)
        return stats


class _Session(AbstractContextManager[SyncScheduler]):
    """One sync scheduler's life: its portal thread and the async scheduler in it.

    Every open session is kept (strongly) until it closes, and closed at interpreter exit
    if its owner never did: a portal closed later, while Python finalizes, would wait for a
    daemon thread that no longer runs.
    """

    def __init__(
        self,
        config: SchedulerConfig | str | os.PathLike[str] | None,
        device: str,
        trace: str | os.PathLike[str] | None,
        overrides: dict[str, Any],
    ) -> None:
        self._args = (config, device, trace, overrides)
        self._portal: _Portal | None = None
        self._cm: AbstractContextManager[Any] | None = None

    def __enter__(self) -> SyncScheduler:
        config, device, trace, overrides = self._args
        portal = _Portal()
        try:
            cm = portal.portal.wrap_async_context_manager(
                open_engine(config, device, trace, overrides)
            )
            opened = cm.__enter__()
        except BaseException:
            portal.close()
            raise
        self._portal, self._cm = portal, cm
        _OPEN.add(self)
        return SyncScheduler(portal, opened.scheduler, opened.engine)

    def __exit__(self, *exc: Any) -> None:
        _OPEN.discard(self)
        portal, cm = self._portal, self._cm
        if portal is None or cm is None or portal.closed:
            return
        if portal.pid != os.getpid():  # a forked child: the threads are the parent's
            portal.closed = True
            return
        try:
            cm.__exit__(*exc)  # drains (or, on an exception, cancels) pending requests
        finally:
            portal.close()


#: Sessions opened and not yet closed (in this process).
_OPEN: set[_Session] = set()


@atexit.register
def _close_open_sessions() -> None:
    for session in list(_OPEN):
        session.__exit__(None, None, None)


def open_scheduler(
    config: SchedulerConfig | str | os.PathLike[str] | None = None,
    *,
    device: str = "cpu",
    trace: str | os.PathLike[str] | None = None,
    **overrides: Any,
) -> AbstractContextManager[SyncScheduler]:
    """Open a scheduler on its own event-loop thread for the ``with`` block.

    Arguments as :func:`opsched.open_scheduler`. Leaving the block drains pending requests
    and stops the loop thread and the stream threads; a scheduler never closed is closed
    (drained) at interpreter exit.
    """
    return _Session(config, device, trace, overrides)


_default_lock = threading.Lock()
_default: SyncScheduler | None = None


def _forget_default_in_child() -> None:
    """After a fork, in the child: the parent's default scheduler (and the lock, which a
    parent thread may have held) are not this process's; the next call starts a fresh one."""
    global _default, _default_lock
    _default = None
    _default_lock = threading.Lock()
    _OPEN.clear()


os.register_at_fork(after_in_child=_forget_default_in_child)


def _default_scheduler() -> SyncScheduler:
    global _default
    with _default_lock:
        if _default is None:
            _default = open_scheduler().__enter__()  # closed at exit with the other sessions
        return _default


def run(graph: Graph, outputs: Sequence[Node], **kw: Any) -> list[np.ndarray]:
    """Blocking graph run on the process-wide default scheduler."""
    return _default_scheduler().run(graph, outputs, **kw)


def _on_default(method: Callable[Concatenate[SyncScheduler, P], R]) -> Callable[P, R]:
    """``method`` on the process-wide default scheduler (started on first use, stopped at
    interpreter exit)."""

    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        return method(_default_scheduler(), *args, **kwargs)

    doc = (
        f"Blocking {method.__name__} on the process-wide default scheduler (started on first "
        f"use, stopped at interpreter exit); see :meth:`Scheduler.{method.__name__}`."
    )
    return entry_point(call, method, method.__name__, doc)


# BEGIN GENERATED functions: scripts/gen_entry_points.py writes this; do not edit
glu_backward = _on_default(SyncScheduler.glu_backward)
group_norm_grad = _on_default(SyncScheduler.group_norm_grad)
group_norm_backward = _on_default(SyncScheduler.group_norm_backward)
# END GENERATED functions
