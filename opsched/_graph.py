"""Task graphs: build once, check at build time, run many times.

A :class:`Graph` holds operator nodes whose inputs are arrays, :class:`Placeholder` inputs
bound at each run, or earlier nodes (so no data cycle can be built); ``after`` adds
ordering-only edges, refused when they would close a cycle. Every SPEC check runs when a node
is added, on zero-byte stand-ins of the inferred shapes and dtypes.

A run (:class:`GraphRun`, driven by the scheduler) submits a node to the scheduler's queue as
soon as every node it depends on has been *launched*: it then fuses with whatever else is
queued, and its launch waits on its producers' stream events on the device side, so a chain
does not make a trip through the event loop per edge. Intermediate outputs come from the
workspace pool and go back when their last consumer has finished; requested outputs are the
caller's arrays. A failing node fails everything downstream, with the cause chained;
independent branches still complete.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from opsched._errors import AclnnError, GraphExecutionError, UpstreamFailedError
from opsched._products import Product
from opsched._torch_device import is_torch_tensor, stand_in
from opsched.ops import GLU_BACKWARD, GROUP_NORM_BACKWARD, GROUP_NORM_GRAD, Operator

if TYPE_CHECKING:
    from opsched._batching import Request
    from opsched._devices import Event
    from opsched._pool import Block

__all__ = ["Graph", "GraphRun", "Node", "Placeholder"]


@attrs.define(eq=False, repr=False)
class Placeholder:
    """A graph input bound to an array at each run (``inputs={placeholder: array}``)."""

    graph: Graph
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    def __repr__(self) -> str:
        return f"<Placeholder {self.name!r} {self.shape} {self.dtype}>"


@attrs.define(eq=False, repr=False)
class Node:
    """One operator call in a graph; stands for its output array in later nodes.

    An operator with several outputs (GroupNormBackward) stands for its first requested
    output (``dx``) in later nodes; a run returns its whole tuple of outputs.
    """

    graph: Graph
    index: int
    name: str
    op: Operator
    args: dict[str, Any]
    scalars: dict[str, Any]
    shape: tuple[int, ...]
    dtype: np.dtype
    #: Nodes this one must run after (data producers and ordering-only edges).
    deps: list[Node] = attrs.field(factory=list)
    #: What its checks established, reused at every run: fusion key, units, bytes and the
    #: signature of its geometry (runs bind arrays of exactly this geometry).
    key: Any = None
    units: int = 0
    nbytes: int = 0
    signature: Any = None
    #: ``(argument, kind, value)``: how a run binds each argument (kind: array, node index,
    #: placeholder), precomputed so binding is a plain loop.
    binding: tuple[tuple[str, object, Any], ...] = ()
    #: The output argument the node stands for, and the operator's other requested outputs
    #: ``(argument, shape, dtype)``, allocated fresh at each run.
    output: str = ""
    extra_outputs: tuple[tuple[str, tuple[int, ...], np.dtype], ...] = ()
    #: Zero-byte stand-ins of its arguments, to check it again for a product.
    stand_ins: dict[str, Any] = attrs.field(factory=dict)

    def __repr__(self) -> str:
        return f"<Node {self.name!r} {self.op.name} -> {self.shape} {self.dtype}>"


_ARRAY, _NODE, _PLACEHOLDER = object(), object(), object()  # kinds of a node argument


def _stand_in(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero-byte array with ``shape`` and ``dtype``, for running checks at build time."""
    return np.broadcast_to(np.empty((), dtype), shape)


@attrs.define(eq=False)
class Graph:
    """A graph of operator calls; see the module docstring.

    Example::

        g = opsched.Graph()
        a = g.group_norm_grad(x, dy, gamma, mean, rstd)
        b = g.glu_backward(a, gate, dim=-1)
        outs = await sched.run(g, outputs=[a, b])
    """

    nodes: list[Node] = attrs.field(factory=list, init=False)
    placeholders: list[Placeholder] = attrs.field(factory=list, init=False)
    _plans: dict[tuple[Any, ...], _RunPlan] = attrs.field(factory=dict, init=False)
    #: Products every node passed the checks of (cleared when nodes are added).
    _products_checked: set[str] = attrs.field(factory=set, init=False)

    def check_on(self, product: Product) -> None:
        """Check every node as ``product``'s runtime would (see :mod:`opsched._products`).

        Raises:
            InnerError: a node's operator is not available on the product (561003).
            ParamInvalidError: a node's dtype is not in the product's list (161002).
            Both name the node.
        """
        if product.name in self._products_checked:
            return
        for node in self.nodes:
            try:
                node.op.check_on(product, node.stand_ins, node.scalars, allocate=True)
            except AclnnError as err:
                raise type(err)(f"node {node.name!r}: {err.args[0]}", status=err.status) from err
        self._products_checked.add(product.name)

    def input(self, shape: Sequence[int], dtype: Any, *, name: str | None = None) -> Placeholder:
        """A placeholder for an array of ``shape`` and ``dtype`` given at each run."""
        ph = Placeholder(
            self, name or f"input{len(self.placeholders)}", tuple(shape), np.dtype(dtype)
        )
        self.placeholders.append(ph)
        return ph

    def glu_backward(
        self, grad_out: Any, self_: Any, dim: int = -1, *, name: str | None = None
    ) -> Node:
        """Add a GluBackward node (arguments as :func:`opsched.aclnn` / the scheduler).

        Raises:
            ParamNullptrError, ParamInvalidError, TypeError: the SPEC checks, at once,
                naming the node.
        """
        return self._add(GLU_BACKWARD, {"grad_out": grad_out, "self": self_}, {"dim": dim}, name)

    def group_norm_grad(
        self, x: Any, dy: Any, gamma: Any, mean: Any, rstd: Any, *, name: str | None = None
    ) -> Node:
        """Add a GroupNormalizationGrad node; checks as :meth:`glu_backward`."""
        args = {"x": x, "dy": dy, "gamma": gamma, "mean": mean, "rstd": rstd}
        return self._add(GROUP_NORM_GRAD, args, {}, name)

    def group_norm_backward(
        self,
        grad_out: Any,
        input: Any,
        mean: Any,
        rstd: Any,
        gamma: Any,
        N: int,
        C: int,
        HxW: int,
        group: int,
        output_mask: Sequence[bool] = (True, True, True),
        *,
        name: str | None = None,
    ) -> Node:
        """Add a GroupNormBackward node; it stands for ``dx`` in later nodes, and a run
        returns its ``(dx, dgamma, dbeta)``. Checks as :meth:`glu_backward`."""
        args = {"grad_out": grad_out, "input": input, "mean": mean, "rstd": rstd, "gamma": gamma}
        scalars = {"N": N, "C": C, "HxW": HxW, "group": group, "output_mask": output_mask}
        return self._add(GROUP_NORM_BACKWARD, args, scalars, name)

    def after(self, node: Node, *others: Node) -> None:
        """Make ``node`` run after each of ``others`` (an ordering-only edge).

        Raises:
            ValueError: a node of another graph, or an edge that would close a cycle.
        """
        for other in (node, *others):
            self._own(other, "after")
        for other in others:
            if other is node or self._reaches(node, other):
                msg = f"after({node.name!r}, {other.name!r}) would close a cycle"
                raise ValueError(msg)
            if other not in node.deps:
                node.deps.append(other)
        self._plans.clear()
        self._products_checked.clear()

    def _add(
        self, op: Operator, args: dict[str, Any], scalars: dict[str, Any], name: str | None
    ) -> Node:
        name = name or f"{op.name}#{len(self.nodes)}"
        stand_ins: dict[str, Any] = {}
        deps: list[Node] = []
        for arg, value in args.items():
            if is_torch_tensor(value):  # checked on its shape and dtype; bound at each run
                stand_ins[arg] = stand_in(value)
            elif isinstance(value, Node | Placeholder):
                self._own(value, name)
                if isinstance(value, Node) and value.output != value.op.outputs[0]:
                    msg = (
                        f"node {name!r}: {arg} is node {value.name!r}, whose "
                        f"{value.op.outputs[0]} its output_mask leaves out"
                    )
                    raise ValueError(msg)
                stand_ins[arg] = _stand_in(value.shape, value.dtype)
                if isinstance(value, Node) and value not in deps:
                    deps.append(value)
            else:
                stand_ins[arg] = value
        for out in op.outputs:
            stand_ins[out] = None
        try:
            checked = op.check(stand_ins, scalars, allocate=True)
        except (AclnnError, TypeError) as err:
            raise type(err)(f"node {name!r}: {err.args[0]}") from err
        spec = op.output_spec(stand_ins, checked)
        kept = dict(stand_ins)  # the arguments as checked, outputs None
        (output, (shape, dtype)), *extra = spec.items()
        node = Node(self, len(self.nodes), name, op, dict(args), checked, shape, dtype, deps)
        node.stand_ins = kept
        node.output = output
        node.extra_outputs = tuple((out, s, d) for out, (s, d) in extra)
        stand_ins.update({out: _stand_in(s, d) for out, (s, d) in spec.items()})
        node.key, node.units = op.fusion(stand_ins, checked)
        node.nbytes = op.nbytes(stand_ins)
        node.signature = op.signature(stand_ins, scalars)
        node.binding = tuple(
            (arg, _NODE, v.index) if isinstance(v, Node)
            else (arg, _PLACEHOLDER, v) if isinstance(v, Placeholder)
            else (arg, _ARRAY, v)
            for arg, v in args.items()
        )  # fmt: skip
        self.nodes.append(node)
        self._plans.clear()
        self._products_checked.clear()
        return node

    def _plan(self, outputs: tuple[int, ...], fed: frozenset[int]) -> _RunPlan:
        """The nodes a run of ``outputs`` needs when the ``fed`` nodes are given (cached)."""
        key = (outputs, fed)
        plan = self._plans.get(key)
        if plan is None:
            order: list[int] = []
            seen: set[int] = set()

            def visit(n: Node) -> None:
                if n.index in seen:
                    return
                seen.add(n.index)
                if n.index not in fed:
                    for d in n.deps:
                        visit(d)
                order.append(n.index)

            for i in outputs:
                visit(self.nodes[i])
            deps = tuple(
                () if i in fed else tuple(d.index for d in self.nodes[i].deps) for i in order
            )
            used: dict[Placeholder, str] = {}
            for i in order:
                if i not in fed:
                    for _, kind, value in self.nodes[i].binding:
                        if kind is _PLACEHOLDER:
                            used.setdefault(value, self.nodes[i].name)
            plan = self._plans[key] = _RunPlan(
                tuple(order), deps, frozenset(outputs), tuple(used.items())
            )
        return plan

    def _own(self, item: Node | Placeholder, where: str) -> None:
        if item.graph is not self:
            msg = f"{where}: {item!r} belongs to another graph"
            raise ValueError(msg)

    @staticmethod
    def _reaches(start: Node, target: Node) -> bool:
        """Whether ``target`` depends on ``start`` (so ``start`` cannot wait for it)."""
        stack, seen = [target], set()
        while stack:
            n = stack.pop()
            if n is start:
                return True
            if id(n) not in seen:
                seen.add(id(n))
                stack.extend(n.deps)
        return False


class NodeState(enum.Enum):
    """Where a node is in one run."""

    WAITING = "waiting"  # for nodes it depends on to launch
    QUEUED = "queued"
    LAUNCHED = "launched"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    FED = "fed"  # its value was given in ``inputs``


class _NodeRun:
    """One node's state in one run (a plain slotted class: a run makes one per node)."""

    __slots__ = (
        "block", "consumers", "consumers_left", "error", "event", "node", "output",
        "producers", "request", "state", "waiting", "wanted",
    )  # fmt: skip

    def __init__(self, node: Node, wanted: bool) -> None:
        self.node = node
        self.wanted = wanted  # the caller asked for its output: theirs, not pooled
        self.state = NodeState.WAITING
        self.waiting = 0
        self.consumers: list[_NodeRun] = []
        self.producers: list[_NodeRun] = []
        self.consumers_left = 0
        self.output: np.ndarray | None = None
        self.block: Block | None = None
        self.request: Request | None = None
        self.event: Event | None = None
        self.error: BaseException | None = None


@attrs.frozen
class _RunPlan:
    """What a run of given outputs (and fed nodes) needs, computed once per graph version."""

    order: tuple[int, ...]  # needed node indices, producers before consumers
    deps: tuple[tuple[int, ...], ...]  # per entry of ``order``: its needed dependencies
    wanted: frozenset[int]
    #: ``(placeholder, name of a node using it)`` for every placeholder the run binds.
    placeholders: tuple[tuple[Placeholder, str], ...]


@attrs.define(eq=False)
class GraphRun:
    """The state of one run of a graph on a scheduler (driven by the scheduler).

    The callables are the scheduler's: ``submit`` queues a node's request, ``allocate`` /
    ``release`` handle intermediate memory, ``drop`` fails a queued request, ``done`` is
    called once every needed node is final. Everything runs on the scheduler's loop thread.
    """

    graph: Graph
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
    _placeholders: dict[Placeholder, np.ndarray] = attrs.field(factory=dict)

    def start(self, inputs: Mapping[Node | Placeholder, np.ndarray]) -> None:
        """Set up the nodes the outputs need, bind inputs, submit the ready ones."""
        fed = frozenset(n.index for n in inputs if isinstance(n, Node))
        plan = self.graph._plan(tuple(n.index for n in self.outputs), fed)
        nodes = self.graph.nodes
        runs = self.runs
        for index, deps in zip(plan.order, plan.deps, strict=True):
            nr = runs[index] = _NodeRun(nodes[index], index in plan.wanted)
            if index in fed:
                nr.state, nr.output = NodeState.FED, inputs[nodes[index]]
                continue
            self.left += 1
            for d in deps:
                producer = runs[d]
                nr.producers.append(producer)
                producer.consumers.append(nr)
                producer.consumers_left += 1
                if producer.state is not NodeState.FED:
                    nr.waiting += 1
        self._placeholders = {ph: a for ph, a in inputs.items() if isinstance(ph, Placeholder)}
        if not self.left:
            self.done()
            return
        for index in plan.order:
            nr = runs[index]
            if nr.state is NodeState.WAITING and nr.waiting == 0:
                self._submit(nr)

    def _submit(self, nr: _NodeRun) -> None:
        node = nr.node
        tensors: dict[str, Any] = {}
        runs, placeholders = self.runs, self._placeholders
        for arg, kind, value in node.binding:
            if kind is _ARRAY:
                tensors[arg] = value
            elif kind is _NODE:
                tensors[arg] = runs[value].output
            else:
                tensors[arg] = placeholders[value]
        waits = [p.event for p in nr.producers if p.event is not None]
        if nr.wanted:
            nr.output = self.fresh(node.shape, node.dtype)  # the caller's array
        else:
            nr.output, nr.block = self.allocate(node.shape, node.dtype)
        for out in node.op.outputs:  # outputs not asked for stay None
            tensors[out] = None
        tensors[node.output] = nr.output
        for out, shape, dtype in node.extra_outputs:
            tensors[out] = self.fresh(shape, dtype)
        nr.state = NodeState.QUEUED
        nr.request = self.submit(self, nr, tensors, waits)

    # ------------------------------------------------------------------ scheduler hooks

    def launched(self, nr: _NodeRun, event: Event | None) -> None:
        """``nr``'s launch was enqueued; ``event`` completes when it has run (None: it runs
        inline, before any consumer can be dispatched)."""
        nr.state = NodeState.LAUNCHED
        nr.event = event
        for consumer in nr.consumers:
            consumer.waiting -= 1
            if consumer.waiting == 0 and consumer.state is NodeState.WAITING and not self.cancelled:
                self._submit(consumer)

    def finished(self, nr: _NodeRun, error: BaseException | None) -> None:
        """``nr``'s request reached a final state (``error`` None: success)."""
        if nr.state in (NodeState.DONE, NodeState.FAILED, NodeState.CANCELLED):
            return
        upstream = next(
            (
                self.runs[d.index]
                for d in nr.node.deps
                if self.runs[d.index].state is NodeState.FAILED
            ),
            None,
        )
        if error is None and upstream is not None:
            error = _upstream_error(nr.node, upstream)
        if error is None:
            nr.state = NodeState.DONE
        else:
            nr.state = NodeState.CANCELLED if self.cancelled else NodeState.FAILED
            nr.error = error
            self._fail_downstream(nr)
        self._settle(nr)

    def queued(self) -> list[Request]:
        """Requests of this run still in the scheduler's queue."""
        return [
            nr.request
            for nr in self.runs.values()
            if nr.state is NodeState.QUEUED and nr.request is not None
        ]

    def cancel(self) -> list[Request]:
        """Stop the run: nodes not yet launched will not be; returns queued requests."""
        self.cancelled = True
        queued = []
        for nr in self.runs.values():
            if nr.state is NodeState.WAITING:
                nr.state = NodeState.CANCELLED
                self._settle(nr)
            elif nr.state is NodeState.QUEUED and nr.request is not None:
                queued.append(nr.request)
        return queued

    def _fail_downstream(self, failed: _NodeRun) -> None:
        for consumer in failed.consumers:
            if consumer.state is NodeState.WAITING:
                consumer.state = NodeState.FAILED
                consumer.error = _upstream_error(consumer.node, failed)
                self._settle(consumer)
                self._fail_downstream(consumer)
            elif consumer.state is NodeState.QUEUED and consumer.request is not None:
                # out of the queue at once; its request's end calls finished() for it
                self.drop(consumer.request, _upstream_error(consumer.node, failed))
            # a launched consumer fails when its launch finishes (its result is discarded)

    def _settle(self, nr: _NodeRun) -> None:
        """A node is final: free the inputs it held, count it, finish the run."""
        for producer in nr.producers:
            producer.consumers_left -= 1
            self._maybe_release(producer)
        self._maybe_release(nr)
        self.left -= 1
        if self.left == 0:
            self.done()

    def _maybe_release(self, nr: _NodeRun) -> None:
        final = nr.state in (NodeState.DONE, NodeState.FAILED, NodeState.CANCELLED)
        if nr.block is not None and final and nr.consumers_left == 0:
            self.release(nr.block)
            nr.block = None

    def result(self) -> list[np.ndarray]:
        """The requested outputs, or GraphExecutionError naming every failed node."""
        failed = {
            nr.node.name: nr.error
            for nr in self.runs.values()
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
    if nr.state is not NodeState.DONE:
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
