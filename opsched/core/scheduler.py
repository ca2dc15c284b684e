"""The scheduler's public face: what a caller sees, each call handed to the engine.

:class:`Scheduler` holds one :class:`~opsched.core.engine.Engine` and nothing else; every
method documents the public contract and passes the call on. The per-operator methods of
the public :class:`opsched.Scheduler` are generated over :meth:`Scheduler.submit` (they
hand their call to the engine directly: the face adds no step to a request's path).
"""

from __future__ import annotations

from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from opsched.core.config import SchedulerConfig
from opsched.core.engine import Engine, SchedulerState
from opsched.core.graph import GraphBuilder, Node, Placeholder
from opsched.core.graph_run import run_graph
from opsched.core.requests import Pending
from opsched.core.stats import SchedulerStatistics
from opsched.devices import Device
from opsched.ops import Operator

__all__ = ["Scheduler", "SchedulerState"]


class Scheduler:
    """Fuses queued operator requests into launches on a device's streams.

    Create one with :func:`opsched.open_scheduler`; the module-level functions use the
    scheduler of the enclosing ``open_scheduler`` block or a default one per event loop.
    """

    __slots__ = ("__weakref__", "_engine")

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def state(self) -> SchedulerState:
        """The lifecycle state."""
        return self._engine.state

    @property
    def config(self) -> SchedulerConfig:
        """The configuration it was opened with."""
        return self._engine.config

    @property
    def device(self) -> Device:
        """The device it launches on."""
        return self._engine.device

    def submit(
        self,
        op: Operator,
        args: Sequence[Any],
        out: Any = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> Coroutine[Any, Any, Any]:
        """Run ``op`` on ``args`` (its parameters, in order) through the scheduler; the
        per-operator methods of :class:`opsched.Scheduler` are this with named arguments.

        Awaitable (a coroutine): ``await`` it for the result.

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
        return self._engine.submit((op, args, out, priority, deadline, timeout))

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
        engine = self._engine
        call = (op, args, out, priority, deadline, timeout)
        return Pending(engine, engine.submit_nowait(call))

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
        return self._engine.submit_threadsafe((op, args, out, priority, deadline, timeout))

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
        return self._engine.call_threadsafe((op, args, out, priority, deadline, timeout))

    def run(
        self,
        graph: GraphBuilder,
        outputs: Sequence[Node],
        *,
        inputs: Mapping[Node | Placeholder, Any] | None = None,
        priority: int = 0,
        deadline: float | None = None,
        timeout: float | None = None,
    ) -> Coroutine[Any, Any, list[Any]]:
        """Run the nodes ``outputs`` need; return their arrays, in order.

        Awaitable (a coroutine): the run starts, and its arguments are checked, at the
        ``await``.

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
        return run_graph(self._engine, graph, outputs, inputs, priority, deadline, timeout)

    def statistics(self) -> SchedulerStatistics:
        """A frozen snapshot of the scheduler's counters."""
        return self._engine.statistics()

    def memory_stats(self) -> dict[str, int]:
        """The device memory's counters with torch-style keys (the framework allocator's
        own on torch devices)."""
        return self._engine.device.memory_stats()

    def reset_peak_stats(self) -> None:
        """Restart the device memory's peak from its current size."""
        self._engine.device.reset_peak_stats()

    def empty_cache(self) -> None:
        """Release the device's cached, idle memory."""
        self._engine.device.empty_cache()

    async def aclose(self, *, cancel_pending: bool = False) -> None:
        """Close: refuse new requests, then drain (or fail) the pending ones.

        Args:
            cancel_pending: fail queued requests with SchedulerClosedError instead of running
                them; launches already running always finish.
        """
        await self._engine.aclose(cancel_pending=cancel_pending)

    def __repr__(self) -> str:
        engine = self._engine
        return f"<opsched.Scheduler {engine.state.value} on {engine.device.name}>"
