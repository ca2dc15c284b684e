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
import itertools
import weakref
from collections.abc import Mapping, Sequence
from time import monotonic
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
from opsched.core.graph import GraphBuilder, Node, NodeState, Placeholder, RunPlan
from opsched.core.requests import RUNNING, Request, RequestState, finish, past_deadline
from opsched.devices import Device, Event, meta_of

if TYPE_CHECKING:
    from opsched.core.engine import Engine

__all__ = ["GraphRun", "NodeState", "run_graph"]


#: The nodes fed of a run given no inputs (the usual run: its plan's key, made once).
_NONE_FED: frozenset[int] = frozenset()

#: The states a node ends in.
_FINAL = frozenset({NodeState.DONE, NodeState.FAILED, NodeState.CANCELLED})

#: The states every node of every run passes through, bound once (as
#: :data:`opsched.core.requests.DONE` is: a member read through its class is dearer).
_WAITING, _QUEUED, _LAUNCHED, _DONE, _FAILED = (
    NodeState.WAITING,
    NodeState.QUEUED,
    NodeState.LAUNCHED,
    NodeState.DONE,
    NodeState.FAILED,
)


@attrs.define(eq=False)
class GraphRun:
    """The state of one run of a graph on a scheduler (driven by the scheduler).

    A node is its index in the graph. What every run of the same outputs shares is the
    plan's (:class:`~opsched.core.graph.RunPlan`: producers, consumers, where each node
    starts); what one run changes is in lists by node index, copied from the plan's
    tables as the run starts: a run makes no object per node, and wires nothing.
    ``done`` is called once every needed node is final. Everything runs on the
    scheduler's loop thread.
    """

    engine: Engine
    graph: GraphBuilder
    plan: RunPlan
    outputs: list[Node]
    priority: int
    deadline: float | None
    done: Any
    nodes: list[Node] = attrs.field(init=False)
    #: How the device takes a bound array (None: as it is, the host devices).
    admit: Any = attrs.field(init=False)
    #: The device's weak reference (one per device: what its nodes remember it by).
    device_ref: weakref.ref[Device] = attrs.field(init=False)
    #: Per node: where it is, its producers not launched yet (fed ones never count), its
    #: consumers not final yet.
    state: list[NodeState | None] = attrs.field(init=False)
    waiting: list[int] = attrs.field(init=False)
    consumers_left: list[int] = attrs.field(init=False)
    #: Per node: its output array; its request while it may be withdrawn (let go of once
    #: final), and that request's id, kept (the trace draws edges by it).
    output: list[Any] = attrs.field(init=False)
    requests: list[Request | None] = attrs.field(init=False)
    request_ids: list[int | None] = attrs.field(init=False)
    #: The nodes holding a pooled intermediate block; those launched on a stream, with the
    #: event their consumers wait on (only then can a node have producers to wait for:
    #: inline launches record none); those that failed, with their errors.
    blocks: dict[int, Any] = attrs.field(init=False, factory=dict)
    events: dict[int, Event] = attrs.field(init=False, factory=dict)
    errors: dict[int, BaseException] = attrs.field(init=False, factory=dict)
    #: Nodes not final yet.
    left: int = attrs.field(init=False)
    cancelled: bool = attrs.field(init=False, default=False)
    #: Whether some node of the run failed: only then can a finishing node have a failed
    #: producer to blame (the common run never looks).
    failed: bool = attrs.field(init=False, default=False)
    #: Node requests to run where they were submitted, in order (nothing queued or running:
    #: :meth:`~opsched.core.engine.Engine.runs_at_submit`); :func:`_run_at_submit` runs them.
    at_submit: collections.deque[Request] = attrs.field(init=False, factory=collections.deque)
    placeholders: dict[Placeholder, Any] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        device, plan = self.engine.device, self.plan
        self.nodes = self.graph.nodes
        self.admit = None if type(device).admit is Device.admit else device.admit
        self.device_ref = weakref.ref(device)
        self.state = list(plan.states)
        self.waiting = list(plan.waiting)
        self.consumers_left = list(plan.consumer_counts)
        count = len(self.state)
        self.output = [None] * count
        self.requests = [None] * count
        self.request_ids = [None] * count
        self.left = plan.computed

    def start(self, inputs: Mapping[Node | Placeholder, Any]) -> None:
        """Bind ``inputs`` (the fed nodes' values and the placeholders' arrays), submit the
        nodes ready at once."""
        output, nodes = self.output, self.nodes
        for index in self.plan.fed:
            output[index] = inputs[nodes[index]]
        if inputs:
            self.placeholders = {ph: a for ph, a in inputs.items() if isinstance(ph, Placeholder)}
        if not self.left:
            self.done()
            return
        for index in self.plan.ready:
            self._submit(index)

    def _submit(self, index: int, queued: list[Request] | None = None) -> None:
        """Bind node ``index``'s arguments and outputs, and queue its request (given
        ``queued``, the caller's list of requests to queue together, appended to it). Its
        checks ran when it was added; a run binds arrays of exactly the checked geometry,
        so nothing is checked again."""
        node = self.nodes[index]
        geometry = node.geometry  # (one object for every node of its geometry)
        engine = self.engine
        device = engine.device
        tensors = node.fixed.copy()  # its arrays; outputs not asked for stay None
        output = self.output
        for arg, producer in node.from_nodes:
            tensors[arg] = output[producer]
        for arg, placeholder in node.from_placeholders:
            tensors[arg] = self.placeholders[placeholder]
        admit = self.admit
        if admit is not None:  # (before its outputs are bound: those are the device's own)
            tensors = {n: v if v is None else admit(node.name, n, v) for n, v in tensors.items()}
        events = self.events
        waits = None
        if events:  # some node launched on a stream: wait for its producers' events
            waits = [events[p] for p in self.plan.producers[index] if p in events] or None
        on, key, pooled = geometry.launch_on
        checked = on is self.device_ref  # (a device's one weak reference: ran there before)
        if not checked:  # the device's launch key, as a caller's request of these shapes gets
            key = device.launch_key(geometry.op, geometry.stand_ins, geometry.key)
            pooled = geometry.output_nbytes >= device.pools_intermediates_from
        if pooled and index not in self.plan.wanted:
            made, block = device.intermediate(geometry.shape, geometry.dtype)
            if block is not None:
                self.blocks[index] = block
        else:  # the caller's array, or a small one
            made = device.empty(geometry.shape, geometry.dtype)
        output[index] = tensors[geometry.output] = made
        for out, shape, dtype in geometry.extra_outputs:
            tensors[out] = device.empty(shape, dtype)
        self.state[index] = _QUEUED
        request = Request(
            engine.new_id(),
            monotonic(),
            geometry.op,
            tensors,
            geometry.scalars,
            key,
            geometry.units,
            geometry.nbytes,
            self.priority,
            self.deadline,
            geometry.signature,
        )
        self.requests[index] = request
        self.request_ids[index] = request.id
        request.graph = (self, index)
        request.waits = waits
        counters = engine.counters
        counters.submitted += 1
        counters.graph_nodes += 1
        if not checked:
            try:  # as for callers: a node alone over the workspace cap fails
                device.check_fits(
                    geometry.op,
                    tensors,
                    geometry.scalars,
                    geometry.key,
                    geometry.units,
                    geometry.nbytes,
                )
            except Exception as exc:  # the cap's ParamInvalidError; or (boundary) the device
                # could not answer: recorded and counted already, the request must end
                if not isinstance(exc, ParamInvalidError):
                    what = (
                        f"graph run: checking node {node.name!r} against the workspace cap failed"
                    )
                    exc = InnerError.caused_by(what, exc)
                finish(request, RequestState.FAILED, counters, exc)
                return
            # the device's answers hold for every node of this geometry, at every run
            geometry.launch_on = (self.device_ref, key, pooled)
        if not request.nbytes:  # an empty tensor: done at once, without a launch
            self.launched(index, None)
            engine.finish_empty(request)
        # (a launch in flight first: a busy scheduler, a node's usual case, skips the call)
        elif not (waits or engine.dispatcher.inflight) and engine.runs_at_submit(
            request, alone=False
        ):
            request.state = RUNNING  # (never queued: nothing to take it out of)
            self.at_submit.append(request)
        elif queued is not None:
            queued.append(request)
        else:
            engine.enqueue(request)  # (a node still queued at the run's deadline expires)
            engine.dispatcher.schedule()

    # ------------------------------------------------------------------ scheduler hooks

    def launched(
        self, index: int, event: Event | None, queued: list[Request] | None = None
    ) -> None:
        """Node ``index``'s launch was enqueued; ``event`` completes when it has run (None:
        it runs inline, before any consumer can be dispatched). Its consumers' requests
        are queued now, or (``queued``) appended to the caller's list to queue together."""
        state, waiting = self.state, self.waiting
        state[index] = _LAUNCHED
        if event is not None:
            self.events[index] = event
        for consumer in self.plan.consumers[index]:
            waiting[consumer] -= 1
            if not waiting[consumer] and state[consumer] is _WAITING and not self.cancelled:
                try:
                    self._submit(consumer, queued)
                except Exception as exc:  # boundary: from the dispatcher (no memory for
                    # its output, a device error taking its arrays): the consumer fails,
                    # with what depends on it, never the dispatch that launched ``index``
                    name = self.nodes[consumer].name
                    what = f"graph run: submitting node {name!r} failed"
                    self.finished(consumer, InnerError.caused_by(what, exc))

    def finished(self, index: int, error: BaseException | None) -> None:
        """Node ``index``'s request reached a final state (``error`` None: success)."""
        state = self.state
        if state[index] in _FINAL:
            return
        # Let go of the request (its tensors, its waits) now, not when the run ends: held
        # by the run, a run's requests all stayed alive, and the objects they kept made the
        # young-generation collections come 40 times per 10,240 nodes instead of once. A
        # requested node of several outputs keeps it: its result is the request's tuple.
        if index not in self.plan.tuples:
            self.requests[index] = None
        if error is None and self.failed:
            error = self.upstream_failure(index)
        if error is None:
            if state[index] is _QUEUED:  # never declared launched (no event of its
                self.launched(index, None)  # launch to wait on): its consumers go now
            state[index] = _DONE
        else:
            state[index] = NodeState.CANCELLED if self.cancelled else _FAILED
            self.failed = self.failed or state[index] is _FAILED
            self.errors[index] = error
            self._fail_downstream(index)
        self._settle(index)

    def cancel(self) -> list[Request]:
        """Stop the run: nodes not yet launched will not be; returns queued requests."""
        self.cancelled = True
        queued = []
        state, requests = self.state, self.requests
        for index in self.plan.order:
            request = requests[index]
            if state[index] is _WAITING:
                state[index] = NodeState.CANCELLED
                self._settle(index)
            elif state[index] is _QUEUED and request is not None:
                queued.append(request)
        return queued

    def _fail_downstream(self, failed: int) -> None:
        state, requests = self.state, self.requests
        for consumer in self.plan.consumers[failed]:
            request = requests[consumer]
            if state[consumer] is _WAITING:
                state[consumer] = _FAILED
                self.failed = True
                self.errors[consumer] = self._upstream_error(consumer, failed)
                self._settle(consumer)
                self._fail_downstream(consumer)
            elif state[consumer] is _QUEUED and request is not None:
                # out of the queue at once; its request's end calls finished() for it
                self.engine.drop(request, self._upstream_error(consumer, failed))
            # a launched consumer fails when its launch finishes (its result is discarded)

    def upstream_failure(self, index: int) -> BaseException | None:
        """Why node ``index`` cannot have a result when one of its producers failed (its
        error, naming the first); None when none did."""
        state = self.state
        upstream = next((p for p in self.plan.producers[index] if state[p] is _FAILED), None)
        return None if upstream is None else self._upstream_error(index, upstream)

    def _upstream_error(self, index: int, failed: int) -> BaseException:
        """Why node ``index`` has no result: its producer ``failed`` failed."""
        name, upstream = self.nodes[index].name, self.nodes[failed].name
        error = UpstreamFailedError(
            f"node {name!r} did not produce a result: upstream node {upstream!r} failed"
        )
        error.__cause__ = self.errors.get(failed)
        return error

    def _settle(self, index: int) -> None:
        """A node is final: free the inputs it held, count it, finish the run."""
        blocks = self.blocks
        consumers_left = self.consumers_left
        for producer in self.plan.producers[index]:
            consumers_left[producer] -= 1
            if blocks and producer in blocks:  # (the cheap test first: most hold none)
                self._maybe_release(producer)
        if blocks and index in blocks:
            self._maybe_release(index)
        self.left -= 1
        if self.left == 0:
            self.done()

    def _maybe_release(self, index: int) -> None:
        """Release the pooled block node ``index`` holds once nothing will read it again."""
        if self.consumers_left[index] == 0 and self.state[index] in _FINAL:
            block = self.blocks.pop(index)
            self.engine.dispatcher.release(block, what="a graph intermediate")

    def unlink(self) -> None:
        """Break the run's reference cycles (each request and the run) once every node is
        final: reference counting then frees the run at once, instead of the garbage
        collector's later, costlier passes over everything."""
        for request in filter(None, self.requests):  # (most were let go as they finished)
            request.graph = None
        self.requests = []

    def name(self, index: int) -> str:
        """Node ``index``'s name."""
        return self.nodes[index].name

    def producer_ids(self, index: int) -> list[int]:
        """The ids of the requests of node ``index``'s producers (none for a fed one)."""
        ids = self.request_ids
        return [i for i in (ids[p] for p in self.plan.producers[index]) if i is not None]

    def result(self) -> list[Any]:
        """The requested outputs, or GraphExecutionError naming every failed node."""
        outs = [self._output(node.index) for node in self.outputs]
        if self.failed:
            state, errors = self.state, self.errors
            failed = {
                self.nodes[index].name: errors[index]
                for index in self.plan.order
                if state[index] is _FAILED and index in errors
            }
            if failed:
                raise GraphExecutionError(failed, outs)
        return outs

    def _output(self, index: int) -> Any:
        """What a run returns for a requested node: its output (the operator's tuple of
        outputs for a multi-output node), None when it did not complete."""
        state = self.state[index]
        if state is NodeState.FED:
            return self.output[index]
        if state is not _DONE:
            return None
        request = self.requests[index] if index in self.plan.tuples else None
        return self.output[index] if request is None else request.result


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
        engine, graph, plan, outputs, priority_of(priority), deadline_of(deadline, timeout), done
    )
    engine.counters.graph_runs += 1
    try:
        run.start(given)
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
            index = request.graph[1]
            error = run.upstream_failure(index) if run.failed else None
            if error is not None:
                finish(request, RequestState.FAILED, counters, error)
                continue
            if past_deadline(request):
                # expired before its launch, as in the queue: never declared launched, so
                # its consumers are never submitted (they fail with the run, not as requests)
                engine.run_at_submit(request)  # (expires it)
                continue
            run.launched(index, None)
            # its outputs are the device's, made for it at submit (:meth:`GraphRun._submit`)
            engine.run_at_submit(request, outputs_made=True)
    except Exception as exc:  # a bug queue fails the run's nodes still to run, never hangs it
        while queue:
            error = InnerError.caused_by("graph run: running a node failed", exc)
            finish(queue.popleft(), RequestState.FAILED, counters, error)
        raise


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
    fed = frozenset([k.index for k in inputs if isinstance(k, Node)]) if inputs else _NONE_FED
    plan = graph._plan(tuple([n.index for n in outputs]), fed)
    for index, user in plan.placeholders:
        placeholder = graph.placeholders[index]
        if placeholder not in inputs:
            msg = (
                f"run: placeholder {placeholder.name!r} (used by node "
                f"{graph.nodes[user].name!r}) has no array in inputs"
            )
            raise ParamNullptrError(msg)
    return inputs, plan
