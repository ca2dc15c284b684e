"""Graph runs: one run's node states, and how the scheduler drives them.

A :class:`GraphRun` submits a node as soon as every node it depends on is launched; the
node's launch waits on its producers' stream events on the device, and its intermediate
output comes from the device (:meth:`Device.intermediate`) and goes back once its last
consumer has finished. :func:`run_graph` is :meth:`Scheduler.run`: it checks the run's
inputs, starts the run (its deadline is each node's: the scheduler expires a node still
queued then), applies its cancellation, and converts its results for the caller
(:meth:`Device.graph_converter`). The node requests it queues end through the scheduler's
one :func:`~opsched.core.requests.finish`.

Like the rest of the core, it knows devices only through their interface and operators only
through their descriptions.
"""

from __future__ import annotations

import collections
import enum
import functools
import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from opsched._errors import (
    GraphExecutionError,
    InnerError,
    ParamInvalidError,
    ParamNullptrError,
    UpstreamFailedError,
)
from opsched.core.checks import deadline_of, priority_of
from opsched.core.graph import NODE, GraphBuilder, Node, Placeholder, RunPlan
from opsched.core.requests import RUNNING, Request, RequestState, finish, past_deadline
from opsched.devices import Device, Event, meta_of

if TYPE_CHECKING:
    from opsched.core.engine import Engine

__all__ = ["GraphRun", "NodeState", "run_graph"]


class NodeState(enum.Enum):
    """Where a node is in one run."""

    WAITING = "waiting"  # for nodes it depends on to launch
    QUEUED = "queued"
    LAUNCHED = "launched"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    FED = "fed"  # its value was given in ``inputs``

    #: Members are singletons compared by identity: hashed by it too, in C (``Enum``'s
    #: Python-level ``__hash__`` cost a frame per ``in _FINAL`` test, one a node).
    __hash__ = object.__hash__


#: The states a node ends in.
_FINAL = frozenset({NodeState.DONE, NodeState.FAILED, NodeState.CANCELLED})

#: The states every node of every run passes through, bound once (as
#: :data:`opsched.core.requests.DONE` is: a member read through its class is dearer).
_WAITING, _QUEUED, _LAUNCHED, _DONE = (
    NodeState.WAITING,
    NodeState.QUEUED,
    NodeState.LAUNCHED,
    NodeState.DONE,
)


class _NodeRun:
    """One node's state in one run (a plain slotted class: a run makes one per node). Its
    producers and consumers are node indices, the same in every run of a plan
    (:class:`~opsched.core.graph.RunPlan`): a run wires nothing."""

    __slots__ = (
        "block",
        "consumers",
        "consumers_left",
        "error",
        "event",
        "node",
        "output",
        "producers",
        "request",
        "request_id",
        "state",
        "waiting",
        "wanted",
    )

    def __init__(
        self,
        node: Node,
        wanted: bool,
        producers: tuple[int, ...],
        consumers: tuple[int, ...],
        waiting: int,
    ) -> None:
        self.node = node
        self.wanted = wanted  # the caller asked for its output: theirs, not pooled
        self.state = _WAITING
        self.producers = producers
        self.consumers = consumers
        self.waiting = waiting  # producers not launched yet (fed ones never count)
        self.consumers_left = len(consumers)  # consumers not final yet
        self.output: np.ndarray | None = None
        self.block: Any = None
        self.request: Request | None = None  # let go of once final (see finished)
        self.request_id: int | None = None  # its id, kept: the trace draws edges by it
        self.event: Event | None = None
        self.error: BaseException | None = None


@attrs.define(eq=False)
class GraphRun:
    """The state of one run of a graph on a scheduler (driven by the scheduler).

    The callables are the scheduler's: ``submit`` queues a node's request, ``allocate`` /
    ``release`` handle intermediate memory, ``drop`` fails a queued request, ``done`` is
    called once every needed node is final. Everything runs on the scheduler's loop thread.
    """

    graph: GraphBuilder
    outputs: list[Node]
    priority: int
    deadline: float | None
    submit: Any
    allocate: Any
    release: Any
    done: Any
    drop: Any
    #: allocates a requested output (the caller's array: numpy, or a torch device's tensor)
    fresh: Any = attrs.field(default=np.empty, kw_only=True)
    runs: dict[int, _NodeRun] = attrs.field(factory=dict)
    left: int = 0
    cancelled: bool = False
    #: Whether some node of the run failed: only then can a finishing node have a failed
    #: producer to blame (the common run never looks).
    failed: bool = False
    #: Whether some node launched on a stream (with an event its consumers wait on): only
    #: then can a node have producers to wait for (inline launches record none).
    events: bool = False
    #: Node requests to run where they were submitted, in order (nothing queued or
    #: running: :meth:`~opsched.core.engine.Engine.runs_at_submit`); :func:`_run_at_submit` runs
    #: them.
    at_submit: collections.deque[Request] = attrs.field(factory=collections.deque)
    _placeholders: dict[Placeholder, np.ndarray] = attrs.field(factory=dict)

    def start(self, inputs: Mapping[Node | Placeholder, np.ndarray], plan: RunPlan) -> None:
        """Set up the nodes ``plan`` (the outputs' nodes, given ``inputs``) runs, bind
        inputs, submit the ready ones."""
        wanted, nodes, runs = plan.wanted, self.graph.nodes, self.runs
        for index, deps, consumers, waiting in zip(
            plan.order, plan.deps, plan.consumers, plan.waiting, strict=True
        ):
            runs[index] = _NodeRun(nodes[index], index in wanted, deps, consumers, waiting)
        for index in plan.fed.intersection(runs):
            nr = runs[index]
            nr.state, nr.output = NodeState.FED, inputs[nodes[index]]
        self.left = plan.computed
        if inputs:
            self._placeholders = {ph: a for ph, a in inputs.items() if isinstance(ph, Placeholder)}
        if not self.left:
            self.done()
            return
        for index in plan.ready:
            self._submit(runs[index])

    def _submit(self, nr: _NodeRun) -> None:
        node = nr.node
        tensors = node.fixed.copy()  # its arrays; outputs not asked for stay None
        runs = self.runs
        for arg, kind, value in node.binding:
            if kind is NODE:
                tensors[arg] = runs[value].output
            else:
                tensors[arg] = self._placeholders[value]
        waits: list[Event] = []
        if self.events:  # some node launched on a stream: wait for its producers' events
            waits = [e for e in (runs[p].event for p in nr.producers) if e is not None]
        if nr.wanted:
            nr.output = self.fresh(node.shape, node.dtype)  # the caller's array
        else:
            nr.output, nr.block = self.allocate(node.shape, node.dtype)
        tensors[node.output] = nr.output
        for out, shape, dtype in node.extra_outputs:
            tensors[out] = self.fresh(shape, dtype)
        nr.state = _QUEUED
        nr.request = request = self.submit(self, nr, tensors, waits)
        nr.request_id = request.id

    # ------------------------------------------------------------------ scheduler hooks

    def launched(self, nr: _NodeRun, event: Event | None) -> None:
        """``nr``'s launch was enqueued; ``event`` completes when it has run (None: it runs
        inline, before any consumer can be dispatched)."""
        nr.state = _LAUNCHED
        nr.event = event
        if event is not None:
            self.events = True
        runs = self.runs
        for index in nr.consumers:
            consumer = runs[index]
            consumer.waiting -= 1
            if consumer.waiting == 0 and consumer.state is _WAITING and not self.cancelled:
                try:
                    self._submit(consumer)
                except Exception as exc:  # boundary: from the dispatcher (no memory for
                    # its output, a device error taking its arrays): the consumer fails,
                    # with what depends on it, never the dispatch that launched ``nr``
                    what = f"graph run: submitting node {consumer.node.name!r} failed"
                    self.finished(consumer, InnerError.caused_by(what, exc))

    def finished(self, nr: _NodeRun, error: BaseException | None) -> None:
        """``nr``'s request reached a final state (``error`` None: success)."""
        if nr.state in _FINAL:
            return
        # Let go of the request (its tensors, its waits) now, not when the run ends: held
        # by the run, a run's requests all stayed alive, and the objects they kept made the
        # young-generation collections come 40 times per 10,240 nodes instead of once. A
        # requested node of several outputs keeps it: its result is the request's tuple.
        if not (nr.wanted and len(nr.node.op.outputs) > 1):
            nr.request = None
        if error is None and self.failed:
            upstream = next(
                (
                    self.runs[d.index]
                    for d in nr.node.deps
                    if self.runs[d.index].state is NodeState.FAILED
                ),
                None,
            )
            if upstream is not None:
                error = _upstream_error(nr.node, upstream)
        if error is None:
            if nr.state is _QUEUED:  # never declared launched (no event of its
                self.launched(nr, None)  # launch to wait on): its consumers go now
            nr.state = _DONE
        else:
            nr.state = NodeState.CANCELLED if self.cancelled else NodeState.FAILED
            self.failed = self.failed or nr.state is NodeState.FAILED
            nr.error = error
            self._fail_downstream(nr)
        self._settle(nr)

    def cancel(self) -> list[Request]:
        """Stop the run: nodes not yet launched will not be; returns queued requests."""
        self.cancelled = True
        queued = []
        for nr in self.runs.values():
            if nr.state is _WAITING:
                nr.state = NodeState.CANCELLED
                self._settle(nr)
            elif nr.state is _QUEUED and nr.request is not None:
                queued.append(nr.request)
        return queued

    def _fail_downstream(self, failed: _NodeRun) -> None:
        for index in failed.consumers:
            consumer = self.runs[index]
            if consumer.state is _WAITING:
                consumer.state = NodeState.FAILED
                self.failed = True
                consumer.error = _upstream_error(consumer.node, failed)
                self._settle(consumer)
                self._fail_downstream(consumer)
            elif consumer.state is _QUEUED and consumer.request is not None:
                # out of the queue at once; its request's end calls finished() for it
                self.drop(consumer.request, _upstream_error(consumer.node, failed))
            # a launched consumer fails when its launch finishes (its result is discarded)

    def _settle(self, nr: _NodeRun) -> None:
        """A node is final: free the inputs it held, count it, finish the run."""
        runs = self.runs
        for index in nr.producers:
            producer = runs[index]
            producer.consumers_left -= 1
            if producer.block is not None:  # (the cheap test first: most hold none)
                self._maybe_release(producer)
        if nr.block is not None:
            self._maybe_release(nr)
        self.left -= 1
        if self.left == 0:
            self.done()

    def _maybe_release(self, nr: _NodeRun) -> None:
        """Release the pooled block ``nr`` holds once nothing will read it again."""
        if nr.consumers_left == 0 and nr.state in _FINAL:
            self.release(nr.block)
            nr.block = None

    def unlink(self) -> None:
        """Break the run's reference cycles (each node run and its request) once every node
        is final: reference counting then frees the run at once, instead of the garbage
        collector's later, costlier passes over everything."""
        for nr in self.runs.values():
            if nr.request is not None:
                nr.request.graph = None
                nr.request = None

    def result(self) -> list[np.ndarray]:
        """The requested outputs, or GraphExecutionError naming every failed node."""
        failed = {
            nr.node.name: nr.error
            for nr in (self.runs.values() if self.failed else ())
            if nr.state is NodeState.FAILED and nr.error is not None
        }
        outs = [_output(n, self.runs[n.index]) for n in self.outputs]
        if failed:
            raise GraphExecutionError(failed, outs)
        return outs


def _output(node: Node, nr: _NodeRun) -> Any:
    """What a run returns for a requested node: its output (the operator's tuple of outputs
    for a multi-output node), None when it did not complete."""
    if nr.state is NodeState.FED:
        return nr.output
    if nr.state is not _DONE:
        return None
    if len(node.op.outputs) > 1 and nr.request is not None:
        return nr.request.result
    return nr.output


def _upstream_error(node: Node, failed: _NodeRun) -> BaseException:
    error = UpstreamFailedError(
        f"node {node.name!r} did not produce a result: upstream node {failed.node.name!r} failed"
    )
    error.__cause__ = failed.error
    return error


# ------------------------------------------------------------ the engine's side of runs


async def run_graph(
    engine: Engine,
    graph: GraphBuilder,
    outputs: Sequence[Node],
    inputs: Mapping[Node | Placeholder, Any] | None,
    priority: int,
    deadline: float | None,
    timeout: float | None,
) -> list[Any]:
    """:meth:`Scheduler.run`: see it for the arguments and errors."""
    done = engine.loop.new_event()
    run = _start(engine, graph, outputs, inputs, priority, deadline, timeout, done.set)
    try:
        # Its deadline is each node's: the scheduler expires a node still queued then
        # (which fails what depends on it); launched ones finish.
        await done.wait()
        loop = engine.loop
        if loop.scoped and loop.cancelled():
            await loop.checkpoint()
    except BaseException:
        _withdraw(engine, run)
        raise
    given = itertools.chain(  # read only by a device that converts results (torch)
        (inputs or {}).values(), (v for node in graph.nodes for v in node.args.values())
    )
    convert = engine.device.graph_converter(given)
    try:
        outs = run.result()
    except GraphExecutionError as exc:
        if convert is not None:
            convert(exc)
        raise
    finally:
        run.unlink()
    return outs if convert is None else convert(outs)


def _start(
    engine: Engine,
    graph: GraphBuilder,
    outputs: Sequence[Node],
    inputs: Mapping[Node | Placeholder, Any] | None,
    priority: int,
    deadline: float | None,
    timeout: float | None,
    done: Any,
) -> GraphRun:
    engine.require_open("graph runs")
    if not isinstance(graph, GraphBuilder):
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
    graph.check_on(engine.product)
    device = engine.device
    given, plan = check_inputs(
        graph, outputs, dict(inputs or {}), device.accepts_tensors, device.array_kinds
    )

    run = GraphRun(
        graph,
        outputs,
        priority_of(priority),
        deadline_of(deadline, timeout),
        functools.partial(_submit_node, engine),
        device.intermediate,
        functools.partial(engine.dispatcher.release, what="a graph intermediate"),
        done,
        engine.drop,
        fresh=device.empty,
    )
    engine.counters.graph_runs += 1
    try:
        run.start(given, plan)
    except BaseException:  # a node could not be submitted (no memory for its output, say):
        _withdraw(engine, run)  # the caller gets the error; what was queued is withdrawn
        raise
    if run.at_submit:
        _run_at_submit(engine, run)
    return run


def _withdraw(engine: Engine, run: GraphRun) -> None:
    """Stop ``run``: its nodes not yet launched never will be, its queued requests leave
    the queue, those it was to run at submit end unrun (their nodes end cancelled,
    releasing what they held)."""
    for request in run.cancel():
        if request.state is RequestState.QUEUED:
            engine.abandon(request)
    while run.at_submit:
        finish(run.at_submit.popleft(), RequestState.CANCELLED, engine.counters)


def _run_at_submit(engine: Engine, run: GraphRun) -> None:
    """Run the nodes :func:`_submit_node` gave to ``run`` (:attr:`GraphRun.queue`) one after
    another, each as its solo launch, in the loop thread: a node's consumers join the list
    when it is launched, behind it. A node whose producer failed meanwhile fails without a
    launch."""
    queue, counters = run.at_submit, engine.counters
    try:
        while queue:
            request = queue.popleft()
            node_run = request.graph[1]
            if run.failed:
                runs = run.runs
                upstream = next(
                    (runs[p] for p in node_run.producers if runs[p].state is NodeState.FAILED),
                    None,
                )
                if upstream is not None:
                    error = _upstream_error(node_run.node, upstream)
                    finish(request, RequestState.FAILED, counters, error)
                    continue
            if past_deadline(request):
                # expired before its launch, as in the queue: never declared launched, so
                # its consumers are never submitted (they fail with the run, not as requests)
                engine.run_at_submit(request)  # (expires it)
                continue
            run.launched(node_run, None)
            engine.run_at_submit(request)
    except Exception as exc:  # a bug queue fails the run's nodes still to run, never hangs it
        while queue:
            error = InnerError.caused_by("graph run: running a node failed", exc)
            finish(queue.popleft(), RequestState.FAILED, counters, error)
        raise


def _submit_node(
    engine: Engine, run: GraphRun, node_run: Any, tensors: dict[str, Any], waits: list[Event]
) -> Request:
    """Queue a graph node. Its checks ran when it was added; a run binds arrays of exactly
    the checked geometry, so nothing is checked again."""
    node = node_run.node
    device = engine.device
    if type(device).admit is not Device.admit:  # the host devices take arrays as they are
        outputs = node.op.outputs
        tensors = {
            n: v if v is None or n in outputs else device.admit(node.name, n, v)
            for n, v in tensors.items()
        }
    request = engine.record(
        (
            node.op,
            tensors,
            node.scalars,
            # the device's launch key, as a caller's request of these shapes gets it
            device.launch_key(node.op, node.stand_ins, node.key),
            node.units,
            node.nbytes,
            run.priority,
            run.deadline,
            node.signature,
        )
    )
    request.graph = (run, node_run)
    request.waits = waits or None
    counters = engine.counters
    counters.submitted += 1
    counters.graph_nodes += 1
    try:  # as for callers: a node alone over the workspace cap fails
        device.check_fits(node.op, tensors, node.scalars, node.key, node.units, node.nbytes)
    except Exception as exc:  # the cap's ParamInvalidError; or (boundary) the device
        # could not answer: recorded and counted already, the request must end either way
        if not isinstance(exc, ParamInvalidError):
            what = f"graph run: checking node {node.name!r} against the workspace cap failed"
            exc = InnerError.caused_by(what, exc)
        finish(request, RequestState.FAILED, counters, exc)
        return request
    if not request.nbytes:  # an empty tensor: done at once, without a launch
        run.launched(node_run, None)
        engine.finish_empty(request)
        return request
    # (queue.live first: a busy scheduler skips the call)
    if not waits and not engine.queue.live and engine.runs_at_submit(request):
        request.state = RUNNING  # (never queued: nothing to take it out of)
        run.at_submit.append(request)
        return request
    engine.enqueue(request)  # (a node still queued at the run's deadline expires)
    engine.dispatcher.schedule()
    return request


def check_inputs(
    graph: GraphBuilder,
    outputs: list[Node],
    inputs: dict[Any, Any],
    tensors: bool,
    kinds: str,
) -> tuple[dict[Node | Placeholder, Any], RunPlan]:
    """Check ``inputs`` against the graph: owners, geometry, every needed placeholder
    (``tensors``: the device takes framework tensors too; ``kinds``: what it takes, for
    the message). Returns them with the run's plan."""
    for key, array in inputs.items():
        if not isinstance(key, Node | Placeholder) or key.graph is not graph:
            msg = f"run: inputs key {key!r} is not a placeholder or node of this graph"
            raise ValueError(msg)
        meta = meta_of(array) if tensors else array
        if not isinstance(meta, np.ndarray):
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
    return inputs, plan
