"""The scheduler: lifecycle, submit, dispatch, start, complete.

The path of one request (``docs/architecture.md``): the caller's coroutine has the request
checked (:mod:`opsched.core.checks`, cached by signature) and queued (admission, one record,
one queue operation), then waits on the request's event. A dispatch step, scheduled once per
loop iteration however many requests arrived, runs the pure :func:`form_batches` on the idle
streams and starts each batch: the device prepares it (executor, workspace: the device's
own business) and its stream runs it, inline when tiny and the stream is idle. The stream
hands the launch back to the loop with one call; the loop finishes every request of the
launch (:func:`~opsched.core.requests.finish`) and dispatches again.

Concurrency rules: all scheduler state changes on the loop thread, inside non-awaiting
methods; the only code in stream threads is a launch's own work. Every batch formation and
every launch runs inside an exception boundary that fails only the requests concerned.

The core knows devices only through :class:`~opsched.devices.Device` and operators only
through their descriptions: it never names either. The per-operator methods of the public
:class:`opsched.Scheduler` are generated over :meth:`Scheduler.submit`.
"""

from __future__ import annotations

import bisect
import enum
import itertools
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import anyio
import attrs

from opsched._errors import (
    DeadlineExceededError,
    InnerError,
    QueueFullError,
    RuntimeLaunchError,
    SchedulerClosedError,
)
from opsched.core.admission import Admission
from opsched.core.batching import Batch, RequestQueue, form_batches
from opsched.core.checks import Checked, Checks, deadline_of, priority_of
from opsched.core.config import SchedulerConfig
from opsched.core.graph import GraphBuilder, Node, Placeholder
from opsched.core.graph_run import run_graph
from opsched.core.loop import LoopEvent, LoopHandle
from opsched.core.requests import Pending, Request, RequestState, finish
from opsched.core.stats import Counters, SchedulerStatistics
from opsched.core.trace import Tracer, log_failure, log_launch, log_overflow, trace_launch
from opsched.devices import Device, Prepared
from opsched.ops import Operator
from opsched.ops.products import Product, resolve_product

__all__ = ["Scheduler", "SchedulerState"]


class SchedulerState(enum.Enum):
    """A scheduler's lifecycle."""

    NOT_OPENED = "not opened"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@attrs.define(eq=False)
class _Launch:
    """A started batch: what its completion needs."""

    batch: Batch
    op: Operator
    prepared: Prepared


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
    _idle: list[int] = attrs.field(init=False)
    _running: int = attrs.field(default=0, init=False)
    _inflight: int = attrs.field(default=0, init=False)
    _ids: itertools.count[int] = attrs.field(factory=itertools.count, init=False)
    _dispatch_pending: bool = attrs.field(default=False, init=False)
    _memory_wait: bool = attrs.field(default=False, init=False)
    _quiet: LoopEvent | None = attrs.field(default=None, init=False)
    _wake: LoopEvent | None = attrs.field(default=None, init=False)
    _wake_at: float | None = attrs.field(default=None, init=False)
    _launching: dict[int, _Launch] = attrs.field(factory=dict, init=False)
    _loop_thread: int = attrs.field(factory=threading.get_ident, init=False)
    #: Keeps the default scheduler's service task alive (asyncio holds tasks weakly).
    _service: Any = attrs.field(default=None, init=False)
    #: Records a timeline trace when set (``open_scheduler(trace=...)``).
    _tracer: Tracer | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        self._product = resolve_product(
            self.config.product, self.device.reported_product, self.device.name
        )
        self._admission = Admission(self.config.max_queued_requests, self._queue, self._loop)
        self._checks = Checks(self.device, self._product)
        self._idle = list(range(len(self.device.streams)))

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
        per-operator methods (``sched.glu_backward(...)``) are this with named arguments.

        Raises:
            ParamNullptrError, ParamInvalidError, InnerError, TypeError: bad arguments, at
                submit time.
            DeadlineExceededError: the deadline passed while the request was queued.
            RuntimeLaunchError: the launch failed; the kernel's exception is chained.
            SchedulerClosedError: the scheduler is closed, or closed with the request pending.
        """
        tensors, scalars = op.arguments(args, out)
        checked = self._checked_counted(op, tensors, scalars, priority, deadline, timeout)
        if not self._admission.has_room():  # the common case needs no extra coroutine
            if self._admission.full():
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
        tensors, scalars = op.arguments(args, out)
        checked = self._checked_counted(op, tensors, scalars, priority, deadline, timeout)
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
        tensors, scalars = op.arguments(args, out)
        checked = self._checked(op, tensors, scalars, priority, deadline, timeout)
        future: Future[Any] = Future()
        if not self._admission.put_threadsafe(checked, future, self._drain_inbox):
            future.set_exception(SchedulerClosedError("the scheduler's event loop has ended"))
        return future

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
        c = self._counters
        return SchedulerStatistics(
            submitted=c.submitted,
            completed=c.completed,
            failed=c.failed,
            cancelled=c.cancelled,
            expired=c.expired,
            rejected=c.rejected,
            queued=len(self._queue),
            queued_peak=self._queue.peak,
            running=self._running,
            launches=c.launches,
            requests_per_launch_mean=c.served / c.launches if c.launches else 0.0,
            requests_per_launch_max=c.per_launch_max,
            backpressure_waits=c.backpressure_waits + self._admission.thread_waits,
            graph_runs=c.graph_runs,
            graph_nodes=c.graph_nodes,
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
        while len(self._queue) or self._inflight:
            self._quiet = self._loop.new_event()
            self._schedule_dispatch()
            await self._quiet.wait()
        self._shutdown()

    # ------------------------------------------------------------------ lifecycle (internal)

    def _open(self) -> None:
        if self._state is not SchedulerState.NOT_OPENED:
            msg = f"scheduler is {self._state.value}; a scheduler opens once"
            raise RuntimeError(msg)
        self._state = SchedulerState.OPEN

    def _require_open(self, what: str) -> None:
        if self._state is not SchedulerState.OPEN:
            msg = f"the scheduler is {self._state.value}; it accepts no {what}"
            raise SchedulerClosedError(msg)

    async def _serve(self) -> None:
        """Service task: timers for ``max_delay_us``; returns when the scheduler closes."""
        while self._state is not SchedulerState.CLOSED:
            self._wake = self._loop.new_event()
            if self._wake_at is None:
                await self._wake.wait()
            else:
                with anyio.move_on_after(max(0.0, self._wake_at - time.monotonic())):
                    await self._wake.wait()
                self._wake_at = None
                self._dispatch()

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

    def _checked(
        self,
        op: Operator,
        tensors: dict[str, Any],
        scalars: dict[str, Any],
        priority: int,
        deadline: float | None,
        timeout: float | None,
    ) -> Checked:
        """Everything a request needs that touches no scheduler state (any thread)."""
        self._require_open("new requests")
        deadline = deadline_of(deadline, timeout)
        return self._checks.check(op, tensors, scalars, priority_of(priority), deadline)

    def _checked_counted(self, *args: Any) -> Checked:
        """:meth:`_checked`, counting a refusal as rejected."""
        try:
            return self._checked(*args)
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
            time.monotonic(), done=self._loop.new_event(), signature=signature,
            convert=convert,
        )  # fmt: skip

    def _admit(self, checked: Checked, future: Future[Any] | None = None) -> Request:
        """Queue a checked request (or finish it at once if it has nothing to compute).

        ``future``: the request came from a thread, which holds that future; it gets a
        deadline timer of its own (no coroutine waits for it) and the dispatch is deferred
        to after the whole drained burst.
        """
        request = self._record(*checked)
        request.future = future
        self._counters.submitted += 1
        if not request.nbytes:  # an empty tensor: nothing to compute, nothing to launch
            self._finish_empty(request)
            return request
        self._queue.push(request)
        if future is not None:
            future.add_done_callback(self._future_done(request))
            if request.deadline is not None:
                delay = request.deadline - time.monotonic()
                self._loop.call_later(delay, self._deadline_reached, request)
            self._schedule_dispatch()
            return request
        if self._loop.idle() and not self._dispatch_pending:
            self._dispatch()  # nobody else can join this batch: launch now, no loop hop
        else:
            self._schedule_dispatch()  # others are about to submit: let them, then fuse
        return request

    def _drain_inbox(self) -> None:
        """Queue every request submitted from threads since the last drain (loop thread)."""
        for checked, future in self._admission.take_inbox():
            if self._state is not SchedulerState.OPEN:
                future.set_exception(SchedulerClosedError("the scheduler was closed"))
                continue
            self._admit(checked, future)

    def _future_done(self, request: Request) -> Any:
        def done(future: Future[Any]) -> None:
            if future.cancelled():  # cancelled by its owner thread: withdraw on the loop
                self._loop.post(self._abandon_cancelled, request)

        return done

    def _abandon_cancelled(self, request: Request) -> None:
        if not request.done.is_set():
            self._abandon(request)

    def _deadline_reached(self, request: Request) -> None:
        if request.state is RequestState.QUEUED:
            self._expire(request)

    # ------------------------------------------------------------------------- waiting

    async def _wait(self, request: Request) -> Any:
        done = request.done
        cancel_check = self._loop.cancel_check
        try:
            if done.is_set():  # finished inline at submit: still yield once
                await self._loop.checkpoint()
            elif request.deadline is None:  # the common case
                await done.wait()
            else:
                with anyio.move_on_after(request.deadline - time.monotonic()):
                    await done.wait()
                if not done.is_set():
                    if request.state is RequestState.QUEUED:
                        self._expire(request)
                    else:  # launched before its deadline: the result is on its way
                        await done.wait()
            if cancel_check is not None:
                await cancel_check()
        except BaseException:
            if not done.is_set():
                self._abandon(request)
            raise
        if request.state is RequestState.DONE:
            return request.outcome()
        assert request.error is not None
        raise request.error

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

    def _expire(self, request: Request) -> None:
        """A queued request's deadline passed: out of the queue, expired."""
        self._queue.discard(request, RequestState.EXPIRED)
        self._expired(request)

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

    # ------------------------------------------------------------------------ dispatch

    def _schedule_dispatch(self) -> None:
        if not self._dispatch_pending:
            self._dispatch_pending = True
            self._loop.call_soon(self._dispatch)

    def _dispatch(self) -> None:
        """Start launches on the idle streams (runs on the loop thread, never awaits)."""
        self._dispatch_pending = False
        if self._state is SchedulerState.CLOSED:
            return
        tracer = self._tracer
        if tracer is not None:
            tracer.counters(len(self._queue), *self.device.memory_usage())
        while self._idle and len(self._queue) and not self._memory_wait:
            taken: list[Request] = []
            self._queue.taken = taken
            try:
                batches, expired, wake_at = form_batches(
                    self._queue, self._idle, self.config, time.monotonic()
                )
            except Exception as exc:  # a bug in batch formation fails its requests only
                self._fail_requests(taken, exc, "batch formation failed")
                self._idle = sorted(set(range(len(self.device.streams))) - set(self._launching))
                continue
            finally:
                self._queue.taken = None
            for request in expired:
                self._expired(request)
            if wake_at is not None:
                self._arm_timer(wake_at)
            if not batches:
                break
            groups = [list(g) for _, g in itertools.groupby(batches, key=_group_key)]
            for i, group in enumerate(groups):
                if not self._start(group):  # out of workspace: the rest waits too
                    for later in groups[i + 1 :]:
                        self._requeue(later)
                    break
        self._wake_space()  # launched requests left the queue: backpressured callers go on
        if tracer is not None:
            tracer.counters(len(self._queue), *self.device.memory_usage())
        self._check_quiet()

    def _arm_timer(self, wake_at: float) -> None:
        if self._wake_at is None or wake_at < self._wake_at:
            self._wake_at = wake_at
            if self._wake is not None:
                self._wake.set()

    def _requeue(self, group: list[Batch]) -> None:
        """Put a group's requests back in the queue and its streams back to idle."""
        for request in group[0].requests:
            request.state = RequestState.QUEUED
            self._queue.push(request)
        for batch in group:
            bisect.insort(self._idle, batch.stream)

    def _start(self, group: list[Batch], *, overflow: bool = False) -> bool:
        """Start a fused batch, a solo request, or every part of a split request.

        Returns False when the device is out of workspace: the group went back to the
        queue. With ``overflow``, workspace may exceed the cap (see :meth:`_out_of_memory`).
        """
        prepared: list[tuple[Batch, Prepared]] = []
        try:
            for batch in group:
                ready = self.device.prepare(batch, overflow=overflow)
                if ready is None:
                    for _, p in prepared:
                        self.device.release(p.token)
                    return self._out_of_memory(group)
                prepared.append((batch, ready))
        except Exception as exc:  # boundary: fail this group's requests, keep dispatching
            for _, p in prepared:
                self.device.release(p.token)
            self._idle.extend(b.stream for b in group)
            self._idle.sort()
            self._fail_requests(group[0].requests, exc, "starting the launch failed")
            return True
        now = time.monotonic()
        requests = group[0].requests
        for request in requests:
            request.state = RequestState.RUNNING
            request.launched_at = now
            request.parts_left = len(group)
        self._running += len(requests)
        for batch, ready in prepared:
            self._launch(batch, ready)
        return True

    def _launch(self, batch: Batch, prepared: Prepared) -> None:
        launch = _Launch(batch, batch.requests[0].op, prepared)
        self._inflight += 1
        self._launching[batch.stream] = launch
        self._counters.launched(len(batch.requests))
        stream = self.device.streams[batch.stream]
        # Graph nodes: wait on the device for producers still running (no Python wait), and
        # tell each run when its node is launched, so its consumers can be queued at once.
        waits = [e for r in batch.requests if r.waits for e in r.waits if not e.query()]
        nodes = [r for r in batch.requests if r.graph is not None]
        inline = (
            self.device.inline_capable and batch.nbytes <= self.config.inline_max_bytes
            and not waits
        )  # fmt: skip
        if inline:
            # Consumers queued by launched() are dispatched only after this returns, when
            # the inline run is over: they need no event to wait on.
            for r in nodes:
                r.graph[0].launched(r.graph[1], None)
            stream.run_inline(
                prepared.work, lambda result, error: self._complete(launch, result, error)
            )
            return
        self.device.wait_events(stream, waits)
        post = self._loop.post

        def done(result: Any, error: BaseException | None) -> None:
            post(self._complete, launch, result, error)  # False: the loop ended, drop it

        stream.enqueue(prepared.work, done)
        if nodes:
            event = stream.record_event()
            for r in nodes:
                r.graph[0].launched(r.graph[1], event)

    def _out_of_memory(self, group: list[Batch]) -> bool:
        batch = group[0]
        if self._inflight == 0 and batch.fused and len(batch.requests) > 1:
            # Nothing in flight will return memory: launch fewer requests, requeue the rest.
            half = len(batch.requests) // 2
            for request in batch.requests[half:]:
                self._queue.push(request)
            smaller = Batch(batch.requests[:half], batch.stream, batch.key, True)
            return self._start([smaller])
        if self._inflight == 0:
            # Still nothing in flight: the memory is held by graph intermediates that only
            # this work would free. Waiting would never end; overflow the cap instead.
            log_overflow(len(batch.requests))
            return self._start(group, overflow=True)
        self._requeue(group)
        self._memory_wait = True  # until a launch completes and returns its workspace
        return False

    # ---------------------------------------------------------------------- completion

    def _complete(self, launch: _Launch, result: Any, error: BaseException | None) -> None:
        """One launch finished (called on the loop thread): finish its requests."""
        self._inflight -= 1
        batch = launch.batch
        self._launching.pop(batch.stream, None)
        self.device.release(launch.prepared.token)
        self._memory_wait = False
        bisect.insort(self._idle, batch.stream)
        errors: dict[int, BaseException] = result[0] if error is None else {}
        for request in batch.requests:
            cause = error if error is not None else errors.get(request.id)
            if cause is not None and request.error is None:
                request.error = _launch_error(request, cause)
            request.parts_left -= 1
            if request.parts_left <= 0:
                self._running -= 1
                self._resolve(request)
        log_launch(launch.op, batch, result if error is None else None)
        if self._tracer is not None:
            outcome = result if error is None else None
            trace_launch(self._tracer, launch.op, batch, launch.prepared.cache_hit, outcome)
            self._tracer.counters(len(self._queue), *self.device.memory_usage())
        if len(self._queue):
            self._schedule_dispatch()  # a stream and workspace came free for what waits
        else:
            self._check_quiet()

    def _resolve(self, request: Request) -> None:
        """A launched request's launch is over: its outcome."""
        if request.abandoned:
            finish(request, RequestState.CANCELLED, self._counters)
        elif request.error is not None:
            finish(request, RequestState.FAILED, self._counters)
        else:
            finish(request, RequestState.DONE, self._counters)

    def _fail_requests(self, requests: list[Request], exc: Exception, what: str) -> None:
        for request in requests:
            if request.done.is_set():
                continue
            if request.state is RequestState.RUNNING:
                self._running -= 1
            error = InnerError(f"{request.op.name}: {what}: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            request.error = error
            self._resolve(request)
        log_failure(what, exc, len(requests))

    def _check_quiet(self) -> None:
        if self._quiet is not None and not len(self._queue) and not self._inflight:
            self._quiet.set()
            self._quiet = None


def _group_key(batch: Batch) -> int:
    """Batches started together: every part of one split request, else each batch alone."""
    return id(batch.requests[0]) if batch.part is not None else id(batch)


def _launch_error(request: Request, cause: BaseException) -> BaseException:
    if isinstance(cause, RuntimeLaunchError):
        return cause
    error = RuntimeLaunchError(
        f"{request.op.name}: the launch failed: {type(cause).__name__}: {cause}"
    )
    error.__cause__ = cause
    return error
