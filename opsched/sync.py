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
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import anyio.from_thread
import numpy as np

from opsched import ops
from opsched._api import Graph, Scheduler
from opsched._api import open_scheduler as _open_async
from opsched.core.config import SchedulerConfig
from opsched.core.graph import Node
from opsched.core.stats import SchedulerStatistics

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
    def glu_backward(
        facade,
        grad_out: np.ndarray,
        self: np.ndarray,
        dim: int = -1,
        *,
        out: np.ndarray | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """Blocking :meth:`Scheduler.glu_backward` (same arguments and errors)."""
        return facade.submit_glu_backward(
            grad_out, self, dim, out=out, priority=priority, deadline=deadline, timeout=timeout
        ).result()

    def submit_glu_backward(
        facade,
        grad_out: np.ndarray,
        self: np.ndarray,
        dim: int = -1,
        *,
        out: np.ndarray | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> Future[np.ndarray]:
        """Queue a GluBackward; the future resolves with its result (or raises its error).

        Bad arguments raise here, at once. ``future.cancel()`` withdraws a queued request.
        """
        facade._portal.check_thread()
        return facade.scheduler.submit_threadsafe(
            ops.GLU_BACKWARD,
            (grad_out, self, dim),
            out,
            priority=priority,
            deadline=deadline,
            timeout=timeout,
        )

    def group_norm_grad(
        facade,
        x: np.ndarray,
        dy: np.ndarray,
        gamma: np.ndarray,
        mean: np.ndarray,
        rstd: np.ndarray,
        *,
        out: np.ndarray | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """Blocking :meth:`Scheduler.group_norm_grad` (same arguments and errors)."""
        return facade.submit_group_norm_grad(
            x, dy, gamma, mean, rstd, out=out, priority=priority, deadline=deadline, timeout=timeout
        ).result()

    def submit_group_norm_grad(
        facade,
        x: np.ndarray,
        dy: np.ndarray,
        gamma: np.ndarray,
        mean: np.ndarray,
        rstd: np.ndarray,
        *,
        out: np.ndarray | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> Future[np.ndarray]:
        """Queue a GroupNormalizationGrad; the future resolves with its result (or raises its
        error).

        Bad arguments raise here, at once. ``future.cancel()`` withdraws a queued request.
        """
        facade._portal.check_thread()
        return facade.scheduler.submit_threadsafe(
            ops.GROUP_NORM_GRAD,
            (x, dy, gamma, mean, rstd),
            out,
            priority=priority,
            deadline=deadline,
            timeout=timeout,
        )

    def group_norm_backward(
        facade,
        grad_out: np.ndarray,
        input: np.ndarray,
        mean: np.ndarray,
        rstd: np.ndarray,
        gamma: np.ndarray | None,
        N: int,
        C: int,
        HxW: int,
        group: int,
        output_mask: Sequence[bool] = (True, True, True),
        *,
        out: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None] | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """Blocking :meth:`Scheduler.group_norm_backward` (same arguments and errors)."""
        return facade.submit_group_norm_backward(
            grad_out,
            input,
            mean,
            rstd,
            gamma,
            N,
            C,
            HxW,
            group,
            output_mask,
            out=out,
            priority=priority,
            deadline=deadline,
            timeout=timeout,
        ).result()

    def submit_group_norm_backward(
        facade,
        grad_out: np.ndarray,
        input: np.ndarray,
        mean: np.ndarray,
        rstd: np.ndarray,
        gamma: np.ndarray | None,
        N: int,
        C: int,
        HxW: int,
        group: int,
        output_mask: Sequence[bool] = (True, True, True),
        *,
        out: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None] | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> Future[tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]]:
        """Queue a GroupNormBackward; the future resolves with its result (or raises its error).

        Bad arguments raise here, at once. ``future.cancel()`` withdraws a queued request.
        """
        facade._portal.check_thread()
        return facade.scheduler.submit_threadsafe(
            ops.GROUP_NORM_BACKWARD,
            (grad_out, input, mean, rstd, gamma, N, C, HxW, group, output_mask),
            out,
            priority=priority,
            deadline=deadline,
            timeout=timeout,
        )
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


# BEGIN GENERATED functions: scripts/gen_entry_points.py writes this; do not edit
def glu_backward(
    grad_out: np.ndarray,
    self: np.ndarray,
    dim: int = -1,
    *,
    out: np.ndarray | None = None,
    priority: int = 0,
    deadline: float | None = None,
    timeout: float | None = None,
) -> np.ndarray:
    """Blocking GluBackward on the process-wide default scheduler (started on first
    use, stopped at interpreter exit); see :meth:`Scheduler.glu_backward`.
    """
    return _default_scheduler().glu_backward(
        grad_out, self, dim, out=out, priority=priority, deadline=deadline, timeout=timeout
    )


def group_norm_grad(
    x: np.ndarray,
    dy: np.ndarray,
    gamma: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    *,
    out: np.ndarray | None = None,
    priority: int = 0,
    deadline: float | None = None,
    timeout: float | None = None,
) -> np.ndarray:
    """Blocking GroupNormalizationGrad on the process-wide default scheduler (started on first
    use, stopped at interpreter exit); see :meth:`Scheduler.group_norm_grad`.
    """
    return _default_scheduler().group_norm_grad(
        x, dy, gamma, mean, rstd, out=out, priority=priority, deadline=deadline, timeout=timeout
    )


def group_norm_backward(
    grad_out: np.ndarray,
    input: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    gamma: np.ndarray | None,
    N: int,
    C: int,
    HxW: int,
    group: int,
    output_mask: Sequence[bool] = (True, True, True),
    *,
    out: tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None] | None = None,
    priority: int = 0,
    deadline: float | None = None,
    timeout: float | None = None,
) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
    """Blocking GroupNormBackward on the process-wide default scheduler (started on first
    use, stopped at interpreter exit); see :meth:`Scheduler.group_norm_backward`.
    """
    return _default_scheduler().group_norm_backward(
        grad_out,
        input,
        mean,
        rstd,
        gamma,
        N,
        C,
        HxW,
        group,
        output_mask,
        out=out,
        priority=priority,
        deadline=deadline,
        timeout=timeout,
    )
# END GENERATED functions
