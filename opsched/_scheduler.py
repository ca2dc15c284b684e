"""The scheduler: submit, queue, fuse, launch on streams, complete.

The path of one request (DESIGN.md): the caller's coroutine checks the request with its
operator descriptor and queues it (``*_nowait``), then waits on the request's event. A
dispatch step, scheduled once per loop iteration however many requests arrived, runs the
pure :func:`form_batches` on the idle streams and starts each batch: executor from the cache,
workspace from the pool, then the launch on its stream (or inline when tiny and the stream
is idle). The stream runs gather, kernel and scatter and hands the launch back to the loop
with one call; the loop resolves every request of the launch and dispatches again.

Concurrency rules: all scheduler state changes on the loop thread, inside non-awaiting
methods; the only code in stream threads is a launch's own work. Every batch formation and
every launch runs inside an exception boundary that fails only the requests concerned.
"""

from __future__ import annotations

import bisect
import collections
import enum
import itertools
import math
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

import anyio
import attrs
import numpy as np

from kernels._common import DEFAULT_BLOCK, Carver, workspace_bytes
from opsched._batching import Batch, Request, RequestQueue, RequestState, form_batches
from opsched._cache import CacheStatistics, ExecutorCache
from opsched._config import SchedulerConfig
from opsched._devices import Device, Event, StreamStatistics
from opsched._errors import (
    DeadlineExceededError,
    GraphExecutionError,
    InnerError,
    ParamInvalidError,
    ParamNullptrError,
    QueueFullError,
    RuntimeLaunchError,
    SchedulerClosedError,
)
from opsched._executor import Executor, geometry_of
from opsched._graph import Graph, GraphRun, Node, Placeholder
from opsched._log import enabled, get_logger
from opsched._loop import LoopEvent, LoopHandle
from opsched._pool import Block, PoolStatistics, WorkspacePool
from opsched._products import Product, resolve_product
from opsched._torch_device import is_torch_tensor, numpy_dtype, stand_in
from opsched._torch_ops import from_torch
from opsched._trace import Tracer
from opsched.ops import GLU_BACKWARD, GROUP_NORM_BACKWARD, GROUP_NORM_GRAD, Operator
from opsched.ops._base import DTYPE_NAMES

__all__ = ["Pending", "Scheduler", "SchedulerState", "SchedulerStatistics"]

_log = get_logger("opsched.scheduler")


class SchedulerState(enum.Enum):
    """A scheduler's lifecycle."""

    NOT_OPENED = "not opened"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@attrs.frozen
class SchedulerStatistics:
    """A snapshot of a scheduler's counters.

    Attributes:
        submitted: requests accepted into the queue.
        completed: requests that returned a result.
        failed: requests whose launch failed (RuntimeLaunchError) or that a close failed.
        cancelled: requests whose caller cancelled (queued or running) or that
            ``aclose(cancel_pending=True)`` failed.
        expired: requests whose deadline passed while queued.
        rejected: calls refused at submit time (bad arguments, queue full, closed).
        queued: requests waiting now.
        queued_peak: the most requests ever waiting at once.
        running: requests inside launches now.
        launches: launches started (split parts count one each).
        requests_per_launch_mean: requests served per launch, on average.
        requests_per_launch_max: the most requests one launch served.
        backpressure_waits: submissions that waited for room in a full queue.
        graph_runs: graph runs started.
        graph_nodes: graph nodes submitted as requests.
        streams: per-stream launches and busy seconds.
        pool: the workspace pool's counters.
        executor_cache: the executor cache's counters.
    """

    submitted: int
    completed: int
    failed: int
    cancelled: int
    expired: int
    rejected: int
    queued: int
    queued_peak: int
    running: int
    launches: int
    requests_per_launch_mean: float
    requests_per_launch_max: int
    backpressure_waits: int
    graph_runs: int
    graph_nodes: int
    streams: tuple[StreamStatistics, ...]
    pool: PoolStatistics
    executor_cache: CacheStatistics

    @property
    def resolved(self) -> int:
        """Requests that reached a final state."""
        return self.completed + self.failed + self.cancelled + self.expired


class _Checked(NamedTuple):
    """A request that passed its checks, not yet queued."""

    op: Operator
    tensors: dict[str, Any]
    scalars: dict[str, Any]
    key: Hashable
    units: int
    nbytes: int
    priority: int
    deadline: float | None
    signature: Hashable | None
    #: Turns the device's result into what the caller gets (torch devices, numpy inputs).
    convert: Callable[[Any], Any] | None = None


@attrs.frozen
class _FusedLayout:
    """Where a fused launch's gathered arrays and kernel workspace sit in its block."""

    arrays: tuple[tuple[str, tuple[int, ...], np.dtype], ...]
    kernel_bytes: int
    nbytes: int

    @classmethod
    def of(cls, geometry: dict[str, tuple[tuple[int, ...], np.dtype]], kernel_bytes: int) -> Any:
        arrays = tuple((name, shape, dtype) for name, (shape, dtype) in geometry.items())
        counts = [(math.prod(shape), dtype) for _, shape, dtype in arrays]
        return cls(arrays, kernel_bytes, workspace_bytes(counts) + kernel_bytes)

    def carve(self, block: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The gathered arrays and the kernel's workspace, as views of ``block``."""
        carve = Carver(block)
        arrays = {
            name: carve.take(math.prod(shape), dtype).reshape(shape)
            for name, shape, dtype in self.arrays
        }
        return arrays, block[carve.offset :]


@attrs.define(eq=False)
class _Launch:
    """A started batch: what its completion needs."""

    batch: Batch
    op: Operator
    block: Block | None
    cache_hit: bool


#: Request signatures whose checks passed, kept to skip re-checking recurring geometry.
_SIGNATURES_KEPT = 4096


def _bucket(units: int) -> int:
    """Fused capacity for ``units``: a power of two (at least 256), so recurring work
    reuses a few executors. Only the used prefix is computed, so the padding is free."""
    return 1 << max(8, (units - 1).bit_length())


class Pending:
    """A submitted request: ``await pending`` (or ``await pending.wait()``) gives its result.

    Returned by the ``*_nowait`` methods. Cancelling the awaiting task withdraws a queued
    request (or drops the result of a running one).
    """

    __slots__ = ("_request", "_scheduler")

    def __init__(self, scheduler: Scheduler, request: Request) -> None:
        self._scheduler = scheduler
        self._request = request

    @property
    def state(self) -> RequestState:
        """Where the request is."""
        return self._request.state

    def done(self) -> bool:
        """Whether the request reached a final state."""
        return self._request.done.is_set()

    async def wait(self) -> np.ndarray:
        """Wait for the result; see :meth:`Scheduler.glu_backward` for what it raises."""
        return await self._scheduler._wait(self._request)

    def __await__(self) -> Any:
        return self.wait().__await__()


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
    _pool: WorkspacePool = attrs.field(init=False)
    _cache: ExecutorCache = attrs.field(init=False)
    _idle: list[int] = attrs.field(init=False)
    _running: int = attrs.field(default=0, init=False)
    _inflight: int = attrs.field(default=0, init=False)
    _ids: itertools.count[int] = attrs.field(factory=itertools.count, init=False)
    _dispatch_pending: bool = attrs.field(default=False, init=False)
    _memory_wait: bool = attrs.field(default=False, init=False)
    _space_waiters: collections.deque[LoopEvent] = attrs.field(
        factory=collections.deque, init=False
    )
    _quiet: LoopEvent | None = attrs.field(default=None, init=False)
    _wake: LoopEvent | None = attrs.field(default=None, init=False)
    _wake_at: float | None = attrs.field(default=None, init=False)
    _counts: dict[str, int] = attrs.field(init=False)
    _per_launch_max: int = attrs.field(default=0, init=False)
    _served: int = attrs.field(default=0, init=False)
    _launching: dict[int, _Launch] = attrs.field(factory=dict, init=False)
    _inbox: collections.deque[tuple[_Checked, Future[np.ndarray]]] = attrs.field(
        factory=collections.deque, init=False
    )
    _inbox_room: threading.Condition = attrs.field(factory=threading.Condition, init=False)
    _loop_thread: int = attrs.field(factory=threading.get_ident, init=False)
    _signatures: dict[Hashable, tuple[Any, ...]] = attrs.field(factory=dict, init=False)
    _thread_waits: int = attrs.field(default=0, init=False)
    #: Keeps the default scheduler's service task alive (asyncio holds tasks weakly).
    _service: Any = attrs.field(default=None, init=False)
    _product: Product = attrs.field(init=False)
    _torch: Any = attrs.field(default=None, init=False)
    #: Records a timeline trace when set (``open_scheduler(trace=...)``).
    _tracer: Tracer | None = attrs.field(default=None, kw_only=True)

    def __attrs_post_init__(self) -> None:
        self._product = resolve_product(
            self.config.product, self.device.reported_product, self.device.name
        )
        # A torch device holds the data: requests carry its tensors, and its launches run
        # the framework's operators (no workspace pool: see _torch_device).
        self._torch = self.device if getattr(self.device, "kind", "") == "torch" else None
        self._pool = WorkspacePool(self.config.workspace_limit_bytes)
        self._cache = ExecutorCache(self.config.executor_cache_limit)
        self._idle = list(range(len(self.device.streams)))
        self._counts = dict.fromkeys(
            (
                "submitted",
                "completed",
                "failed",
                "cancelled",
                "expired",
                "rejected",
                "launches",
                "graph_runs",
                "graph_nodes",
                "backpressure_waits",
            ),
            0,
        )

    # ------------------------------------------------------------------------ public API

    @property
    def state(self) -> SchedulerState:
        """The lifecycle state."""
        return self._state

    async def glu_backward(
        sched,
        grad_out: np.ndarray,
        self: np.ndarray,
        dim: int = -1,
        *,
        out: np.ndarray | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> np.ndarray:
        """GluBackward through the scheduler; returns ``out`` (allocated when None).

        Args:
            grad_out, self, dim, out: as :func:`opsched.aclnn.glu_backward_get_workspace_size`.
            priority: higher runs first; FIFO among equal priorities.
            deadline: absolute ``time.monotonic()`` by which the request must have launched.
            timeout: seconds from now, an alternative to ``deadline`` (the earlier wins).

        Raises:
            ParamNullptrError, ParamInvalidError, TypeError: bad arguments, at submit time.
            DeadlineExceededError: the deadline passed while the request was queued.
            RuntimeLaunchError: the launch failed; the kernel's exception is chained.
            SchedulerClosedError: the scheduler is closed, or closed with the request pending.
        """
        tensors = {"grad_out": grad_out, "self": self, "out": out}
        scalars = {"dim": dim}
        checked = sched._checked_counted(
            GLU_BACKWARD, tensors, scalars, priority, deadline, timeout
        )
        if sched._has_room():  # the common case needs no extra coroutine
            request = sched._admit(checked)
        else:
            request = await sched._admit_when_room(checked)
        return await sched._wait(request)

    def glu_backward_nowait(
        sched,
        grad_out: np.ndarray,
        self: np.ndarray,
        dim: int = -1,
        *,
        out: np.ndarray | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> Pending:
        """Queue a GluBackward without waiting; ``await`` the returned :class:`Pending`.

        Raises:
            QueueFullError: ``max_queued_requests`` are already queued.
            (and the argument errors of :meth:`glu_backward`)
        """
        tensors = {"grad_out": grad_out, "self": self, "out": out}
        request = sched._submit_nowait(
            GLU_BACKWARD, tensors, {"dim": dim}, priority, deadline, timeout
        )
        return Pending(sched, request)

    async def group_norm_grad(
        self,
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
        """GroupNormalizationGrad through the scheduler; returns ``dx`` (``out``).

        Arguments and errors as :meth:`glu_backward` and
        :func:`opsched.aclnn.group_norm_grad_get_workspace_size`.
        """
        tensors = {"x": x, "dy": dy, "gamma": gamma, "mean": mean, "rstd": rstd, "dx": out}
        checked = self._checked_counted(GROUP_NORM_GRAD, tensors, {}, priority, deadline, timeout)
        if self._has_room():
            request = self._admit(checked)
        else:
            request = await self._admit_when_room(checked)
        return await self._wait(request)

    def group_norm_grad_nowait(
        self,
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
    ) -> Pending:
        """Queue a GroupNormalizationGrad without waiting (see :meth:`glu_backward_nowait`)."""
        tensors = {"x": x, "dy": dy, "gamma": gamma, "mean": mean, "rstd": rstd, "dx": out}
        request = self._submit_nowait(GROUP_NORM_GRAD, tensors, {}, priority, deadline, timeout)
        return Pending(self, request)

    async def group_norm_backward(
        self,
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
        """GroupNormBackward through the scheduler; returns ``(dx, dgamma, dbeta)``, None
        where ``output_mask`` is False.

        ``out``: optional ``(dx, dgamma, dbeta)`` arrays to write into (None entries are
        allocated). Arguments and errors as :meth:`glu_backward` and
        :func:`opsched.aclnn.group_norm_backward_get_workspace_size`.
        """
        tensors, scalars = _gnb_args(
            grad_out, input, mean, rstd, gamma, N, C, HxW, group, output_mask, out
        )
        checked = self._checked_counted(
            GROUP_NORM_BACKWARD, tensors, scalars, priority, deadline, timeout
        )
        if self._has_room():
            request = self._admit(checked)
        else:
            request = await self._admit_when_room(checked)
        result: Any = await self._wait(request)  # the operator's (dx, dgamma, dbeta)
        return result

    def group_norm_backward_nowait(
        self,
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
    ) -> Pending:
        """Queue a GroupNormBackward without waiting (see :meth:`glu_backward_nowait`)."""
        tensors, scalars = _gnb_args(
            grad_out, input, mean, rstd, gamma, N, C, HxW, group, output_mask, out
        )
        request = self._submit_nowait(
            GROUP_NORM_BACKWARD, tensors, scalars, priority, deadline, timeout
        )
        return Pending(self, request)

    async def run(
        self,
        graph: Graph,
        outputs: Sequence[Node],
        *,
        inputs: Mapping[Node | Placeholder, np.ndarray] | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> list[np.ndarray]:
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
        done = self._loop.new_event()
        run = self._start_graph(graph, outputs, inputs, priority, deadline, timeout, done.set)
        try:
            if run.deadline is not None and not done.is_set():
                # The run's own timer: nodes still queued at the deadline expire (and fail
                # what depends on them); launched ones finish.
                with anyio.move_on_after(run.deadline - time.monotonic()):
                    await done.wait()
                for request in run.queued():
                    if request.state is RequestState.QUEUED:
                        self._queue.discard(request, RequestState.EXPIRED)
                        self._expired(request)
            await done.wait()
            if self._loop.cancel_check is not None:
                await self._loop.cancel_check()
        except BaseException:
            for request in run.cancel():
                if request.state is RequestState.QUEUED:
                    self._abandon(request)
            raise
        if self._torch is not None and _all_numpy(graph, inputs):
            return _graph_to_numpy(run)
        return run.result()

    def _start_graph(
        self,
        graph: Graph,
        outputs: Sequence[Node],
        inputs: Mapping[Node | Placeholder, np.ndarray] | None,
        priority: int,
        deadline: float | None,
        timeout: float | None,
        done: Callable[[], None],
    ) -> GraphRun:
        if self._state is not SchedulerState.OPEN:
            msg = f"the scheduler is {self._state.value}; it accepts no new graph runs"
            raise SchedulerClosedError(msg)
        if not isinstance(graph, Graph):
            msg = f"run: graph must be an opsched.Graph, got {type(graph).__qualname__}"
            raise TypeError(msg)
        outputs = list(outputs)
        if not outputs:
            msg = "run: outputs must name at least one node of the graph"
            raise ValueError(msg)
        for node in outputs:
            if not isinstance(node, Node) or node.graph is not graph:
                msg = f"run: output {node!r} is not a node of this graph"
                raise ValueError(msg)
        graph.check_on(self._product)
        given = _check_graph_inputs(
            graph, outputs, dict(inputs or {}), torch_inputs=self._torch is not None
        )
        run = GraphRun(
            graph,
            outputs,
            int(priority),
            _deadline(deadline, timeout),
            self._graph_submit,
            self._graph_allocate,
            self._pool.release,
            done,
            self._graph_drop,
            fresh=self.device.empty,
        )
        self._counts["graph_runs"] += 1
        run.start(given)
        return run

    def _graph_submit(
        self, run: GraphRun, node_run: Any, tensors: dict[str, Any], waits: list[Event]
    ) -> Request:
        """Queue a graph node. Its checks ran when it was added; a run binds arrays of
        exactly the checked geometry, so nothing is checked again."""
        node = node_run.node
        if self._torch is not None:  # bound numpy arrays and placeholders move to the device
            device = self._torch
            tensors = {
                n: v if v is None or n in node.op.outputs else device.admit(node.name, n, v)
                for n, v in tensors.items()
            }
        request = Request(
            next(self._ids),
            node.op,
            tensors,
            node.scalars,
            node.key,
            node.units,
            node.nbytes,
            run.priority,
            run.deadline,
            time.monotonic(),
            done=self._loop.new_event(),
            signature=node.signature,
        )
        request.graph = (run, node_run)
        request.waits = waits or None
        self._counts["submitted"] += 1
        self._counts["graph_nodes"] += 1
        if node.nbytes > self._pool.limit // 4:  # as for callers: alone over the cap fails
            try:
                self._check_fits(node.op, tensors, node.scalars, node.key, node.units, node.nbytes)
            except ParamInvalidError as exc:
                request.error = exc
                request.state = RequestState.FAILED
                self._counts["failed"] += 1
                _settle(request)
                return request
        if not request.nbytes:  # an empty tensor: done at once, without a launch
            run.launched(node_run, None)
            self._finish_empty(request)
            return request
        self._queue.push(request)
        self._schedule_dispatch()
        return request

    def _graph_allocate(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[Any, Any]:
        """An intermediate output: from the pool while it is at most half full (the other
        half stays for launch workspaces), else a plain array."""
        if self._torch is not None:
            return self._torch.empty(shape, dtype), None
        nbytes = math.prod(shape) * dtype.itemsize
        pool = self._pool
        if nbytes and pool.current + nbytes <= pool.limit // 2:
            block = pool.allocate(nbytes, 0)
            if block is not None:
                view = block.views.get((shape, dtype))  # a reused block keeps its views
                if view is None:
                    view = block.array[:nbytes].view(dtype).reshape(shape)
                    block.views[(shape, dtype)] = view
                return view, block
        return np.empty(shape, dtype), None

    def _graph_drop(self, request: Request, error: BaseException) -> None:
        """Fail a queued graph request whose producer failed (it never launches)."""
        if request.state is RequestState.QUEUED:
            self._queue.discard(request, RequestState.FAILED)
            request.error = error
            self._counts["failed"] += 1
            _settle(request)
            self._wake_space()

    def statistics(self) -> SchedulerStatistics:
        """A frozen snapshot of the scheduler's counters."""
        c = self._counts
        launches = c["launches"]
        return SchedulerStatistics(
            submitted=c["submitted"],
            completed=c["completed"],
            failed=c["failed"],
            cancelled=c["cancelled"],
            expired=c["expired"],
            rejected=c["rejected"],
            queued=len(self._queue),
            queued_peak=self._queue.peak,
            running=self._running,
            launches=launches,
            requests_per_launch_mean=self._served / launches if launches else 0.0,
            requests_per_launch_max=self._per_launch_max,
            backpressure_waits=c["backpressure_waits"] + self._thread_waits,
            graph_runs=c["graph_runs"],
            graph_nodes=c["graph_nodes"],
            streams=tuple(s.statistics() for s in self.device.streams),
            pool=self._pool.statistics()
            if self._torch is None
            else self._torch.memory_statistics(),
            executor_cache=self._cache.statistics(),
        )

    def memory_stats(self) -> dict[str, int]:
        """The workspace pool's counters with torch-style keys."""
        return self._pool.memory_stats()

    def reset_peak_stats(self) -> None:
        """Restart the pool's peak from its current size."""
        self._pool.reset_peak_stats()

    def empty_cache(self) -> None:
        """Release the pool's cached, idle workspace blocks."""
        self._pool.empty_cache()

    async def aclose(self, *, cancel_pending: bool = False) -> None:
        """Close: refuse new requests, then drain (or fail) the pending ones.

        Args:
            cancel_pending: fail queued requests with SchedulerClosedError instead of running
                them; launches already running always finish.
        """
        if self._state is SchedulerState.CLOSED:
            return
        self._state = SchedulerState.CLOSING
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
        self._fail_queued()
        self._shutdown()

    def _shutdown(self) -> None:
        self._state = SchedulerState.CLOSED
        self.device.close()
        if self._tracer is not None:
            self._tracer.write()
        self._cache.clear()
        self._pool.empty_cache()
        if self._wake is not None:
            self._wake.set()
        while self._space_waiters:  # they raise SchedulerClosedError
            self._space_waiters.popleft().set()

    def _fail_queued(self) -> None:
        for request in self._queue.drain():
            request.state = RequestState.CANCELLED
            request.error = SchedulerClosedError("the scheduler was closed before it launched")
            self._counts["cancelled"] += 1
            _settle(request)
        self._wake_space()

    # ----------------------------------------------------------------------- submission

    def _has_room(self) -> bool:
        """Whether a caller may queue now: below the cap, and nobody parked ahead of it."""
        return len(self._queue) < self.config.max_queued_requests and not self._space_waiters

    async def _admit_when_room(self, checked: _Checked) -> Request:
        """Queue a checked request, parking while the queue is full (backpressure).

        Parked callers wait in FIFO order, each on its own event, and as many are woken as
        there are free slots: no thundering herd. A cancelled waiter passes its wake-up on.
        """
        if len(self._queue) >= self.config.max_queued_requests:
            self._counts["backpressure_waits"] += 1
        while len(self._queue) >= self.config.max_queued_requests:
            if self._state is not SchedulerState.OPEN:
                msg = f"the scheduler is {self._state.value}; it accepts no new requests"
                raise SchedulerClosedError(msg)
            event = self._loop.new_event()
            self._space_waiters.append(event)
            try:
                await event.wait()
            except BaseException:
                if event.is_set():
                    self._wake_space()  # hand the free slot to the next waiter
                else:
                    self._space_waiters.remove(event)
                raise
        if self._state is not SchedulerState.OPEN:
            msg = f"the scheduler is {self._state.value}; it accepts no new requests"
            raise SchedulerClosedError(msg)
        return self._admit(checked)

    def _submit_nowait(
        self,
        op: Operator,
        tensors: dict[str, Any],
        scalars: dict[str, Any],
        priority: int,
        deadline: float | None,
        timeout: float | None,
    ) -> Request:
        try:
            return self._enqueue(op, tensors, scalars, priority, deadline, timeout)
        except QueueFullError:
            self._counts["rejected"] += 1
            raise

    def _enqueue(
        self,
        op: Operator,
        tensors: dict[str, Any],
        scalars: dict[str, Any],
        priority: int,
        deadline: float | None,
        timeout: float | None,
    ) -> Request:
        """Check and queue a request; QueueFullError (uncounted) when there is no room."""
        checked = self._checked_counted(op, tensors, scalars, priority, deadline, timeout)
        if not self._has_room():
            msg = f"{len(self._queue)} requests are queued (max_queued_requests)"
            raise QueueFullError(msg)
        return self._admit(checked)

    def _checked_counted(self, *args: Any) -> _Checked:
        """:meth:`_checked`, counting a refusal as rejected."""
        try:
            return self._checked(*args)
        except BaseException:
            self._counts["rejected"] += 1
            raise

    def _admit(self, checked: _Checked, future: Future[np.ndarray] | None = None) -> Request:
        """Queue a checked request (or finish it at once if it has nothing to compute).

        ``future``: the request came from a thread, which holds that future; it gets a
        deadline timer of its own (no coroutine waits for it) and the dispatch is deferred
        to after the whole drained burst.
        """
        request = self._request(checked)
        request.future = future
        self._counts["submitted"] += 1
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

    def _checked(
        self,
        op: Operator,
        tensors: dict[str, Any],
        scalars: dict[str, Any],
        priority: int,
        deadline: float | None,
        timeout: float | None,
        *,
        internal: bool = False,
    ) -> _Checked:
        """Everything a request needs that touches no scheduler state (any thread).

        The checks depend only on the arrays' shapes and dtypes and the scalar arguments,
        so a signature seen before skips them (a dict lookup); failures are never cached:
        a bad request always runs the checks and raises its status.
        """
        if self._state is not SchedulerState.OPEN and not internal:
            msg = f"the scheduler is {self._state.value}; it accepts no new requests"
            raise SchedulerClosedError(msg)
        deadline = _deadline(deadline, timeout)
        if type(priority) is not int and (
            isinstance(priority, bool) or not isinstance(priority, int | np.integer)
        ):
            msg = f"priority must be an integer, got {type(priority).__qualname__} {priority!r}"
            raise TypeError(msg)
        if self._torch is not None:
            return self._checked_torch(op, tensors, scalars, int(priority), deadline)
        signature = op.signature(tensors, scalars)
        known = self._signatures.get(signature) if signature is not None else None
        if known is None:
            scalars = op.check_on(self._product, tensors, scalars, allocate=True)
            if _missing_output(op, tensors):
                tensors.update(op.allocate(tensors, scalars))
            key, units = op.fusion(tensors, scalars)
            nbytes = op.nbytes(tensors)
            if nbytes > self._pool.limit // 4:
                self._check_fits(op, tensors, scalars, key, units, nbytes)
            self._remember(signature, (scalars, key, units, nbytes))
        else:
            scalars, key, units, nbytes = known
            if _missing_output(op, tensors):
                tensors.update(op.allocate(tensors, scalars))
        return _Checked(
            op, tensors, scalars, key, units, nbytes, int(priority), deadline, signature
        )

    def _remember(self, signature: Hashable | None, checked: tuple[Any, ...]) -> None:
        """Keep what a signature's checks established (bounded: cleared when full)."""
        if signature is not None:
            if len(self._signatures) >= _SIGNATURES_KEPT:
                self._signatures.clear()
            self._signatures[signature] = checked

    def _checked_torch(
        self,
        op: Operator,
        tensors: dict[str, Any],
        scalars: dict[str, Any],
        priority: int,
        deadline: float | None,
    ) -> _Checked:
        """A request for a torch device: checked on numpy stand-ins, its arrays moved to the
        device, its outputs allocated there; results return as the kind of its inputs."""
        device = self._torch
        stand_ins: dict[str, Any] = {}
        numpy_in = True
        for name, value in tensors.items():
            if is_torch_tensor(value):
                stand_ins[name] = stand_in(value)
                numpy_in = False
            else:
                stand_ins[name] = value
        # The stand-ins carry what the checks depend on: a signature seen before skips them.
        signature = op.signature(stand_ins, scalars)
        known = self._signatures.get(signature) if signature is not None else None
        if known is None:
            scalars = op.check_on(self._product, stand_ins, scalars, allocate=True)
            spec = op.output_spec(stand_ins, scalars)
            for name, (shape, dtype) in spec.items():
                if stand_ins[name] is None:
                    stand_ins[name] = np.broadcast_to(np.empty((), dtype), shape)
            key, units = op.fusion(stand_ins, scalars)
            known = (scalars, spec, key, units, op.nbytes(stand_ins))
            self._remember(signature, known)
        scalars, spec, key, units, nbytes = known
        caller_out = {n: v for n, v in tensors.items() if n in spec and isinstance(v, np.ndarray)}
        data = {
            name: None if value is None else device.admit(op.name, name, value)
            for name, value in tensors.items()
        }
        for name, (shape, dtype) in spec.items():
            if data[name] is None:
                data[name] = device.empty(shape, dtype)
        convert = _to_numpy(op, caller_out) if numpy_in or caller_out else None
        return _Checked(
            op, data, scalars, key, units, nbytes, priority, deadline, None, convert
        )  # fmt: skip

    def _request(self, c: _Checked) -> Request:
        return Request(
            next(self._ids),
            c.op,
            c.tensors,
            c.scalars,
            c.key,
            c.units,
            c.nbytes,
            c.priority,
            c.deadline,
            time.monotonic(),
            done=self._loop.new_event(),
            signature=c.signature,
            convert=c.convert,
        )

    # ------------------------------------------------------------ submission from threads

    def submit_threadsafe(
        self,
        op: Operator,
        tensors: dict[str, Any],
        scalars: dict[str, Any],
        *,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> Future[np.ndarray]:
        """Submit from a thread other than the loop's; the future resolves with the output.

        The arguments are checked here, in the calling thread (bad ones raise at once);
        queueing happens on the loop, one wake-up per burst of submissions, so requests
        from threads fuse like those from coroutines. ``future.cancel()`` withdraws a
        queued request (or drops a running one's result). While ``max_queued_requests`` are
        queued or waiting to be, the calling thread blocks (backpressure).

        Raises:
            RuntimeError: called from the scheduler's own loop thread.
            (and the argument errors of :meth:`glu_backward`)
        """
        if threading.get_ident() == self._loop_thread:
            msg = "submit_threadsafe was called on the scheduler's own loop thread; await instead"
            raise RuntimeError(msg)
        checked = self._checked(op, tensors, scalars, priority, deadline, timeout)
        future: Future[np.ndarray] = Future()
        with self._inbox_room:
            if len(self._inbox) + len(self._queue) >= self.config.max_queued_requests:
                self._thread_waits += 1  # under the inbox lock; the loop counts its own
            while len(self._inbox) + len(self._queue) >= self.config.max_queued_requests:
                if self._state is not SchedulerState.OPEN:
                    break
                self._inbox_room.wait(0.1)
            self._inbox.append((checked, future))
            first = len(self._inbox) == 1
        if first and not self._loop.post(self._drain_inbox):
            future.set_exception(SchedulerClosedError("the scheduler's event loop has ended"))
        return future

    def _drain_inbox(self) -> None:
        """Queue every request submitted from threads since the last drain (loop thread)."""
        with self._inbox_room:
            items = list(self._inbox)
            self._inbox.clear()
            self._inbox_room.notify_all()
        for checked, future in items:
            if self._state is not SchedulerState.OPEN:
                future.set_exception(SchedulerClosedError("the scheduler was closed"))
                continue
            self._admit(checked, future)

    def _future_done(self, request: Request) -> Callable[[Future[np.ndarray]], None]:
        def done(future: Future[np.ndarray]) -> None:
            if future.cancelled():  # cancelled by its owner thread: withdraw on the loop
                self._loop.post(self._abandon_cancelled, request)

        return done

    def _abandon_cancelled(self, request: Request) -> None:
        if not request.done.is_set():
            self._abandon(request)

    def _deadline_reached(self, request: Request) -> None:
        if request.state is RequestState.QUEUED:
            self._queue.discard(request, RequestState.EXPIRED)
            self._expired(request)

    def _check_fits(
        self,
        op: Operator,
        tensors: dict[str, np.ndarray],
        scalars: dict[str, Any],
        key: Hashable,
        units: int,
        nbytes: int,
    ) -> None:
        """ParamInvalidError when this request alone needs more workspace than the cap."""
        if nbytes > self.config.fuse_max_bytes:
            need = op.workspace_size(op.plan(tensors, scalars, DEFAULT_BLOCK))
        else:
            capacity = _bucket(units)
            geometry, _ = op.fused_geometry(key, capacity)
            plan_bytes = op.workspace_size(op.fused_plan(key, capacity, DEFAULT_BLOCK))
            need = _FusedLayout.of(geometry, plan_bytes).nbytes
        if not self._pool.fits(need):
            msg = (
                f"{op.name}: this request needs {need} bytes of workspace, more than "
                f"workspace_limit_bytes={self._pool.limit}"
            )
            raise ParamInvalidError(msg)

    # ------------------------------------------------------------------------- waiting

    async def _wait(self, request: Request) -> np.ndarray:
        done = request.done
        cancel_check = self._loop.cancel_check
        if request.deadline is None and not done.is_set():  # the common case
            try:
                await done.wait()
                if cancel_check is not None:
                    await cancel_check()
            except BaseException:
                if not done.is_set():
                    self._abandon(request)
                raise
            if request.state is RequestState.DONE:
                return _result(request)
            assert request.error is not None
            raise request.error
        try:
            if request.done.is_set():  # finished inline at submit: still yield once
                await self._loop.checkpoint()
            elif request.deadline is None:
                await request.done.wait()
            else:
                with anyio.move_on_after(request.deadline - time.monotonic()):
                    await request.done.wait()
                if not request.done.is_set():
                    if request.state is RequestState.QUEUED:
                        self._queue.discard(request, RequestState.EXPIRED)
                        self._expired(request)
                    else:  # launched before its deadline: the result is on its way
                        await request.done.wait()
            if cancel_check is not None:
                await cancel_check()
        except BaseException:
            if not request.done.is_set():
                self._abandon(request)
            raise
        if request.state is RequestState.DONE:
            return _result(request)
        assert request.error is not None
        raise request.error

    def _finish_empty(self, request: Request) -> None:
        """Resolve a request of empty tensors at submit: nothing to launch. Its deadline
        still holds: one already past expires, as it would in the queue."""
        if request.deadline is not None and request.deadline <= time.monotonic():
            self._expired(request)
            return
        request.state = RequestState.DONE
        self._counts["completed"] += 1
        _settle(request)

    def _abandon(self, request: Request) -> None:
        """The caller stopped waiting (cancellation)."""
        if request.state is RequestState.QUEUED:
            self._queue.discard(request, RequestState.CANCELLED)
            self._counts["cancelled"] += 1
            _settle(request)
            self._wake_space()
        else:
            request.abandoned = True  # running: its launch finishes, the result is dropped

    def _expired(self, request: Request) -> None:
        request.state = RequestState.EXPIRED
        late = time.monotonic() - (request.deadline or 0.0)
        request.error = DeadlineExceededError(
            f"{request.op.name}: the deadline passed {late * 1e3:.3f} ms ago while the "
            "request was queued; it was not launched"
        )
        self._counts["expired"] += 1
        _settle(request)
        self._wake_space()

    def _wake_space(self) -> None:
        """Wake as many parked submitters as there are free slots (FIFO)."""
        free = self.config.max_queued_requests - len(self._queue)
        waiters = self._space_waiters
        while free > 0 and waiters:
            waiters.popleft().set()
            free -= 1
        if free > 0 and self._inbox:
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
            tracer.counters(len(self._queue), self._pool.in_use, self._pool.current)
        while self._idle and len(self._queue) and not self._memory_wait:
            taken: list[Request] = []
            self._queue.taken = taken
            try:
                batches, expired, wake_at = form_batches(
                    self._queue, self._idle, self.config, time.monotonic()
                )
            except Exception as exc:  # a bug in batch formation fails its requests only
                self._fail_requests(taken, exc, "batch formation failed")
                self._idle = sorted(set(range(len(self.device.streams))) - self._busy)
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
            tracer.counters(len(self._queue), self._pool.in_use, self._pool.current)
        self._check_quiet()

    @property
    def _busy(self) -> set[int]:
        """Streams with a launch in flight."""
        return {launch_stream for launch_stream in self._launching}

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

        Returns False when the pool is at its cap: the group went back to the queue. With
        ``overflow``, workspace may exceed the cap (the last resort of _out_of_memory).
        """
        prepared: list[tuple[Batch, Block | None, Callable[[], Any], bool]] = []
        try:
            for batch in group:
                op = batch.requests[0].op
                prepare = self._prepare_fused if batch.fused else self._prepare_solo
                if self._torch is not None:
                    prepare = self._prepare_torch
                ready = prepare(op, batch, overflow)
                if ready is None:
                    for _, block, _, _ in prepared:
                        if block is not None:
                            self._pool.release(block)
                    return self._out_of_memory(group)
                prepared.append((batch, *ready))
        except Exception as exc:  # boundary: fail this group's requests, keep dispatching
            for _, block, _, _ in prepared:
                if block is not None:
                    self._pool.release(block)
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
        for batch, block, work, hit in prepared:
            self._launch(batch, block, work, hit)
        return True

    def _launch(
        self, batch: Batch, block: Block | None, work: Callable[[], Any], cache_hit: bool
    ) -> None:
        op = batch.requests[0].op
        launch = _Launch(batch, op, block, cache_hit)
        self._inflight += 1
        self._launching[batch.stream] = launch
        self._counts["launches"] += 1
        self._served += len(batch.requests)
        self._per_launch_max = max(self._per_launch_max, len(batch.requests))
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
            stream.run_inline(work, lambda result, error: self._complete(launch, result, error))
            return
        for e in waits:
            stream.wait_event(e)
        post = self._loop.post

        def done(result: Any, error: BaseException | None) -> None:
            post(self._complete, launch, result, error)  # False: the loop ended, drop it

        stream.enqueue(work, done)
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
            # Still nothing in flight: the pool is held by graph intermediates that only
            # this work would free. Waiting would never end; overflow the cap instead.
            if enabled():
                _log.info("workspace over the cap", requests=len(batch.requests))
            return self._start(group, overflow=True)
        self._requeue(group)
        self._memory_wait = True  # until a launch completes and returns its workspace
        return False

    def _prepare_fused(
        self, op: Operator, batch: Batch, overflow: bool
    ) -> tuple[Block | None, Callable[[], Any], bool] | None:
        requests = batch.requests
        capacity = _bucket(batch.units)
        cache_key = (op.name, "fused", batch.key, capacity, self.device.name, batch.stream)
        executor = self._cache.get(cache_key)
        hit = executor is not None
        if executor is None:
            geometry, scalars = op.fused_geometry(batch.key, capacity)
            plan = op.fused_plan(batch.key, capacity, DEFAULT_BLOCK)
            executor = Executor(op, {}, scalars, plan, op.workspace_size(plan))
            executor.set_repeatable()
            executor.layout = _FusedLayout.of(geometry, executor.workspace_size)
            self._cache.put(cache_key, executor)
        layout: _FusedLayout = executor.layout
        block = self._pool.allocate(layout.nbytes, batch.stream, overflow=overflow)
        if block is None:
            return None
        try:
            # A block keeps the views it was carved into, per layout: steady state carves
            # nothing, and rebinding the same views needs no geometry check.
            views = block.views.get(cache_key)
            if views is None:
                views = block.views[cache_key] = layout.carve(block.array)
            arrays, kernel_ws = views
            if executor.tensors is not arrays:
                executor.rebind_same_geometry(arrays)
            executor.count_launch()
        except BaseException:
            self._pool.release(block)
            raise
        device = self.device
        plan = executor.plan

        def work() -> tuple[dict[int, BaseException], float, float]:
            start = time.perf_counter()
            errors: dict[int, BaseException] = {}
            _run_fused(device, op, plan, arrays, kernel_ws, requests, errors)
            return errors, start, time.perf_counter()

        return block, work, hit

    def _prepare_torch(
        self, op: Operator, batch: Batch, overflow: bool
    ) -> tuple[Block | None, Callable[[], Any], bool]:
        device, stream = self._torch, batch.stream
        requests: list[Any] = list(batch.requests)
        if batch.part is not None:  # one part of a split request: its views, same id
            r = requests[0]
            requests = [_Part(r.id, r.op, batch.part[0], batch.part[1])]

        def work() -> tuple[dict[int, BaseException], float, float]:
            start = time.perf_counter()
            errors = device.execute(op, requests, stream)
            return errors, start, time.perf_counter()

        return None, work, False

    def _prepare_solo(
        self, op: Operator, batch: Batch, overflow: bool
    ) -> tuple[Block | None, Callable[[], Any], bool] | None:
        request = batch.requests[0]
        tensors, scalars = batch.part or (request.tensors, request.scalars)
        strides = tuple(_strides(tensors[n]) for n in op.tensor_names)
        if batch.part is None and request.signature is not None:
            geometry: Hashable = request.signature  # shapes, dtypes, scalars: from the checks
        else:
            geometry = (
                tuple(geometry_of(tensors[n]) for n in op.tensor_names),
                tuple(sorted(scalars.items())),
            )
        overlap = op.overlaps_any(tensors)
        cache_key = (geometry, strides, overlap, self.device.name, batch.stream)
        executor = self._cache.get(cache_key)
        hit = executor is not None
        if executor is None:
            plan = op.plan(tensors, scalars, DEFAULT_BLOCK)
            executor = Executor(op, dict(tensors), scalars, plan, op.workspace_size(plan))
            executor.set_repeatable()
            self._cache.put(cache_key, executor)
        else:
            executor.rebind_same_geometry(tensors)  # the cache key is the geometry
        size = executor.workspace_size
        block: Block | None = None
        if size:
            block = self._pool.allocate(size, batch.stream, overflow=overflow)
            if block is None:
                return None
        workspace = block.array if block is not None else None
        executor.count_launch()
        device = self.device
        plan = executor.plan
        bound = dict(tensors)
        requests = batch.requests

        def work() -> tuple[dict[int, BaseException], float, float]:
            start = time.perf_counter()
            device.check_fault(requests)
            device.run_kernel(op, plan, bound, workspace)
            return {}, start, time.perf_counter()

        return block, work, hit

    # ---------------------------------------------------------------------- completion

    def _complete(self, launch: _Launch, result: Any, error: BaseException | None) -> None:
        """One launch finished (called on the loop thread): resolve its requests."""
        self._inflight -= 1
        batch = launch.batch
        self._launching.pop(batch.stream, None)
        if launch.block is not None:
            self._pool.release(launch.block)
        self._memory_wait = False
        bisect.insort(self._idle, batch.stream)
        errors: dict[int, BaseException] = result[0] if error is None else {}
        run_s = result[2] - result[1] if error is None else 0.0
        for request in batch.requests:
            cause = error if error is not None else errors.get(request.id)
            if cause is not None and request.error is None:
                request.error = _launch_error(request, cause)
            request.parts_left -= 1
            if request.parts_left <= 0:
                self._running -= 1
                self._resolve(request)
        if enabled():
            _log.debug(
                "launch",
                op=launch.op.name,
                dtype=str(batch.requests[0].tensors[launch.op.tensor_names[0]].dtype),
                requests=len(batch.requests),
                bytes=batch.nbytes,
                stream=batch.stream,
                fused=batch.fused,
                queue_wait_s=min(r.launched_at - r.enqueued_at for r in batch.requests),
                run_s=run_s,
                failed=sum(1 for r in batch.requests if r.error is not None),
                nodes=[r.graph[1].node.name for r in batch.requests if r.graph is not None],
            )
        if self._tracer is not None:
            self._trace_launch(self._tracer, launch, result if error is None else None)
        if len(self._queue):
            self._schedule_dispatch()  # a stream and workspace came free for what waits
        else:
            self._check_quiet()

    def _trace_launch(self, tracer: Tracer, launch: _Launch, result: Any) -> None:
        batch, op = launch.batch, launch.op
        requests = batch.requests
        end = time.perf_counter()
        start, end = (result[1], result[2]) if result is not None else (end, end)
        first = requests[0].tensors[op.tensor_names[0]]
        dtype = DTYPE_NAMES.get(numpy_dtype(first) if is_torch_tensor(first) else first.dtype, "?")
        args: dict[str, Any] = {
            "operator": op.name,
            "dtype": dtype,
            "requests": len(requests),
            "fused": batch.fused,
            "bytes": batch.nbytes,
            "executor cache": "hit" if launch.cache_hit else "miss",
            "queue wait us": round(min(r.launched_at - r.enqueued_at for r in requests) * 1e6, 1),
            "failed": sum(1 for r in requests if r.error is not None),
        }
        if batch.part is not None:
            args["split part"] = True
        edges = []
        for r in requests:
            if r.graph is not None:
                node_run = r.graph[1]
                producers = [p.request.id for p in node_run.producers if p.request is not None]
                edges.append((r.id, producers))
        if edges:
            args["graph nodes"] = [r.graph[1].node.name for r in requests if r.graph is not None]
        name = f"{op.name} x{len(requests)}" if len(requests) > 1 else op.name
        tracer.launch(batch.stream, start, end, name, args, edges)
        tracer.counters(len(self._queue), self._pool.in_use, self._pool.current)

    def _resolve(self, request: Request) -> None:
        if request.abandoned:
            request.state = RequestState.CANCELLED
            self._counts["cancelled"] += 1
        elif request.error is not None:
            request.state = RequestState.FAILED
            self._counts["failed"] += 1
            if enabled():
                _log.info("request failed", op=request.op.name, error=str(request.error))
        else:
            request.state = RequestState.DONE
            self._counts["completed"] += 1
        _settle(request)

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
        if enabled():
            _log.info(what, error=repr(exc), requests=len(requests))

    def _check_quiet(self) -> None:
        if self._quiet is not None and not len(self._queue) and not self._inflight:
            self._quiet.set()
            self._quiet = None


def _deadline(deadline: float | None, timeout: float | None) -> float | None:
    if deadline is None and timeout is None:
        return None
    for name, value in (("deadline", deadline), ("timeout", timeout)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            msg = f"{name} must be a number of seconds or None, got {value!r}"
            raise TypeError(msg)
    if timeout is not None:
        if timeout < 0:
            msg = f"timeout={timeout} must be >= 0 seconds"
            raise ValueError(msg)
        by_timeout = time.monotonic() + timeout
        return by_timeout if deadline is None else min(deadline, by_timeout)
    return None if deadline is None else float(deadline)


def _run_fused(
    device: Device,
    op: Operator,
    plan: Any,
    arrays: dict[str, np.ndarray],
    workspace: np.ndarray,
    requests: list[Request],
    errors: dict[int, BaseException],
) -> None:
    """Gather, compute, scatter; on failure re-run in halves to isolate the culprits."""
    try:
        device.check_fault(requests)
        offsets = op.gather(requests, arrays)
        units = sum(r.units for r in requests)
        device.run_kernel(op, plan, op.fused_prefix(arrays, units), workspace)
        op.scatter(requests, arrays, offsets)
    except Exception as exc:
        if len(requests) == 1:
            errors[requests[0].id] = exc
            return
        half = len(requests) // 2
        _run_fused(device, op, plan, arrays, workspace, requests[:half], errors)
        _run_fused(device, op, plan, arrays, workspace, requests[half:], errors)


def _gnb_args(
    grad_out: Any, input: Any, mean: Any, rstd: Any, gamma: Any, n: Any, c: Any, hxw: Any,
    group: Any, output_mask: Any, out: Any,
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """GroupNormBackward's tensors and scalars from the scheduler's call arguments."""
    if out is None:
        out = (None, None, None)
    elif not isinstance(out, tuple | list) or len(out) != 3:
        msg = f"GroupNormBackward: out must be a (dx, dgamma, dbeta) tuple or None, got {out!r}"
        raise TypeError(msg)
    tensors = {
        "grad_out": grad_out, "input": input, "mean": mean, "rstd": rstd, "gamma": gamma,
        "dx": out[0], "dgamma": out[1], "dbeta": out[2],
    }  # fmt: skip
    scalars = {"N": n, "C": c, "HxW": hxw, "group": group, "output_mask": output_mask}
    return tensors, scalars


def _all_numpy(graph: Graph, inputs: Mapping[Any, Any] | None) -> bool:
    """Whether no array given to a graph run is a torch tensor (its outputs are then numpy)."""
    given = list((inputs or {}).values())
    given += [v for node in graph.nodes for v in node.args.values()]
    return not any(is_torch_tensor(v) for v in given)


def _graph_to_numpy(run: GraphRun) -> list[Any]:
    """A torch device's graph results as numpy (on its GraphExecutionError too)."""

    def convert(value: Any) -> Any:
        if isinstance(value, tuple):
            return tuple(None if v is None else from_torch(v) for v in value)
        return None if value is None or isinstance(value, np.ndarray) else from_torch(value)

    try:
        outs = run.result()
    except GraphExecutionError as exc:
        exc.outputs = [convert(v) for v in exc.outputs]
        raise
    return [convert(v) for v in outs]


class _Part(NamedTuple):
    """One part of a split request as a torch device runs it (its views of the tensors)."""

    id: int
    op: Operator
    tensors: dict[str, Any]
    scalars: dict[str, Any]


def _result(request: Request) -> Any:
    """What the caller of a completed request gets."""
    convert = request.convert
    return request.result if convert is None else convert(request.result)


def _to_numpy(op: Operator, caller_out: dict[str, np.ndarray]) -> Callable[[Any], Any]:
    """Converts a torch device's result to numpy: into the caller's ``out=`` arrays where it
    gave them (on the CPU they already share the tensors' memory), else new arrays."""
    names = op.outputs

    def convert(result: Any) -> Any:
        outs = result if len(names) > 1 else (result,)
        arrays: list[Any] = []
        for name, tensor in zip(names, outs, strict=True):
            if tensor is None:
                arrays.append(None)
                continue
            array = from_torch(tensor)
            target = caller_out.get(name)
            if target is not None:
                if not np.shares_memory(target, array):
                    np.copyto(target, array)
                array = target
            arrays.append(array)
        return tuple(arrays) if len(names) > 1 else arrays[0]

    return convert


def _strides(array: np.ndarray | None) -> tuple[int, ...] | None:
    return None if array is None else array.strides


def _missing_output(op: Operator, tensors: dict[str, Any]) -> bool:
    """Whether an output is to be allocated (a loop: cheaper than any() on the hot path)."""
    for name in op.outputs:  # noqa: SIM110 - measured: any() + genexpr costs 8% of submit
        if tensors[name] is None:
            return True
    return False


def _group_key(batch: Batch) -> int:
    """Batches started together: every part of one split request, else each batch alone."""
    return id(batch.requests[0]) if batch.part is not None else id(batch)


def _settle(request: Request) -> None:
    """Wake the request's waiter: its event, its thread-side future, its graph run."""
    request.done.set()
    if request.graph is not None:
        run, node_run = request.graph
        if request.state is RequestState.DONE:
            run.finished(node_run, None)
        else:
            run.finished(node_run, request.error or SchedulerClosedError("cancelled"))
    future = request.future
    if future is not None and not future.done():
        if request.state is RequestState.DONE:
            future.set_result(_result(request))
        elif request.error is not None:
            future.set_exception(request.error)
        else:
            future.cancel()


def _launch_error(request: Request, cause: BaseException) -> BaseException:
    if isinstance(cause, RuntimeLaunchError):
        return cause
    error = RuntimeLaunchError(
        f"{request.op.name}: the launch failed: {type(cause).__name__}: {cause}"
    )
    error.__cause__ = cause
    return error


def _check_graph_inputs(
    graph: Graph, outputs: list[Node], inputs: dict[Any, Any], torch_inputs: bool = False
) -> dict[Node | Placeholder, Any]:
    """Check ``inputs`` against the graph: owners, geometry, every needed placeholder
    (``torch_inputs``: a torch device, which also takes tensors)."""
    for key, array in inputs.items():
        if not isinstance(key, Node | Placeholder) or key.graph is not graph:
            msg = f"run: inputs key {key!r} is not a placeholder or node of this graph"
            raise ValueError(msg)
        meta = stand_in(array) if torch_inputs and is_torch_tensor(array) else array
        if not isinstance(meta, np.ndarray):
            kinds = "a numpy.ndarray or a torch tensor" if torch_inputs else "a numpy.ndarray"
            msg = f"run: inputs[{key.name!r}] must be {kinds}, got {type(array).__qualname__}"
            raise TypeError(msg)
        if meta.shape != key.shape or meta.dtype != key.dtype:
            msg = (
                f"run: inputs[{key.name!r}] has shape {meta.shape} and dtype {meta.dtype}; "
                f"expected {key.shape} and {key.dtype}"
            )
            raise ParamInvalidError(msg)
    fed = frozenset(k.index for k in inputs if isinstance(k, Node))
    plan = graph._plan(tuple(n.index for n in outputs), fed)
    for placeholder, user in plan.placeholders:
        if placeholder not in inputs:
            msg = (
                f"run: placeholder {placeholder.name!r} (used by node {user!r}) has no "
                "array in inputs"
            )
            raise ParamNullptrError(msg)
    return inputs
