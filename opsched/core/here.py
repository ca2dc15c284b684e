"""A thread's lone blocking call, run in that thread (:meth:`Scheduler.call_threadsafe`).

When the scheduler has nothing queued or running, a blocking call from a thread gains
nothing from the loop thread: no other request can join its launch. It then runs where it
was made, as the solo launch it would have been (the device's :meth:`Device.run_here`: the
same plan and kernel, so the same bits), and ends through the one
:func:`~opsched.core.requests.finish`, counted in the admission's thread-side counters under
its lock. Part of the core: it knows the device only through its interface.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opsched._errors import DeadlineExceededError
from opsched.core.dispatch import launch_error
from opsched.core.requests import RequestState, finish
from opsched.ops import Operator

if TYPE_CHECKING:
    from opsched.core.scheduler import Scheduler

__all__ = ["run_here", "runs_here"]


def runs_here(sched: Scheduler) -> bool:
    """Whether a thread's lone request may run in that thread now (racy reads, as
    hints: at worst a request that could have fused runs alone, with the same bits)."""
    return (
        sched.device.runs_in_caller
        and sched._admission.open  # False once closing, closed or orphaned by a fork
        and sched._tracer is None
        and not sched.config.max_delay_us
        and not len(sched._queue)
        and not sched._dispatcher.inflight
        and sched._admission.inbox_empty()
        and threading.get_ident() != sched._loop_thread
    )


def run_here(
    sched: Scheduler,
    op: Operator,
    args: Sequence[Any],
    out: Any,
    priority: int,
    deadline: float | None,
    timeout: float | None,
) -> Any:
    admission = sched._admission
    try:
        checked = sched._checked_call(op, args, out, priority, deadline, timeout)
    except BaseException:
        admission.refused_in_thread()
        raise
    request = sched._record(*checked)
    counts = admission.thread_counts
    state: RequestState = RequestState.DONE
    error: BaseException | None = None
    if request.deadline is not None and request.deadline <= time.monotonic():
        state, error = (
            RequestState.EXPIRED,
            DeadlineExceededError(
                f"{op.name}: the deadline had passed when the request was submitted; it was "
                "not launched"
            ),
        )
    elif request.nbytes:
        try:
            sched.device.run_here(request)
        except Exception as exc:
            state, error = RequestState.FAILED, launch_error(request, exc)
    with admission.lock:  # submitted, launched and finished at once: one lock round
        counts.submitted += 1
        if request.nbytes and state is not RequestState.EXPIRED:
            counts.launched(1)
        finish(request, state, counts, error)
    if error is not None:
        raise error
    return request.outcome()
