"""The engine: every piece of a scheduler's state, and every way a request travels.

One :class:`Engine` per scheduler owns the lifecycle, admission (the queue cap and the
parked submitters), the checks' cache, the queue and its one timer, expiry, abandonment,
the waits, and the choice of where a request's launch runs. The public
:class:`~opsched.core.scheduler.Scheduler` is a face that hands each call to it; the
:class:`~opsched.core.dispatch.Dispatcher` and graph runs use its methods below, never its
fields' insides.

A request travels one story (``docs/architecture.md``): the caller's call is checked
(:class:`~opsched.core.checks.Checks`, one lookup for a call seen before), recorded (one
:class:`~opsched.core.requests.Request`) and admitted; its launch then runs in one of three
places, and that is the only difference between the routes:

- **at submit, in the loop thread**, when nothing is running, the request is small, and
  either nothing is queued and few other callbacks are ready on the loop, or its device says
  company gains it nothing and nothing of its launch key is queued
  (:meth:`Engine.runs_at_submit`): nothing would join its launch, so it is its solo launch
  now;
- **in the calling thread**, for a thread's blocking call on an idle scheduler
  (:meth:`Engine.runs_in_thread`), the same solo launch there;
- **from the queue**, otherwise: the dispatcher fuses it with what is queued and starts
  the launch on an idle stream.

Either way it ends through the one :func:`~opsched.core.requests.finish`, which wakes its
waiter. Concurrency: all state changes on the loop thread inside methods that never
await, except what threads hand over through admission's inbox and the solo launch of a
thread's own blocking call (counted under admission's lock).

The core knows devices only through :class:`~opsched.devices.Device` and operators only
through their descriptions.
"""

from __future__ import annotations

import enum
import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import anyio
import attrs

from opsched._errors import DeadlineExceededError, QueueFullError, SchedulerClosedError
from opsched._log import enabled
from opsched.core.admission import Admission
from opsched.core.batching import Batch, RequestQueue
from opsched.core.checks import Checks
from opsched.core.config import SchedulerConfig
from opsched.core.dispatch import Dispatcher, device_lost, launch_error
from opsched.core.loop import FUTURE, LoopEvent, LoopHandle, upgrade_waiter
from opsched.core.requests import (
    DONE,
    EXPIRED,
    Call,
    Request,
    RequestState,
    finish,
    new_request_future,
    past_deadline,
)
from opsched.core.stats import Counters, SchedulerStatistics, with_solo
from opsched.core.trace import Tracer, log_launch
from opsched.devices import Device
from opsched.ops.products import Product, resolve_product

__all__ = ["FEW_READY", "OPEN", "Engine", "SchedulerState"]

#: Every engine not yet collected, to orphan them in a forked child.
_LIVE: weakref.WeakSet[Engine] = weakref.WeakSet()
_PID = [os.getpid()]


def _orphan_in_child() -> None:
    parent, _PID[0] = _PID[0], os.getpid()
    for engine in list(_LIVE):
        engine.orphan(parent)


os.register_at_fork(after_in_child=_orphan_in_child)

#: A coroutine's request runs at submit while at most this many other callbacks are ready
#: on the loop (:attr:`LoopHandle.ready`): so few requests could join its launch that a
#: fused launch of them costs more than their solo launches (the dispatcher's round, the
#: gather and scatter, each waiter's wake-up, spread over a handful of requests). For
#: eight coroutines awaiting tiny requests of one operator, run at submit each costs half
#: to two thirds as much as fused on the cpu device (every operator), three quarters to
#: four fifths on ``torch:cpu`` (``opsched bench scheduler --parts sweeps`` measures the
#: tiny GLU requests', on either device: its 8-client row); with sixteen, a fused launch
#: costs less on ``torch:cpu``. Many clients fill the queue and are not affected.
FEW_READY = 8

#: On asyncio, a coroutine's request that ran at submit returns without yielding to the
#: loop (as ``await`` of a finished future does), except every this many in a row (since a
#: task last waited for a request): then it yields once, so a client whose every request
#: runs at submit never keeps the loop's other callbacks, timers and cancellations waiting
#: longer than this many tiny launches. A client whose requests alternate between run at
#: submit and queued keeps its place among the others (its turn is the queued one's wait),
#: so their queued requests keep fusing. On trio every request is a checkpoint, as trio's
#: own calls are.
YIELD_EVERY = 8


class SchedulerState(enum.Enum):
    """A scheduler's lifecycle."""

    NOT_OPENED = "not opened"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


#: Bound once, as :data:`opsched.core.requests.DONE` is (read at every submission).
OPEN = SchedulerState.OPEN


@attrs.define(eq=False)
class Engine:
    """One scheduler's state and the paths of its requests (see the module docstring)."""

    config: SchedulerConfig
    device: Device
    loop: LoopHandle
    #: Records a timeline trace when set (``open_scheduler(trace=...)``).
    tracer: Tracer | None = attrs.field(default=None, kw_only=True)
    state: SchedulerState = attrs.field(default=SchedulerState.NOT_OPENED, init=False)
    queue: RequestQueue = attrs.field(factory=RequestQueue, init=False)
    admission: Admission = attrs.field(init=False)
    checks: Checks = attrs.field(init=False)
    counters: Counters = attrs.field(factory=Counters, init=False)
    product: Product = attrs.field(init=False)
    dispatcher: Dispatcher = attrs.field(init=False)
    #: Keeps the default scheduler's service task alive (asyncio holds tasks weakly).
    service: Any = attrs.field(default=None, init=False)
    #: The id of the next request of this engine (a count's own ``__next__``: no Python
    #: call), for its checks and graph runs to number the records they make.
    new_id: Callable[[], int] = attrs.field(factory=lambda: itertools.count().__next__, init=False)
    _wake: LoopEvent | None = attrs.field(default=None, init=False)
    _wake_at: float | None = attrs.field(default=None, init=False)
    _loop_thread: int = attrs.field(factory=threading.get_ident, init=False)
    #: ``self._withdraw_posted``, bound once: each queued thread request's future holds it
    #: (a bound method per request would be one more object for the collector to walk).
    _withdraw_hook: Any = attrs.field(default=None, init=False)
    #: Set in a process forked from the one that made this engine: that process's pid.
    _forked_from: int | None = attrs.field(default=None, init=False)
    #: Whether requests may ever run in their caller (the device can; no trace and no
    #: ``max_delay_us`` asks for the dispatcher): fixed when the engine is made.
    _solo_capable: bool = attrs.field(default=False, init=False)
    #: The largest request that runs at submit: one the dispatcher would launch alone and
    #: inline (at most ``inline_max_bytes``, not split across streams).
    _solo_max_bytes: int = attrs.field(default=0, init=False)
    #: Requests run at submit since a waiter last yielded to the loop, and how many may
    #: return without yielding (:data:`YIELD_EVERY` - 1 on asyncio, 0 on trio).
    _unyielded: int = attrs.field(default=0, init=False)
    _unyielded_max: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        _LIVE.add(self)
        self.product = resolve_product(
            self.config.product, self.device.reported_product, self.device.name
        )
        self.admission = Admission(self.config.max_queued_requests, self.queue, self.loop)
        self.checks = Checks(self.device, self.product, self.new_id)
        self._withdraw_hook = self._withdraw_posted
        self.dispatcher = Dispatcher(self)
        config = self.config
        self._solo_capable = (
            self.device.runs_in_caller and self.tracer is None and not config.max_delay_us
        )
        self._solo_max_bytes = min(config.inline_max_bytes, config.split_min_bytes - 1)
        self._unyielded_max = YIELD_EVERY - 1 if self.loop.library == "asyncio" else 0

    # ------------------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Start accepting requests (once)."""
        if self.state is not SchedulerState.NOT_OPENED:
            msg = f"scheduler is {self.state.value}; a scheduler opens once"
            raise RuntimeError(msg)
        self.state = SchedulerState.OPEN

    def orphan(self, parent: int) -> None:
        """In a forked child: this engine's loop and stream threads stayed in the parent
        (``parent``), so every call must fail clearly instead of waiting for them."""
        self._forked_from = parent
        self.state = SchedulerState.CLOSED
        # a parent thread may have held the admission lock at the fork: never touch it
        self.admission = Admission(self.config.max_queued_requests, self.queue, self.loop)
        self.admission.open = False

    def require_open(self, what: str) -> None:
        """Raise SchedulerClosedError unless the scheduler accepts ``what`` now."""
        if self._forked_from is not None:
            msg = (
                f"this scheduler belongs to process {self._forked_from}; its threads did not "
                f"survive the fork into process {os.getpid()}: open a new scheduler here"
            )
            raise SchedulerClosedError(msg)
        if self.state is not SchedulerState.OPEN:
            msg = f"the scheduler is {self.state.value}; it accepts no {what}"
            raise SchedulerClosedError(msg)
        lost = self.device.lost
        if lost is not None:
            raise device_lost(self.device.name, lost)

    async def serve(self) -> None:
        """The service task: the one timer, for ``max_delay_us`` and for the earliest
        deadline of a queued request; returns when the scheduler closes."""
        while self.state is not SchedulerState.CLOSED:
            self._wake = self.loop.new_event()
            if self._wake_at is None:
                await self._wake.wait()
            else:
                with anyio.move_on_after(max(0.0, self._wake_at - time.monotonic())):
                    await self._wake.wait()
                self._wake_at = None
                self._expire_due()
                self.dispatcher.dispatch()

    async def aclose(self, *, cancel_pending: bool = False) -> None:
        """Refuse new requests, then drain (or fail) the pending ones."""
        if self.state is SchedulerState.CLOSED:
            return
        self.state = SchedulerState.CLOSING
        self.admission.close()
        if cancel_pending:
            self._fail_queued()
        await self.dispatcher.drained()
        self._shutdown()

    def close_now(self) -> None:
        """Close without waiting (the loop is ending): fail what is queued, stop streams."""
        if self.state is SchedulerState.CLOSED:
            return
        self.state = SchedulerState.CLOSING
        self.admission.close()
        self._fail_queued()
        self._shutdown()

    def _shutdown(self) -> None:
        self.state = SchedulerState.CLOSED
        self.dispatcher.closed = True
        self.admission.close()  # parked submitters raise SchedulerClosedError
        self.device.close()
        if self.tracer is not None:
            self.tracer.write()
        if self._wake is not None:
            self._wake.set()

    def _fail_queued(self) -> None:
        for request in self.queue.drain():
            error = SchedulerClosedError("the scheduler was closed before it launched")
            finish(request, RequestState.CANCELLED, self.counters, error)
        self.room()

    def statistics(self) -> SchedulerStatistics:
        """A frozen snapshot of the counters (the loop's and the threads')."""
        c, t = self.counters, self.admission.thread_counts
        solo = c.solo_launches
        launches = c.launches + t.launches + solo
        return SchedulerStatistics(
            submitted=c.submitted + t.submitted,
            completed=c.completed + t.completed,
            failed=c.failed + t.failed,
            cancelled=c.cancelled,
            expired=c.expired + t.expired,
            rejected=c.rejected + self.admission.thread_refused,
            queued=len(self.queue),
            queued_peak=self.queue.peak,
            running=self.dispatcher.running,
            launches=launches,
            requests_per_launch_mean=(c.served + t.served + solo) / launches if launches else 0.0,
            requests_per_launch_max=max(c.per_launch_max, t.per_launch_max, min(solo, 1)),
            backpressure_waits=c.backpressure_waits + self.admission.thread_waits,
            graph_runs=c.graph_runs,
            graph_nodes=c.graph_nodes,
            finished_twice=c.finished_twice + t.finished_twice,
            streams=with_solo(
                [s.statistics() for s in self.device.streams],
                solo,
                c.solo_seconds,
            ),
            pool=self.device.memory_statistics(),
            executor_cache=self.device.executor_statistics(),
        )

    # ----------------------------------------------------------------------- submission

    async def submit(self, call: Call) -> Any:
        """A coroutine's call, from its arguments to its result (the face's ``submit``)."""
        op, args, out, priority, deadline, timeout = call
        if (
            out is None
            and deadline is None
            and timeout is None
            and type(priority) is int
            and self.state is OPEN
            and self.device.lost is None
            and self.admission.has_room()
        ):
            # The common case: a call seen before, room in the queue. One cache lookup,
            # one record, one queue operation, then the wait.
            try:
                known = self.checks.known(op, args, priority)
            except BaseException:  # refused (the device's bind): counted, as below
                self.counters.rejected += 1
                raise
            if known is not None:
                request = self.admit(known)
                if request.finished:
                    if self._unyielded < self._unyielded_max:
                        self._unyielded += 1  # ran at submit: no yield this time (YIELD_EVERY)
                        return request.returned()
                    return await self.wait(request)
                new_future = self.loop.new_future
                if new_future is None:  # trio: an event (:meth:`wait`)
                    return await self.wait(request)
                # Its one waiter, this task, awaits a bare future here: what :meth:`wait`
                # does for it, without a coroutine of its own around the await.
                request.waiting = 1
                request.waiter = future = new_future()
                self._unyielded = 0  # this task yields to the loop now (YIELD_EVERY)
                try:
                    await future
                    if self.loop.scoped and self.loop.cancelled():
                        await self.loop.checkpoint()
                except BaseException:
                    self._left(request)
                    raise
                request.waiting = 0
                return request.returned()
        request = self._checked_counted(call)
        if not self.admission.has_room():
            self.counters.backpressure_waits += 1
            await self.admission.wait_for_room()
            self.require_open("new requests")
        return await self.wait(self.admit(request))

    def submit_nowait(self, call: Call) -> Request:
        """Queue a call without waiting (the face wraps the record in a ``Pending``)."""
        request = self._checked_counted(call)
        if not self.admission.has_room():
            self.counters.rejected += 1
            msg = f"{len(self.queue)} requests are queued (max_queued_requests)"
            raise QueueFullError(msg)
        return self.admit(request)

    def submit_threadsafe(self, call: Call) -> Future[Any]:
        """A thread's call, checked in that thread and handed to the loop."""
        if threading.get_ident() == self._loop_thread:
            msg = "submit_threadsafe was called on the scheduler's own loop thread; await instead"
            raise RuntimeError(msg)
        try:
            if self.state is not OPEN or self.device.lost is not None:
                self.require_open("new requests")  # raises
            request = self.checks.call(call)  # (one lookup for a call seen before)
        except BaseException:
            self.admission.refused_in_thread()
            raise
        future = new_request_future()
        if not self.admission.put_threadsafe(request, future, self._drain_inbox):
            future.checked = None  # nothing will queue it: let go of its arrays
            future.set_exception(SchedulerClosedError("the scheduler's event loop has ended"))
        return future

    def call_threadsafe(self, call: Call) -> Any:
        """A thread's blocking call: its solo launch in that thread when the scheduler is
        idle (:meth:`runs_in_thread`), else submitted and waited for."""
        if self.runs_in_thread():
            return self._run_in_thread(call)
        return self.submit_threadsafe(call).result()

    def _checked_call(self, call: Call) -> Request:
        """A call's checked request (any thread; :meth:`Checks.call`)."""
        if self.state is not OPEN or self.device.lost is not None:
            self.require_open("new requests")  # raises
        return self.checks.call(call)

    def _checked_counted(self, call: Call) -> Request:
        """A call checked on the loop thread, a refusal counted as rejected."""
        try:
            return self._checked_call(call)
        except BaseException:
            self.counters.rejected += 1
            raise

    def admit(self, request: Request) -> Request:
        """Start the journey of a request checked on the loop thread: finished at once when
        it has nothing to compute, run now when it may (:meth:`runs_at_submit`), else
        queued and its dispatch decided."""
        self.counters.submitted += 1
        if not request.nbytes:  # an empty tensor: nothing to compute, nothing to launch
            self.finish_empty(request)
            return request
        queue = self.queue
        if self.runs_at_submit(request):
            self.run_at_submit(request)  # nothing would join it: its solo launch, now
            return request
        queue.push(request)  # (:meth:`enqueue`, without the call)
        if request.deadline is not None:
            self.arm_timer(request.deadline)
        dispatcher = self.dispatcher
        if dispatcher.pending:  # a burst: the dispatch already scheduled takes it too
            return request
        if not self.loop.ready():
            dispatcher.dispatch()  # nobody else can join this batch: launch now, no loop hop
        else:
            dispatcher.schedule()  # others are about to submit: let them, then fuse
        return request

    def _drain_inbox(self) -> None:
        """Queue every request submitted from threads since the last drain (loop thread),
        together (:meth:`enqueue_all`); one whose future was cancelled while in the inbox
        ends cancelled, never queued."""
        queued: list[Request] = []
        withdrawn = False
        counters, hook = self.counters, self._withdraw_hook
        for future in self.admission.take_inbox():
            request, future.checked = future.checked, None
            assert request is not None  # put_threadsafe set it
            if self.state is not OPEN:
                future.set_exception(SchedulerClosedError("the scheduler was closed"))
                continue
            request.future = future
            counters.submitted += 1
            if not request.nbytes:
                self.finish_empty(request)
                continue
            # linked first, then looked at: a cancel from now on withdraws it through the
            # hook (on the loop, after this drain), one before it left the flag
            future._request, future._withdraw = request, hook
            if future.withdrawn:
                finish(request, RequestState.CANCELLED, counters)
                withdrawn = True
            else:
                queued.append(request)
        if queued:
            self.enqueue_all(queued)
        if withdrawn:
            self.room()  # the inbox held its slot

    def _withdraw_posted(self, request: Request) -> None:
        """A thread's future was cancelled (any thread): withdraw its request on the loop."""
        self.loop.post(self._abandon_cancelled, request)

    def _abandon_cancelled(self, request: Request) -> None:
        if not request.finished:
            self.abandon(request)

    # ------------------------------------------------------------------- where it runs

    def runs_in_thread(self) -> bool:
        """Whether a thread's lone request may run in that thread now: nothing is queued
        or running, so nothing could join its launch (racy reads, as hints: at worst a
        request that could have fused runs alone, with the same bits)."""
        return (
            self._solo_capable
            and not self.queue.live
            and not self.dispatcher.inflight
            and self.admission.open  # False once closing, closed or orphaned by a fork
            and not self.admission.inbox  # (a racy read: a hint)
            and threading.get_ident() != self._loop_thread
        )

    def runs_at_submit(self, request: Request, *, alone: bool = True) -> bool:
        """Whether a coroutine's (or a graph node's) new ``request`` may run at submit, in
        the loop thread: no launch is in flight, the request is one the dispatcher would
        launch alone and inline (at most ``inline_max_bytes``, not split across streams),
        and waiting for company would gain it nothing: nothing is queued and at most
        :data:`FEW_READY` others are ready to run on the loop (so few could join it that
        their fused launch would cost more); or (``alone``: a coroutine's request) its
        device says company gains a request of its operator and size nothing
        (:attr:`~opsched.devices.Device.runs_alone_from`) and nothing of its launch key
        is queued, however many others are about to submit: queued requests of other
        keys would share none of its launch (it runs before them, as they wait for the
        dispatcher's turn of the loop), and queued itself it would gain nothing a second
        stream could give it: the queue's round trip (the dispatcher's round, the launch's
        bookkeeping, the waiter's wake-up) and a hand-off to a stream's thread and back
        cost more than the kernel time two streams save on requests the loop may run
        inline (``opsched bench scheduler --parts targets --target-groups medium``: 256
        KiB and 1 MiB requests, 32 coroutines). Its waiter still yields to the loop now
        and then (:data:`YIELD_EVERY`)."""
        nbytes = request.nbytes
        if not (
            0 < nbytes <= self._solo_max_bytes
            and self._solo_capable
            and not self.dispatcher.inflight
        ):
            return False
        queue = self.queue
        if alone:  # first: it asks neither the loop nor, with nothing queued, the queue
            alone_from = self.device.runs_alone_from.get(request.op.name)
            if (  # (an operator the device does not name: never)
                alone_from is not None
                and alone_from <= nbytes
                and (not queue.live or not queue.queued_bytes(request.key))
            ):
                return True
        return not queue.live and self.loop.ready() <= FEW_READY

    def run_at_submit(self, request: Request, *, outputs_made: bool = False) -> None:
        """Run a recorded, not yet queued ``request`` now (:meth:`runs_at_submit` said so)
        and finish it: its waiter finds it finished. ``outputs_made``: every output it
        has was made for it by the device (a graph node's: :meth:`Device.run_solo`)."""
        launched_at = time.monotonic()
        start = time.perf_counter()
        state, error = self._solo_launch(request, outputs_made)
        end = time.perf_counter()
        counters = self.counters  # (it was counted as submitted when it was recorded)
        launched = state is not EXPIRED
        if launched:  # a launch of stream 0, which is idle (the snapshot adds it there)
            counters.solo_launches += 1
            counters.solo_seconds += end - start
        finish(request, state, counters, error)
        if launched and enabled():  # the dispatcher's launch event, as for any launch
            batch = Batch([request], 0, request.key, False, launched_at=launched_at)
            log_launch(request.op, batch, (None, start, end) if error is None else None)

    def _run_in_thread(self, call: Call) -> Any:
        """A thread's lone blocking call (:meth:`runs_in_thread` said so), checked, run and
        finished in that thread; returns its result or raises its error."""
        admission = self.admission
        try:
            request = self._checked_call(call)
        except BaseException:
            admission.refused_in_thread()
            raise
        counts = admission.thread_counts
        state, error = self._solo_launch(request)
        with admission.lock:  # submitted, launched and finished at once: one lock round
            counts.submitted += 1
            if request.nbytes and state is not EXPIRED:
                counts.launched(1)
            finish(request, state, counts, error)
        if error is not None:
            raise error
        return request.outcome()

    def _solo_launch(
        self, request: Request, outputs_made: bool = False
    ) -> tuple[RequestState, BaseException | None]:
        """The solo launch of ``request`` in this thread: how it ended, and its error
        (``outputs_made``: as :meth:`run_at_submit`)."""
        if request.deadline is not None and past_deadline(request):
            error = DeadlineExceededError(
                f"{request.op.name}: the deadline had passed when the request was submitted; "
                "it was not launched"
            )
            return EXPIRED, error
        if request.nbytes:
            try:
                self.device.run_solo(request, outputs_made=outputs_made)
            except Exception as exc:
                return RequestState.FAILED, launch_error(request, exc)
        return DONE, None

    # ------------------------------------------------------------------------- waiting

    async def wait(self, request: Request) -> Any:
        """Wait for ``request``'s outcome in the calling task; a cancelled last waiter
        withdraws it."""
        loop = self.loop
        request.waiting += 1
        self._unyielded = 0  # this task yields to the loop now (YIELD_EVERY)
        try:
            if request.finished:  # finished inline at submit: still yield once
                await loop.checkpoint()
            elif request.waiter is None and loop.new_future:
                # the common case: one task waits on a bare future (a deadline is the
                # engine's: a request still queued then is expired, which wakes it)
                request.waiter = future = loop.new_future()
                await future
            else:  # a second task (a Pending's), or on trio
                await self._event(request).wait()
            if loop.scoped and loop.cancelled():
                await loop.checkpoint()
        except BaseException:
            self._left(request)
            raise
        request.waiting -= 1
        return request.returned()

    def _left(self, request: Request) -> None:
        """A task awaiting ``request`` stopped (cancelled): the last one withdraws it."""
        request.waiting -= 1
        if not request.finished and not request.waiting:
            self.abandon(request)

    def _event(self, request: Request) -> LoopEvent:
        """The event a task waits on for ``request`` when it has a deadline or is not its
        only waiter: its first waiter's, which a bare future's becomes."""
        done = request.waiter
        if done is None or isinstance(done, FUTURE):  # none yet, or the first's bare future
            done = request.waiter = upgrade_waiter(done, self.loop.new_event)
        return done

    # ------------------------------------------------------------ queue, expiry, room

    def finish_empty(self, request: Request) -> None:
        """Finish a request of empty tensors at submit: nothing to launch. Its deadline
        still holds: one already past expires, as it would in the queue."""
        if past_deadline(request):
            self.expired(request)
        else:
            finish(request, RequestState.DONE, self.counters)

    def abandon(self, request: Request) -> None:
        """The caller stopped waiting (cancellation)."""
        if request.state is RequestState.QUEUED:
            self.queue.discard(request, RequestState.CANCELLED)
            finish(request, RequestState.CANCELLED, self.counters)
            self.room()
        else:
            request.abandoned = True  # running: its launch finishes, the result is dropped

    def drop(self, request: Request, error: BaseException) -> None:
        """Fail a queued request that must never launch (a graph node whose producer
        failed)."""
        if request.state is RequestState.QUEUED:
            self.queue.discard(request, RequestState.FAILED)
            finish(request, RequestState.FAILED, self.counters, error)
            self.room()

    def _expire_due(self) -> None:
        """Expire the queued requests whose deadline passed; arm the timer for the next."""
        for request in self.queue.expire_due(time.monotonic()):
            self.expired(request)
        upcoming = self.queue.next_deadline()
        if upcoming is not None:
            self.arm_timer(upcoming)

    def enqueue(self, request: Request) -> None:
        """Queue ``request``; its deadline sets the one timer if it is the earliest."""
        self.queue.push(request)
        if request.deadline is not None:
            self.arm_timer(request.deadline)

    def enqueue_all(self, requests: list[Request]) -> None:
        """Queue new ``requests`` (:meth:`enqueue` each, in order) and have the dispatcher
        take them at its next turn."""
        self.queue.push_all(requests)
        deadlines = [r.deadline for r in requests if r.deadline is not None]
        if deadlines:
            self.arm_timer(min(deadlines))
        self.dispatcher.schedule()

    def expired(self, request: Request) -> None:
        """Finish a request whose deadline passed before its launch."""
        late = time.monotonic() - (request.deadline or 0.0)
        error = DeadlineExceededError(
            f"{request.op.name}: the deadline passed {late * 1e3:.3f} ms ago while the "
            "request was queued; it was not launched"
        )
        finish(request, RequestState.EXPIRED, self.counters, error)
        self.room()

    def room(self) -> None:
        """Requests left the queue: wake as many parked submitters as there are free
        slots (FIFO); queue what threads handed over if room is left."""
        if self.admission.wake():
            self._drain_inbox()

    def arm_timer(self, wake_at: float) -> None:
        """Have the service task dispatch at ``wake_at`` (``time.monotonic()``)."""
        if self._wake_at is None or wake_at < self._wake_at:
            self._wake_at = wake_at
            if self._wake is not None:
                self._wake.set()
