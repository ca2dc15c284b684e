"""The scheduler: lifecycle, submit, dispatch, start, complete.

The path of one request (``docs/architecture.md``): the caller's coroutine has the request
checked (:mod:`opsched.core.checks`, cached by signature) and queued (admission, one record,
one queue operation), then waits on the request's future (or event). A dispatch step,
scheduled once per loop iteration however many requests arrived, runs the pure
:func:`form_batches` on the idle streams and starts each batch: the device prepares it
(executor, workspace: the device's own business) and its stream runs it, inline when tiny
and the stream is idle. The stream hands the launch back to the loop with one call; the
loop finishes every request of the launch (:func:`~opsched.core.requests.finish`) and
dispatches again.

Concurrency rules: all scheduler state changes on the loop thread, inside non-awaiting
methods; the only code in stream threads is a launch's own work. Every batch formation and
every launch runs inside an exception boundary that fails only the requests concerned.

The core knows devices only through :class:`~opsched.devices.Device` and operators only
through their descriptions: it never names either. The per-operator methods of the public
:class:`opsched.Scheduler` are generated over :meth:`Scheduler.submit`.
"""

from __future__ import annotations

import enum
import itertools
import os
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import anyio
import attrs

from opsched._errors import DeadlineExceededError, QueueFullError, SchedulerClosedError
from opsched.core.admission import Admission
from opsched.core.batching import RequestQueue
from opsched.core.checks import Checks
from opsched.core.config import SchedulerConfig
from opsched.core.dispatch import Dispatcher, device_lost
from opsched.core.graph import GraphBuilder, Node, Placeholder
from opsched.core.graph_run import run_graph
from opsched.core.here import run_here, run_on_loop, runs_here, runs_on_loop
from opsched.core.loop import FUTURE, LoopEvent, LoopHandle, upgrade_waiter
from opsched.core.requests import (
    Pending,
    Request,
    RequestFuture,
    RequestState,
    finish,
    new_request_future,
)
from opsched.core.stats import Counters, SchedulerStatistics
from opsched.core.trace import Tracer
from opsched.devices import Device
from opsched.ops import Operator
from opsched.ops.products import Product, resolve_product

__all__ = ["Scheduler", "SchedulerState"]

#: Every scheduler not yet collected, to orphan them in a forked child.
_LIVE: weakref.WeakSet[Scheduler] = weakref.WeakSet()
_PID = [os.getpid()]


def _orphan_in_child() -> None:
    parent, _PID[0] = _PID[0], os.getpid()
    for scheduler in list(_LIVE):
        scheduler._orphan(parent)


os.register_at_fork(after_in_child=_orphan_in_child)


class SchedulerState(enum.Enum):
    """A scheduler's lifecycle."""

    NOT_OPENED = "not opened"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@attrs.define(eq=False)
class Scheduler:
    """Fuses queued operator requests into launches on a device's streams.

    Create one with :func:`opsched.open_scheduler`; the module-level functions use the
    scheduler of the enclosing ``open_scheduler`` block or a default one per event loop.
    """

    config: SchedulerConfig
    device: Device
    _loop: LoopHandle
    _state: SchedulerState = attrs.field(default=SchedulerState.NOT_OPENED, init=False)
    _queue: RequestQueue = attrs.field(factory=RequestQueue, init=False)
    _admission: Admission = attrs.field(init=False)
    _checks: Checks = attrs.field(init=False)
    _counters: Counters = attrs.field(factory=Counters, init=False)
    _product: Product = attrs.field(init=False)
    _dispatcher: Dispatcher = attrs.field(init=False)
    _ids: itertools.count[int] = attrs.field(factory=itertools.count, init=False)
    _wake: LoopEvent | None = attrs.field(default=None, init=False)
    _wake_at: float | None = attrs.field(default=None, init=False)
    _loop_thread: int = attrs.field(factory=threading.get_ident, init=False)
    #: ``self._withdraw_posted``, bound once: each queued thread request's future holds it
    #: (a bound method per request would be one more object for the collector to walk).
    _withdraw_hook: Any = attrs.field(default=None, init=False)
    #: Keeps the default scheduler's service task alive (asyncio holds tasks weakly).
    _service: Any = attrs.field(default=None, init=False)
    #: Records a timeline trace when set (``open_scheduler(trace=...)``).
    _tracer: Tracer | None = attrs.field(default=None, kw_only=True)
    #: Set in a process forked from the one that made this scheduler: that process's pid.
    _forked_from: int | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        _LIVE.add(self)
        self._product = resolve_product(
            self.config.product, self.device.reported_product, self.device.name
        )
        self._admission = Admission(self.config.max_queued_requests, self._queue, self._loop)
        self._checks = Checks(self.device, self._product)
        self._withdraw_hook = self._withdraw_posted
        self._dispatcher = Dispatcher(
            self.config, self.device, self._loop, self._queue, self._counters, self._tracer,
            self._expired, self._wake_space, self._arm_timer,
        )  # fmt: skip

    # ------------------------------------------------------------------------ public API

    @property
    def state(self) -> SchedulerState:
        """The lifecycle state."""
        return self._state

    async def submit(
        self,
        op: Operator,
        args: Sequence[Any],
        out: Any = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Run ``op`` on ``args`` (its parameters, in order) through the scheduler; the
        per-operator methods of :class:`opsched.Scheduler` are this with named arguments.

        Args:
            op: the operator's description.
            args: its parameters, in order (trailing ones may be left to their defaults).
            out: where to write the result (a tuple for several outputs); allocated when
                None.
            priority: higher runs first; FIFO among equal priorities.
            deadline: absolute ``time.monotonic()`` by which the request must have launched.
            timeout: seconds from now, an alternative to ``deadline`` (the earlier wins).

        Returns:
            The result: ``out``, or the operator's tuple of outputs.

        Raises:
            ParamNullptrError, ParamInvalidError, InnerError, TypeError: bad arguments, at
                submit time.
            DeadlineExceededError: the deadline passed while the request was queued.
            RuntimeLaunchError: the launch failed; the kernel's exception is chained.
            SchedulerClosedError: the scheduler is closed, or closed with the request pending.
        """
        cacheable = out is None and deadline is None and timeout is None
        if (
            cacheable
            and type(priority) is int
            and self._state is SchedulerState.OPEN
            and self.device.lost is None
            and self._admission.has_room()
        ):
            # The common case: a call seen before, room in the queue. One cache lookup,
            # one record, one queue operation, then the wait.
            known = self._checks.known(op, args, priority)
            if known is not None:
                return await self._wait(self._admit(known))
        checked = self._checked_counted(op, args, out, priority, deadline, timeout)
        if not self._admission.has_room():
            self._counters.backpressure_waits += 1
            await self._admission.wait_for_room()
            self._require_open("new requests")
        return await self._wait(self._admit(checked))

    def submit_nowait(
        self,
        op: Operator,
        args: Sequence[Any],
        out: Any = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> Pending:
        """Queue ``op`` on ``args`` without waiting; ``await`` the returned :class:`Pending`.

        Raises:
            QueueFullError: ``max_queued_requests`` are already queued.
            (and the argument errors of :meth:`submit`)
        """
        checked = self._checked_counted(op, args, out, priority, deadline, timeout)
        if not self._admission.has_room():
            self._counters.rejected += 1
            msg = f"{len(self._queue)} requests are queued (max_queued_requests)"
            raise QueueFullError(msg)
        return Pending(self, self._admit(checked))

    def submit_threadsafe(
        self,
        op: Operator,
        args: Sequence[Any],
        out: Any = None,
        *,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> Future[Any]:
        """Submit from a thread other than the loop's; the future resolves with the result.

        The arguments are checked here, in the calling thread (bad ones raise at once);
        queueing happens on the loop, one wake-up per burst of submissions, so requests
        from threads fuse like those from coroutines. ``future.cancel()`` withdraws a
        queued request (or drops a running one's result). While ``max_queued_requests`` are
        queued or waiting to be, the calling thread blocks (backpressure, in the same FIFO
        as tasks).

        Raises:
            RuntimeError: called from the scheduler's own loop thread.
            (and the argument errors of :meth:`submit`)
        """
        if threading.get_ident() == self._loop_thread:
            msg = "submit_threadsafe was called on the scheduler's own loop thread; await instead"
            raise RuntimeError(msg)
        try:
            checked = self._checked_call(op, args, out, priority, deadline, timeout)
        except BaseException:
            self._admission.refused_in_thread()
            raise
        future = new_request_future()
        if not self._admission.put_threadsafe(checked, future, self._drain_inbox):
            future.checked = None  # nothing will queue it: let go of its arrays
            future.set_exception(SchedulerClosedError("the scheduler's event loop has ended"))
        return future

    def call_threadsafe(
        self,
        op: Operator,
        args: Sequence[Any],
        out: Any = None,
        *,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Run a request from a thread other than the loop's and return its result.

        When the scheduler has nothing queued or running (nor a trace to record, nor a
        ``max_delay_us`` to wait out), the request runs here, in the calling thread, as the
        solo launch it would have been (the same bits), without a round trip through the
        loop thread. Otherwise it is submitted (:meth:`submit_threadsafe`) and fuses with
        the rest. Raises as :meth:`submit`.
        """
        if runs_here(self):
            return run_here(self, op, args, out, priority, deadline, timeout)
        future = self.submit_threadsafe(
            op, args, out, priority=priority, deadline=deadline, timeout=timeout
        )
        return future.result()

    async def run(
        self,
        graph: GraphBuilder,
        outputs: Sequence[Node],
        *,
        inputs: Mapping[Node | Placeholder, Any] | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Run the nodes ``outputs`` need; return their arrays, in order.

        Args:
            graph: the :class:`~opsched.Graph`.
            outputs: nodes of ``graph`` whose results to return (each a fresh array).
            inputs: arrays for the graph's placeholders (same shape and dtype), and
                optionally for nodes, whose value is then taken as given, not computed.
            priority, deadline, timeout: for every node of the run, as for single calls.

        Raises:
            GraphExecutionError: some nodes failed; it names each, with its cause, and
                holds the outputs that completed.
            ParamNullptrError, ParamInvalidError, TypeError, ValueError: bad outputs or
                inputs (a placeholder without an array, an array of another geometry).
            SchedulerClosedError: the scheduler is closed.
        """
        return await run_graph(self, graph, outputs, inputs, priority, deadline, timeout)

    def statistics(self) -> SchedulerStatistics:
        """A frozen snapshot of the scheduler's counters."""
        c, t = self._counters, self._admission.thread_counts
        launches = c.launches + t.launches
        return SchedulerStatistics(
            submitted=c.submitted + t.submitted,
            completed=c.completed + t.completed,
            failed=c.failed + t.failed,
            cancelled=c.cancelled,
            expired=c.expired + t.expired,
            rejected=c.rejected + self._admission.thread_refused,
            queued=len(self._queue),
            queued_peak=self._queue.peak,
            running=self._dispatcher.running,
            launches=launches,
            requests_per_launch_mean=(c.served + t.served) / launches if launches else 0.0,
            requests_per_launch_max=max(c.per_launch_max, t.per_launch_max),
            backpressure_waits=c.backpressure_waits + self._admission.thread_waits,
            graph_runs=c.graph_runs,
            graph_nodes=c.graph_nodes,
            finished_twice=c.finished_twice + t.finished_twice,
            streams=tuple(s.statistics() for s in self.device.streams),
            pool=self.device.memory_statistics(),
            executor_cache=self.device.executor_statistics(),
        )

    def memory_stats(self) -> dict[str, int]:
        """The device memory's counters with torch-style keys (the framework allocator's
        own on torch devices)."""
        return self.device.memory_stats()

    def reset_peak_stats(self) -> None:
        """Restart the device memory's peak from its current size."""
        self.device.reset_peak_stats()

    def empty_cache(self) -> None:
        """Release the device's cached, idle memory."""
        self.device.empty_cache()

    async def aclose(self, *, cancel_pending: bool = False) -> None:
        """Close: refuse new requests, then drain (or fail) the pending ones.

        Args:
            cancel_pending: fail queued requests with SchedulerClosedError instead of running
                them; launches already running always finish.
        """
        if self._state is SchedulerState.CLOSED:
            return
        self._state = SchedulerState.CLOSING
        self._admission.close()
        if cancel_pending:
            self._fail_queued()
        await self._dispatcher.drained()
        self._shutdown()

    # ------------------------------------------------------------------ lifecycle (internal)

    def _open(self) -> None:
        if self._state is not SchedulerState.NOT_OPENED:
            msg = f"scheduler is {self._state.value}; a scheduler opens once"
            raise RuntimeError(msg)
        self._state = SchedulerState.OPEN

    def _orphan(self, parent: int) -> None:
        """In a forked child: this scheduler's loop and stream threads stayed in the parent
        (``parent``), so every call must fail clearly instead of waiting for them."""
        self._forked_from = parent
        self._state = SchedulerState.CLOSED
        # a parent thread may have held the admission lock at the fork: never touch it
        self._admission = Admission(self.config.max_queued_requests, self._queue, self._loop)
        self._admission.open = False

    def _require_open(self, what: str) -> None:
        if self._forked_from is not None:
            msg = (
                f"this scheduler belongs to process {self._forked_from}; its threads did not "
                f"survive the fork into process {os.getpid()}: open a new scheduler here"
            )
            raise SchedulerClosedError(msg)
        if self._state is not SchedulerState.OPEN:
            msg = f"the scheduler is {self._state.value}; it accepts no {what}"
            raise SchedulerClosedError(msg)
        lost = self.device.lost
        if lost is not None:
            raise device_lost(self.device.name, lost)

    async def _serve(self) -> None:
        """Service task: the one timer, for ``max_delay_us`` and for the earliest deadline
        of a queued request; returns when the scheduler closes."""
        while self._state is not SchedulerState.CLOSED:
            self._wake = self._loop.new_event()
            if self._wake_at is None:
                await self._wake.wait()
            else:
                with anyio.move_on_after(max(0.0, self._wake_at - time.monotonic())):
                    await self._wake.wait()
                self._wake_at = None
                self._expire_due()
                self._dispatcher.dispatch()

    def _close_now(self) -> None:
        """Close without waiting (the loop is ending): fail what is queued, stop streams."""
        if self._state is SchedulerState.CLOSED:
            return
        self._state = SchedulerState.CLOSING
        self._admission.close()
        self._fail_queued()
        self._shutdown()

    def _shutdown(self) -> None:
        self._state = SchedulerState.CLOSED
        self._dispatcher.closed = True
        self._admission.close()  # parked submitters raise SchedulerClosedError
        self.device.close()
        if self._tracer is not None:
            self._tracer.write()
        if self._wake is not None:
            self._wake.set()

    def _fail_queued(self) -> None:
        for request in self._queue.drain():
            error = SchedulerClosedError("the scheduler was closed before it launched")
            finish(request, RequestState.CANCELLED, self._counters, error)
        self._wake_space()

    # ----------------------------------------------------------------------- submission

    def _checked_call(
        self,
        op: Operator,
        args: Sequence[Any],
        out: Any,
        priority: int,
        deadline: float | None,
        timeout: float | None,
    ) -> tuple[Any, ...]:
        """A call's checked request (any thread; :meth:`Checks.call`)."""
        self._require_open("new requests")
        return self._checks.call(op, args, out, priority, deadline, timeout)

    def _checked_counted(
        self,
        op: Operator,
        args: Sequence[Any],
        out: Any,
        priority: int,
        deadline: float | None,
        timeout: float | None,
    ) -> tuple[Any, ...]:
        """A public call's arguments checked (on the loop thread), a refusal counted as
        rejected."""
        try:
            return self._checked_call(op, args, out, priority, deadline, timeout)
        except BaseException:
            self._counters.rejected += 1
            raise

    def _record(
        self,
        op: Operator,
        tensors: dict[str, Any],
        scalars: dict[str, Any],
        key: Any,
        units: int,
        nbytes: int,
        priority: int,
        deadline: float | None,
        signature: Any,
        convert: Any = None,
    ) -> Request:
        """A new request record of this scheduler."""
        return Request(
            next(self._ids), op, tensors, scalars, key, units, nbytes, priority, deadline,
            time.monotonic(), signature, convert,
        )  # fmt: skip

    def _admit(self, checked: tuple[Any, ...], future: RequestFuture | None = None) -> Request:
        """Queue a checked request (or finish it at once: it has nothing to compute, or it
        runs at submit, nothing queued or running and few others ready: :func:`runs_on_loop`).

        ``future``: the request came from a thread, which holds that future; its dispatch
        is deferred to after the whole drained burst.
        """
        request = self._record(*checked)
        request.future = future
        self._counters.submitted += 1
        if not request.nbytes:  # an empty tensor: nothing to compute, nothing to launch
            self._finish_empty(request)
            return request
        # (queue.live first: a busy scheduler skips the call)
        if future is None and not self._queue.live and runs_on_loop(self, request):
            run_on_loop(self, request)  # nothing could join it: its solo launch, now
            return request
        self._enqueue(request)
        if future is not None:
            future._request, future._withdraw = request, self._withdraw_hook
            if future.withdrawn:  # cancelled while in the inbox: withdrawn at once
                self._abandon(request)
                return request
            self._dispatcher.schedule()
            return request
        dispatcher = self._dispatcher
        if dispatcher.pending:  # a burst: the dispatch already scheduled takes it too
            return request
        if not self._loop.ready():
            dispatcher.dispatch()  # nobody else can join this batch: launch now, no loop hop
        else:
            dispatcher.schedule()  # others are about to submit: let them, then fuse
        return request

    def _drain_inbox(self) -> None:
        """Queue every request submitted from threads since the last drain (loop thread)."""
        for future in self._admission.take_inbox():
            checked, future.checked = future.checked, None
            assert checked is not None  # put_threadsafe set it
            if self._state is not SchedulerState.OPEN:
                future.set_exception(SchedulerClosedError("the scheduler was closed"))
                continue
            self._admit(checked, future)

    def _withdraw_posted(self, request: Request) -> None:
        """A thread's future was cancelled (any thread): withdraw its request on the loop."""
        self._loop.post(self._abandon_cancelled, request)

    def _abandon_cancelled(self, request: Request) -> None:
        if not request.finished:
            self._abandon(request)

    # ------------------------------------------------------------------------- waiting

    async def _wait(self, request: Request) -> Any:
        loop = self._loop
        request.waiting += 1
        try:
            if request.finished:  # finished inline at submit: still yield once
                await loop.checkpoint()
            elif request.waiter is None and loop.new_future:
                # the common case: one task waits on a bare future (a deadline is the
                # scheduler's: a request still queued then is expired, which wakes it)
                request.waiter = future = loop.new_future()
                await future
            else:  # a second task (a Pending's), or on trio
                await self._event(request).wait()
            if loop.cancelled is not None and loop.cancelled():
                await loop.checkpoint()
        except BaseException:
            request.waiting -= 1
            if not request.finished and not request.waiting:  # its last waiter left
                self._abandon(request)
            raise
        request.waiting -= 1
        return request.returned()

    def _event(self, request: Request) -> LoopEvent:
        """The event a task waits on for ``request`` when it has a deadline or is not its
        only waiter: its first waiter's, which a bare future's becomes."""
        done = request.waiter
        if done is None or isinstance(done, FUTURE):  # none yet, or the first's bare future
            done = request.waiter = upgrade_waiter(done, self._loop.new_event)
        return done

    def _finish_empty(self, request: Request) -> None:
        """Finish a request of empty tensors at submit: nothing to launch. Its deadline
        still holds: one already past expires, as it would in the queue."""
        if request.deadline is not None and request.deadline <= time.monotonic():
            self._expired(request)
        else:
            finish(request, RequestState.DONE, self._counters)

    def _abandon(self, request: Request) -> None:
        """The caller stopped waiting (cancellation)."""
        if request.state is RequestState.QUEUED:
            self._queue.discard(request, RequestState.CANCELLED)
            finish(request, RequestState.CANCELLED, self._counters)
            self._wake_space()
        else:
            request.abandoned = True  # running: its launch finishes, the result is dropped

    def _expire_due(self) -> None:
        """Expire the queued requests whose deadline passed; arm the timer for the next."""
        for request in self._queue.expire_due(time.monotonic()):
            self._expired(request)
        upcoming = self._queue.next_deadline()
        if upcoming is not None:
            self._arm_timer(upcoming)

    def _enqueue(self, request: Request) -> None:
        """Queue ``request``; its deadline sets the one timer if it is the earliest."""
        self._queue.push(request)
        if request.deadline is not None:
            self._arm_timer(request.deadline)

    def _expired(self, request: Request) -> None:
        late = time.monotonic() - (request.deadline or 0.0)
        error = DeadlineExceededError(
            f"{request.op.name}: the deadline passed {late * 1e3:.3f} ms ago while the "
            "request was queued; it was not launched"
        )
        finish(request, RequestState.EXPIRED, self._counters, error)
        self._wake_space()

    def _wake_space(self) -> None:
        """Wake as many parked submitters as there are free slots (FIFO); queue what
        threads handed over if room is left."""
        if self._admission.wake():
            self._drain_inbox()

    def _arm_timer(self, wake_at: float) -> None:
        if self._wake_at is None or wake_at < self._wake_at:
            self._wake_at = wake_at
            if self._wake is not None:
                self._wake.set()
