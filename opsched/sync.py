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
import functools
import inspect
import os
import threading
from collections.abc import Callable, Coroutine, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar, cast

import anyio.from_thread
import numpy as np

from opsched import ops
from opsched._api import Graph, Scheduler
from opsched._api import open_scheduler as _open_async
from opsched.core.config import SchedulerConfig
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


class _Portal:
    """A blocking portal and the identity of its loop thread."""

    def __init__(self, cm: AbstractContextManager[anyio.from_thread.BlockingPortal]) -> None:
        self._cm = cm
        self.portal = cm.__enter__()
        self.thread_id = self.portal.call(threading.get_ident)

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.check_thread()
        return self.portal.call(lambda: fn(*args, **kwargs))

    def close(self) -> None:
        self._cm.__exit__(None, None, None)

    def check_thread(self) -> None:
        """RuntimeError when called from the portal's own loop thread (it would deadlock)."""
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
        facade._portal.check_thread()
        if named:  # operator arguments given by name
            args = op.bind(args, named)
        return facade.scheduler.submit_threadsafe(
            op, args, out, priority=priority, deadline=deadline, timeout=timeout
        )

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
    """``method``'s blocking twin: its :func:`_threadsafe` future's result."""
    submit: Callable[..., Future[Any]] = _threadsafe(op, method)

    def call(facade: SyncScheduler, /, *args: Any, **kwargs: Any) -> Any:
        return submit(facade, *args, **kwargs).result()

    doc = f"Blocking :meth:`Scheduler.{op.method}` (same arguments and errors)."
    return cast(Any, entry_point(call, method, op.method, doc, first="facade"))


class SyncScheduler:
    """Blocking methods over a :class:`~opsched.Scheduler` running in a portal thread.

    ``submit_*`` return ``concurrent.futures.Future`` at once; the blocking methods are
    ``submit_*(...).result()``. Requests submitted from many threads fuse together.
    """

    def __init__(self, portal: _Portal, scheduler: Scheduler) -> None:
        self._portal = portal
        self._scheduler = scheduler

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
        """Blocking :meth:`Scheduler.run` of a graph (same arguments and errors)."""
        result: list[np.ndarray] = self._portal.call(
            functools.partial(self._scheduler.run, graph, outputs, **kw)
        )
        return result

    def statistics(self) -> SchedulerStatistics:
        """The scheduler's statistics snapshot."""
        stats: SchedulerStatistics = self._portal.call(self._scheduler.statistics)
        return stats


@contextmanager
def open_scheduler(
    config: SchedulerConfig | str | os.PathLike[str] | None = None,
    *,
    device: str = "cpu",
    trace: str | os.PathLike[str] | None = None,
    **overrides: Any,
) -> Iterator[SyncScheduler]:
    """Open a scheduler on its own event-loop thread for the ``with`` block.

    Arguments as :func:`opsched.open_scheduler`. Leaving the block drains pending requests
    and stops the loop thread and the stream threads.
    """
    portal = _Portal(anyio.from_thread.start_blocking_portal())
    try:
        cm = portal.portal.wrap_async_context_manager(
            _open_async(config, device=device, trace=trace, **overrides)
        )
        with cm as scheduler:
            yield SyncScheduler(portal, scheduler)
    finally:
        portal.close()


_default_lock = threading.Lock()
_default: SyncScheduler | None = None


def _default_scheduler() -> SyncScheduler:
    global _default
    with _default_lock:
        if _default is None:
            cm = open_scheduler()
            facade = cm.__enter__()
            atexit.register(cm.__exit__, None, None, None)
            _default = facade
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
