"""A lone request run where it was made, as the solo launch it would have been.

When the scheduler has nothing queued or running, a lone request gains nothing from the
dispatcher: no other request can join its launch. A thread's blocking call
(:meth:`Scheduler.call_threadsafe`) then runs in that thread (:func:`run_here`), and a
coroutine's request on a loop where few others are ready runs at submit, in the loop thread
(:func:`runs_on_loop`, :func:`run_on_loop`), instead of going through the queue, batch
formation and a launch of one. Either way it is the device's :meth:`Device.run_here`: the
same plan and kernel as the solo launch, so the same bits. It ends through the one
:func:`~opsched.core.requests.finish`, counted as submitted and launched. Part of the core: it
knows the device only through its interface.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opsched._errors import DeadlineExceededError
from opsched._log import enabled
from opsched.core.batching import Batch
from opsched.core.dispatch import launch_error
from opsched.core.requests import Request, RequestState, finish
from opsched.core.trace import log_launch
from opsched.ops import Operator

if TYPE_CHECKING:
    from opsched.core.scheduler import Scheduler

__all__ = ["FEW_READY", "past_deadline", "run_here", "run_on_loop", "runs_here", "runs_on_loop"]


def _alone(sched: Scheduler) -> bool:
    """Nothing could join a new request's launch: nothing is queued or running (what a
    busy scheduler fails first), and no trace or ``max_delay_us`` asks for the dispatcher;
    the device can run a request in the calling thread."""
    return (
        not sched._queue.live
        and not sched._dispatcher.inflight
        and sched.device.runs_in_caller
        and sched._tracer is None
        and not sched.config.max_delay_us
    )


def runs_here(sched: Scheduler) -> bool:
    """Whether a thread's lone request may run in that thread now (racy reads, as
    hints: at worst a request that could have fused runs alone, with the same bits)."""
    return (
        _alone(sched)
        and sched._admission.open  # False once closing, closed or orphaned by a fork
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
    """A thread's lone blocking call (:func:`runs_here` said so), checked, run and
    finished in that thread; returns its result or raises its error."""
    admission = sched._admission
    try:
        checked = sched._checked_call(op, args, out, priority, deadline, timeout)
    except BaseException:
        admission.refused_in_thread()
        raise
    request = sched._record(*checked)
    counts = admission.thread_counts
    state, error = _launch_here(sched, request)
    with admission.lock:  # submitted, launched and finished at once: one lock round
        counts.submitted += 1
        if request.nbytes and state is not RequestState.EXPIRED:
            counts.launched(1)
        finish(request, state, counts, error)
    if error is not None:
        raise error
    return request.outcome()


#: A coroutine's request runs at submit while at most this many other callbacks are ready
#: on the loop (:attr:`LoopHandle.ready`): at most a handful of requests could join its
#: launch, whose batch would gain nothing from them (a device runs so small a batch's
#: requests one after another on their own arrays anyway, or stacks them no faster), while
#: the dispatcher's round and each waiter's wake-up cost more than the launch. A few
#: clients calling in turn get about twice the requests a second they would if only an
#: idle loop ran requests at submit; many clients fill the queue and are not affected.
FEW_READY = 4


def runs_on_loop(sched: Scheduler, request: Request) -> bool:
    """Whether a coroutine's (or a graph node's) new ``request`` may run at submit, in the
    loop thread: at most :data:`FEW_READY` others are ready to run on the loop (few
    requests could join it), the scheduler has nothing queued or running, and the request
    is one the dispatcher would launch alone and inline (at most ``inline_max_bytes``, not
    split across streams). The waiter still yields to the loop once (others run between
    two requests of a client whose every request runs at submit)."""
    config = sched.config
    nbytes = request.nbytes
    return (
        _alone(sched)
        and sched._loop.ready() <= FEW_READY
        and 0 < nbytes <= config.inline_max_bytes
        and nbytes < config.split_min_bytes
    )


def run_on_loop(sched: Scheduler, request: Request) -> None:
    """Run a recorded, not yet queued ``request`` now (:func:`runs_on_loop` said so) and
    finish it: its waiter finds it finished."""
    request.launched_at = time.monotonic()
    start = time.perf_counter()
    state, error = _launch_here(sched, request)
    end = time.perf_counter()
    counters = sched._counters  # (it was counted as submitted when it was recorded)
    launched = state is not RequestState.EXPIRED
    if launched:  # a launch of stream 0, which is idle
        counters.launched(1)
        sched.device.streams[0].ran(end - start)
    finish(request, state, counters, error)
    if launched and enabled():  # the dispatcher's launch event, as for any launch
        batch = Batch([request], 0, request.key, fused=False)
        log_launch(request.op, batch, (None, start, end) if error is None else None)


def past_deadline(request: Request) -> bool:
    """Whether ``request``'s deadline has passed (then it is never launched)."""
    return request.deadline is not None and request.deadline <= time.monotonic()


def _launch_here(sched: Scheduler, request: Request) -> tuple[RequestState, BaseException | None]:
    """The solo launch of ``request`` in this thread: how it ended, and its error."""
    if past_deadline(request):
        error = DeadlineExceededError(
            f"{request.op.name}: the deadline had passed when the request was submitted; "
            "it was not launched"
        )
        return RequestState.EXPIRED, error
    if request.nbytes:
        try:
            sched.device.run_here(request)
        except Exception as exc:
            return RequestState.FAILED, launch_error(request, exc)
    return RequestState.DONE, None
