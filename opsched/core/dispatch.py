"""Dispatch: queued requests to launches on idle streams, and launches back to requests.

The :class:`Dispatcher` runs the pure :func:`form_batches` over the idle streams, has the
device prepare each batch (executor and workspace are the device's business), starts it on
its stream (inline when tiny and the stream is idle, else through the stream's FIFO, waiting
on the device for graph producers), and, when the stream hands the launch back, finishes
every request of it through :func:`~opsched.core.requests.finish`. Batch formation and
launch start each run inside an exception boundary that fails only the requests concerned.
Everything here runs on the loop thread and never awaits.

It knows devices only through their interface and operators not at all.
"""

from __future__ import annotations

import bisect
import itertools
import time
from typing import TYPE_CHECKING, Any

import attrs

from opsched._errors import InnerError, RuntimeLaunchError, SchedulerClosedError
from opsched.core.batching import MIN_SPREAD_BYTES, Batch, RequestQueue, form_batches
from opsched.core.config import SchedulerConfig
from opsched.core.loop import LoopEvent, LoopHandle
from opsched.core.requests import DONE, RUNNING, Request, RequestState, finish
from opsched.core.stats import Counters
from opsched.core.trace import Tracer, log_failure, log_launch, log_overflow, trace_launch
from opsched.devices import Device, Prepared

if TYPE_CHECKING:
    from opsched.core.engine import Engine

__all__ = ["Dispatcher", "launch_error"]


@attrs.define(eq=False)
class _Launch:
    """A started batch: what its completion needs."""

    batch: Batch
    prepared: Prepared


@attrs.define(eq=False)
class Dispatcher:
    """One engine's dispatcher (see the module docstring): it reads the engine's config,
    device, loop, queue, counters and tracer, and calls back its :meth:`Engine.expired`
    (a request whose deadline passed), :meth:`Engine.room` (requests left the queue) and
    :meth:`Engine.arm_timer` (a dispatch wanted at an instant)."""

    engine: Engine
    config: SchedulerConfig = attrs.field(init=False)
    device: Device = attrs.field(init=False)
    loop: LoopHandle = attrs.field(init=False)
    queue: RequestQueue = attrs.field(init=False)
    counters: Counters = attrs.field(init=False)
    tracer: Tracer | None = attrs.field(init=False)
    #: Requests inside launches now.
    running: int = attrs.field(default=0, init=False)
    #: Launches started and not yet handed back.
    inflight: int = attrs.field(default=0, init=False)
    #: Set once the scheduler has shut down: dispatches do nothing.
    closed: bool = attrs.field(default=False, init=False)
    _idle: list[int] = attrs.field(init=False)
    #: Whether a dispatch is already scheduled (read on the hot path: a plain attribute).
    pending: bool = attrs.field(default=False, init=False)
    _memory_wait: bool = attrs.field(default=False, init=False)
    _launching: dict[int, _Launch] = attrs.field(factory=dict, init=False)
    _quiet: LoopEvent | None = attrs.field(default=None, init=False)
    #: Launches run inline so far.
    _inline_runs: int = attrs.field(default=0, init=False)
    #: Whether the device runs small launches inline (batches of small requests fit them).
    _inline: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        engine = self.engine
        self.config, self.device, self.loop = engine.config, engine.device, engine.loop
        self.queue, self.counters, self.tracer = engine.queue, engine.counters, engine.tracer
        self._idle = list(range(len(self.device.streams)))
        self._inline = self.device.inline_capable and self.config.inline_max_bytes > 0

    def schedule(self) -> None:
        """Dispatch at the next loop turn (once, however many ask)."""
        if not self.pending:
            self.pending = True
            self.loop.call_soon(self.dispatch)

    async def drained(self) -> None:
        """Wait until nothing is queued or in flight."""
        while self.queue.live or self.inflight:
            self._quiet = self.loop.new_event()
            self.schedule()
            await self._quiet.wait()

    def dispatch(self) -> None:
        """Start launches on the idle streams (runs on the loop thread, never awaits)."""
        self.pending = False
        if self.closed:
            return
        if self.device.lost is not None and self.queue.live:
            self._fail_queued_on_lost_device()
            return
        queue, tracer = self.queue, self.tracer
        if tracer is not None:
            self._trace_counters()
        while self._idle and queue.live and not self._memory_wait:
            taken: list[Request] = []
            queue.taken = taken
            try:
                batches, expired, wake_at = form_batches(
                    queue, self._idle, self.config, time.monotonic(), self._inline
                )
            except Exception as exc:  # a bug in batch formation fails its requests only
                if not taken:  # it took none: the next one fails, or this would never end
                    self._pop_next()
                self.fail_requests(taken, exc, "batch formation failed")
                self._idle = sorted(set(range(len(self.device.streams))) - set(self._launching))
                if not taken:  # not even that: the queue itself is broken; stop the round
                    break
                continue
            finally:
                queue.taken = None
            for request in expired:
                self.engine.expired(request)
            if wake_at is not None:
                self.engine.arm_timer(wake_at)
            if not batches:
                break
            groups = [list(g) for _, g in itertools.groupby(batches, key=_group_key)]
            inline_runs = self._inline_runs
            for i, group in enumerate(groups):
                # a large lone request runs inline only as the round's last launch: the
                # others start on their streams first and compute while it runs
                if not self._start(group, last=i == len(groups) - 1):  # out of workspace:
                    for later in groups[i + 1 :]:  # the rest waits too
                        self._requeue(later)
                    break
            if self._inline_runs != inline_runs and self.inflight:
                # A launch ran inline while others computed on their streams: hand the
                # loop back (their completions may be waiting in it), then go on.
                if queue.live:
                    self.schedule()
                break
        self.engine.room()  # launched requests left the queue: backpressured callers go on
        if tracer is not None:
            self._trace_counters()
        self._check_quiet()

    def _fail_queued_on_lost_device(self) -> None:
        """The device was lost for good: fail what is queued, with its cause, instead of
        launching it into the same error."""
        assert self.device.lost is not None
        error = device_lost(self.device.name, self.device.lost)
        for request in self.queue.drain():
            finish(request, RequestState.FAILED, self.counters, error)
        self.engine.room()
        self._check_quiet()

    def _pop_next(self) -> None:
        """Take the next queued request (into ``queue.taken``), if the queue can say which."""
        try:
            key = self.queue.best_key()
            if key is not None:
                self.queue.pop(key)
        except Exception as exc:  # boundary: the caller stops its round instead
            self.loop.report(exc, "opsched: the queue failed to give its next request")

    def _trace_counters(self) -> None:
        """Put the queue's depth and the device's memory on the trace (tracing on). The
        device's figures come from its allocator (an accelerator's: a device error can
        surface there): an error is reported, never raised into the dispatch."""
        assert self.tracer is not None
        try:
            self.tracer.counters(self.queue.live, *self.device.memory_usage())
        except Exception as exc:  # boundary: the trace's, not the requests'
            self.loop.report(exc, "opsched: reading the device's memory for the trace failed")

    def _requeue(self, group: list[Batch]) -> None:
        """Put a group's requests back in the queue and its streams back to idle."""
        for request in group[0].requests:
            request.state = RequestState.QUEUED
            self.queue.push(request)
        for batch in group:
            bisect.insort(self._idle, batch.stream)

    def _start(self, group: list[Batch], *, overflow: bool = False, last: bool = True) -> bool:
        """Start a fused batch, a solo request, or every part of a split request.

        Returns False when the device is out of workspace: the group went back to the
        queue. With ``overflow``, workspace may exceed the cap (see :meth:`_out_of_memory`).
        ``last``: no other launch starts after this group in this dispatch, so its last
        part may run inline however large (see :meth:`_launch`).
        """
        device = self.device
        prepared: list[tuple[Batch, Prepared]] = []
        try:
            for batch in group:
                ready = device.prepare(batch, overflow=overflow)
                if ready is None:  # out of workspace
                    break
                prepared.append((batch, ready))
        except Exception as exc:  # boundary: fail this group's requests, keep dispatching
            for _, p in prepared:
                self.release(p.token, "an unstarted launch's workspace")
            self._idle.extend(b.stream for b in group)
            self._idle.sort()
            self.fail_requests(group[0].requests, exc, "starting the launch failed")
            return True
        if len(prepared) < len(group):  # (outside the boundary: released once, here)
            for _, p in prepared:
                self.release(p.token, "an unstarted launch's workspace")
            return self._out_of_memory(group, last)
        now = time.monotonic()
        requests = group[0].requests
        for request in requests:  # (a split request's parts_left is its parts already)
            request.state = RUNNING
        self.running += len(requests)
        for batch in group:
            batch.launched_at = now
        final = len(prepared) - 1
        for j, (batch, ready) in enumerate(prepared):
            self._launch(batch, ready, may_inline=last and j == final)
        return True

    def _launch(self, batch: Batch, prepared: Prepared, may_inline: bool) -> None:
        launch = _Launch(batch, prepared)
        self.inflight += 1
        self._launching[batch.stream] = launch
        self.counters.launched(len(batch.requests))
        stream = self.device.streams[batch.stream]
        nodes = [r for r in batch.requests if r.graph is not None]
        nbytes = batch.nbytes
        try:
            # Graph nodes: wait on the device for producers still running (no Python
            # wait), and tell each run when its node is launched, so its consumers can be
            # queued at once. (Only a node waits: a batch of none has nothing to look at.)
            waits = [e for r in nodes if r.waits for e in r.waits if not e.query()]
            # Inline: up to inline_max_bytes on an idle stream, except one long kernel
            # call of at least MIN_SPREAD_BYTES (a lone request, or a fused launch that
            # is one compiled call) that is not the round's last launch: it computes on
            # its stream's thread, without the GIL, while the loop runs the rest. (A
            # fused launch of many calls holds the GIL between them: on a thread it would
            # queue for the GIL behind the loop thread.)
            many_calls = batch.fused and not prepared.one_call
            inline = (
                self.device.inline_capable
                and nbytes <= self.config.inline_max_bytes
                and (may_inline or many_calls or nbytes < MIN_SPREAD_BYTES)
                and not waits
            )
            if inline:
                # Consumers queued by launched() are dispatched only after this returns,
                # when the inline run is over: they need no event to wait on.
                if nodes:
                    self._nodes_launched(nodes, None)
            else:
                self.device.wait_events(stream, waits)
                post = self.loop.post

                def done(result: Any, error: BaseException | None) -> None:
                    post(self.complete, launch, result, error)  # False: the loop ended

                stream.enqueue(prepared.work, done)
        except Exception as exc:  # boundary: the launch never started (a device error
            # surfacing in an event's query or the hand-off, say): it fails as a launch,
            # its requests get their errors, its stream and workspace come back
            self.complete(launch, None, exc)
            return
        if inline:
            self._inline_runs += 1
            stream.run_inline(
                prepared.work, lambda result, error: self.complete(launch, result, error)
            )
            return
        if nodes:
            try:
                event = stream.record_event()
            except Exception as exc:  # boundary: the launch runs; nothing on the device
                # can wait for it, so its consumers are queued when it has finished
                self.loop.report(exc, "opsched: recording a graph launch's event failed")
                return
            self._nodes_launched(nodes, event)

    def _nodes_launched(self, nodes: list[Request], event: Any) -> None:
        """Tell each graph node's run that it launched (``event``: as
        :meth:`GraphRun.launched`), then queue together the consumers those calls submit."""
        queued: list[Request] = []
        for r in nodes:
            r.graph[0].launched(r.graph[1], event, queued)
        if queued:
            self.engine.enqueue_all(queued)

    def _out_of_memory(self, group: list[Batch], last: bool) -> bool:
        batch = group[0]
        if self.inflight == 0 and batch.fused and len(batch.requests) > 1:
            # Nothing in flight will return memory: launch fewer requests, requeue the rest.
            half = len(batch.requests) // 2
            for request in batch.requests[half:]:
                self.queue.push(request)
            smaller = Batch(batch.requests[:half], batch.stream, batch.key, True)
            return self._start([smaller], last=last)
        if self.inflight == 0:
            # Still nothing in flight: the memory is held by graph intermediates that only
            # this work would free. Waiting would never end; overflow the cap instead.
            log_overflow(len(batch.requests))
            return self._start(group, overflow=True, last=last)
        self._requeue(group)
        self._memory_wait = True  # until a launch completes and returns its workspace
        return False

    def complete(self, launch: _Launch, result: Any, error: BaseException | None) -> None:
        """One launch finished (called on the loop thread): return its workspace, finish
        its requests, then report it. The device's release and the report (the launch's
        log line, through the application's structlog processors; the trace) may raise
        without stranding anything: such an error goes to the loop
        (:meth:`LoopHandle.report`), never into the dispatch round that ran the launch
        inline, and the requests get their outcomes and the next dispatch is scheduled."""
        self.inflight -= 1
        batch = launch.batch
        self._launching.pop(batch.stream, None)
        self.release(launch.prepared.token, "a finished launch's workspace")
        self._memory_wait = False
        bisect.insort(self._idle, batch.stream)
        errors: dict[int, BaseException] = result[0] if error is None else {}
        counters = self.counters
        if error is None and not errors and batch.part is None:
            # the common case: a whole launch that went well (each request's last part)
            self.running -= len(batch.requests)
            for request in batch.requests:
                if request.abandoned or request.error is not None:
                    self._resolve(request)
                else:  # without the call to _resolve
                    finish(request, DONE, counters)
        else:
            for request in batch.requests:
                cause = error if error is not None else errors.get(request.id)
                if cause is not None and request.error is None:
                    request.error = launch_error(request, cause)
                request.parts_left -= 1
                if request.parts_left <= 0:
                    self.running -= 1
                    self._resolve(request)
        if self.queue.live:
            self.schedule()  # a stream and workspace came free for what waits
        else:
            self._check_quiet()
        try:
            op = batch.requests[0].op
            outcome = result if error is None else None
            log_launch(op, batch, outcome)
            if self.tracer is not None:
                trace_launch(self.tracer, op, batch, launch.prepared.cache_hit, outcome)
                self._trace_counters()
        except Exception as exc:  # boundary: the launch's requests are settled already
            self.loop.report(exc, "opsched: reporting a finished launch failed")

    def release(self, token: Any, what: str) -> None:
        """Give ``what`` (a launch's workspace, a graph intermediate: ``token``) back to the
        device. This runs inside the dispatch or a launch's completion (a graph
        intermediate's, inside its last consumer's :func:`finish`): an error is the
        device's bookkeeping, reported, never raised there, where it would leave requests
        without an outcome."""
        try:
            self.device.release(token)
        except Exception as exc:  # boundary: the results stand
            self.loop.report(exc, f"opsched: releasing {what} failed")

    def _resolve(self, request: Request) -> None:
        """A launched request's launch is over: its outcome."""
        if request.abandoned:
            finish(request, RequestState.CANCELLED, self.counters)
        elif request.error is not None:
            finish(request, RequestState.FAILED, self.counters)
        else:
            finish(request, DONE, self.counters)

    def fail_requests(self, requests: list[Request], exc: Exception, what: str) -> None:
        """Fail ``requests`` with an InnerError naming ``what`` went wrong."""
        for request in requests:
            if request.finished:
                continue
            if request.state is RequestState.RUNNING:
                self.running -= 1
            request.error = InnerError.caused_by(f"{request.op.name}: {what}", exc)
            self._resolve(request)
        log_failure(what, exc, len(requests))

    def _check_quiet(self) -> None:
        if self._quiet is not None and not self.queue.live and not self.inflight:
            self._quiet.set()
            self._quiet = None


def _group_key(batch: Batch) -> int:
    """Batches started together: every part of one split request, else each batch alone."""
    return id(batch.requests[0]) if batch.part is not None else id(batch)


def device_lost(name: str, cause: BaseException) -> SchedulerClosedError:
    """The error of a request refused or failed because the device was lost for good."""
    msg = (
        f"the scheduler's device {name} was lost to {type(cause).__name__}: {cause}; it "
        "accepts no requests: close it and restart the process"
    )
    error = SchedulerClosedError(msg)
    error.__cause__ = cause
    return error


def launch_error(request: Request, cause: BaseException) -> BaseException:
    """The error a request whose launch raised ``cause`` ends with: RuntimeLaunchError
    (361001), the cause chained."""
    if isinstance(cause, RuntimeLaunchError):
        return cause
    error = RuntimeLaunchError(
        f"{request.op.name}: the launch failed: {type(cause).__name__}: {cause}"
    )
    error.__cause__ = cause
    return error
