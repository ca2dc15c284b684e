"""Task graphs: build once, check at build time, run many times.

A :class:`Graph` holds operator nodes whose inputs are arrays, :class:`Placeholder` inputs
bound at each run, or earlier nodes (so no data cycle can be built); ``after`` adds ordering-only
edges, refused when they would close a cycle. Every check of docs/operators.md runs when a node is
added, on zero-byte stand-ins of the inferred shapes and dtypes.

A run (:class:`~opsched.core.graph_run.GraphRun`, driven by the scheduler) submits a node to
the scheduler's queue as
soon as every node it depends on has been *launched*: it then fuses with whatever else is
queued, and its launch waits on its producers' stream events on the device side, so a chain
does not make a trip through the event loop per edge. Intermediate outputs come from the
workspace pool and go back when their last consumer has finished; requested outputs are the
caller's arrays. A failing node fails everything downstream, with the cause chained;
independent branches still complete.

This module is the builder: it knows operators only through their descriptions (the
per-operator methods of :class:`opsched.Graph` are generated) and devices not at all (a node
keeps what a run's device said of its geometry, :attr:`NodeGeometry.launch_on`, without
reading it). What a run of given outputs needs, it plans once (:class:`RunPlan`, by node
index).
"""

from __future__ import annotations

import enum
import math
import weakref
from collections.abc import Hashable, Sequence
from typing import Any

import attrs
import numpy as np

from opsched._errors import AclnnError
from opsched.core.checks import canonical_signature
from opsched.devices import is_tensor, meta_of
from opsched.ops import Operator
from opsched.ops.products import Product

__all__ = [
    "GraphBuilder",
    "Node",
    "NodeGeometry",
    "NodeState",
    "Placeholder",
    "RunPlan",
    "stand_in",
]


@attrs.define(eq=False, repr=False)
class Placeholder:
    """A graph input bound to an array at each run (``inputs={placeholder: array}``)."""

    graph: GraphBuilder
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    def __repr__(self) -> str:
        return f"<Placeholder {self.name!r} {self.shape} {self.dtype}>"


@attrs.define(eq=False, weakref_slot=True)
class NodeGeometry:
    """What a node's checks established, shared by every node of one operator, argument
    geometry and scalars (in any graph: runs bind arrays of exactly this geometry, so what
    was checked and asked of a device for one holds for all). A run reads these for every
    node it submits; shared, they are the same few objects for every client's graph of
    these shapes, not one copy a node."""

    op: Operator
    #: The checked scalars (read, never changed: every request of the geometry gets them).
    scalars: dict[str, Any]
    #: The output argument the node stands for, its shape, dtype and bytes; the operator's
    #: other requested outputs ``(argument, shape, dtype)``, allocated fresh at each run.
    output: str
    shape: tuple[int, ...]
    dtype: np.dtype
    output_nbytes: int
    extra_outputs: tuple[tuple[str, tuple[int, ...], np.dtype], ...]
    #: The fusion key, units, bytes and the signature of the geometry.
    key: Any
    units: int
    nbytes: int
    signature: Any
    #: Zero-byte stand-ins of its arguments, outputs None: to check it again for a product,
    #: and what a device's launch key is asked of.
    stand_ins: dict[str, Any]
    #: What the device it last ran on said of it, set once a node of it passed the
    #: device's workspace check: ``(a weak reference to the device, its launch key, whether
    #: its output comes from the device's pool)`` (weakly: a graph keeps no closed
    #: scheduler's device alive). What a run asks a device of a geometry only once
    #: (:meth:`~opsched.core.graph_run.GraphRun._submit`).
    launch_on: tuple[weakref.ref[Any] | None, Hashable, bool] = (None, None, False)


#: The geometries of the nodes alive, by operator and signature (a node without a
#: signature has a geometry of its own).
_GEOMETRIES: weakref.WeakValueDictionary[tuple[str, Hashable], NodeGeometry] = (
    weakref.WeakValueDictionary()
)


def _shared(geometry: NodeGeometry) -> NodeGeometry:
    """The geometry alive equal to ``geometry`` (by operator and signature), else it."""
    if geometry.signature is None:
        return geometry
    return _GEOMETRIES.setdefault((geometry.op.name, geometry.signature), geometry)


@attrs.define(eq=False, repr=False)
class Node:
    """One operator call in a graph; stands for its output array in later nodes.

    An operator with several outputs stands for its first requested
    output (``dx``) in later nodes; a run returns its whole tuple of outputs.
    """

    graph: GraphBuilder
    index: int
    name: str
    args: dict[str, Any]
    #: What its checks established (shared with every node of the same geometry).
    geometry: NodeGeometry
    #: Nodes this one must run after (data producers and ordering-only edges).
    deps: list[Node] = attrs.field(factory=list)
    #: How a run binds each argument that is not an array: ``(argument, node index)`` for
    #: one an earlier node's output, ``(argument, placeholder)`` for one a placeholder's.
    from_nodes: tuple[tuple[str, int], ...] = ()
    from_placeholders: tuple[tuple[str, Placeholder], ...] = ()
    #: The arguments every run binds alike: the arrays given, every output None (a run
    #: copies it, then binds the two above and its outputs).
    fixed: dict[str, Any] = attrs.field(factory=dict)

    @property
    def op(self) -> Operator:
        """The operator it calls."""
        return self.geometry.op

    @property
    def scalars(self) -> dict[str, Any]:
        """Its checked scalars."""
        return self.geometry.scalars

    @property
    def output(self) -> str:
        """The output argument it stands for."""
        return self.geometry.output

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the output it stands for."""
        return self.geometry.shape

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the output it stands for."""
        return self.geometry.dtype

    def __repr__(self) -> str:
        return f"<Node {self.name!r} {self.op.name} -> {self.shape} {self.dtype}>"


def stand_in(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero-byte array with ``shape`` and ``dtype``, for running checks at build time."""
    return np.broadcast_to(np.empty((), dtype), shape)


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
    #: Python-level ``__hash__`` cost a frame per ``in`` test, one a node).
    __hash__ = object.__hash__


@attrs.frozen(weakref_slot=True)
class RunPlan:
    """What a run of given outputs (and fed nodes) needs, computed once per graph version.

    Its tables are by node index, one entry for every node of the graph (a node the run
    does not need has no state, no producers and no consumers): a run copies the ones it
    changes (:class:`~opsched.core.graph_run.GraphRun`) and reads the others as they are.
    It names nodes and placeholders by index only, so graphs of one structure share one
    plan (:func:`_shared_plan`), as nodes of one geometry share theirs.
    """

    order: tuple[int, ...]  # needed node indices, producers before consumers
    #: per node: the needed nodes it depends on (none for a fed node), and those that
    #: depend on it
    producers: tuple[tuple[int, ...], ...]
    consumers: tuple[tuple[int, ...], ...]
    #: per node: where a run starts it (None: not needed), how many of its producers a run
    #: waits for (those not fed), and how many consumers it has
    states: tuple[NodeState | None, ...]
    waiting: tuple[int, ...]
    consumer_counts: tuple[int, ...]
    wanted: frozenset[int]
    #: the wanted nodes of several outputs: a run returns their request's tuple
    tuples: frozenset[int]
    #: ``(placeholder, a node using it)`` by index for every placeholder the run binds.
    placeholders: tuple[tuple[int, int], ...]
    fed: frozenset[int]  # the nodes whose values the run is given
    #: the needed nodes a run submits as it starts (none of their dependencies to wait
    #: for), in order; and how many nodes it computes (those not fed)
    ready: tuple[int, ...]
    computed: int


#: The run plans of the graphs alive, by their tables (one plan for graphs of one structure).
_RUN_PLANS: weakref.WeakValueDictionary[tuple[Any, ...], RunPlan] = weakref.WeakValueDictionary()


def _shared_plan(plan: RunPlan) -> RunPlan:
    """The plan alive with the same tables as ``plan`` (a graph of the same structure's),
    else it: many clients' graphs of one structure make their runs read one plan."""
    return _RUN_PLANS.setdefault(attrs.astuple(plan, recurse=False), plan)


@attrs.define(eq=False)
class GraphBuilder:
    """A graph of operator calls; see the module docstring. The public
    :class:`opsched.Graph` adds one method per operator.

    See :class:`opsched.Graph` for an example.
    """

    nodes: list[Node] = attrs.field(factory=list, init=False)
    placeholders: list[Placeholder] = attrs.field(factory=list, init=False)
    _plans: dict[tuple[Any, ...], RunPlan] = attrs.field(factory=dict, init=False)
    #: Products every node passed the checks of (cleared when nodes are added).
    _products_checked: set[str] = attrs.field(factory=set, init=False)

    def check_on(self, product: Product) -> None:
        """Check every node as ``product``'s runtime would (see :mod:`opsched.ops.products`).

        Raises:
            InnerError: a node's operator is not available on the product (561003).
            ParamInvalidError: a node's dtype is not in the product's list (161002).
            Both name the node.
        """
        if product.name in self._products_checked:
            return
        for node in self.nodes:
            geometry = node.geometry
            try:
                geometry.op.check_on(product, geometry.stand_ins, geometry.scalars, allocate=True)
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

    def add(
        self, op: Operator, args: dict[str, Any], scalars: dict[str, Any], name: str | None
    ) -> Node:
        """Add a node calling ``op`` (the generated per-operator methods call this).

        Raises:
            ParamNullptrError, ParamInvalidError, TypeError: the operator's checks
                (docs/operators.md), at once, naming the node.
            ValueError: an argument from another graph, or a node whose output the
                consumer cannot use.
        """
        name = name or f"{op.name}#{len(self.nodes)}"
        stand_ins: dict[str, Any] = {}
        deps: list[Node] = []
        for arg, value in args.items():
            if is_tensor(value):  # checked on its shape and dtype; bound at each run
                stand_ins[arg] = meta_of(value)
            elif isinstance(value, Node | Placeholder):
                self._own(value, name)
                if isinstance(value, Node) and value.output != value.op.outputs[0]:
                    msg = (
                        f"node {name!r}: {arg} is node {value.name!r}, whose "
                        f"{value.op.outputs[0]} its output_mask leaves out"
                    )
                    raise ValueError(msg)
                stand_ins[arg] = stand_in(value.shape, value.dtype)
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
        stand_ins.update({out: stand_in(s, d) for out, (s, d) in spec.items()})
        key, units = op.fusion(stand_ins, checked)
        geometry = NodeGeometry(
            op,
            checked,
            output,
            shape,
            dtype,
            math.prod(shape) * dtype.itemsize,
            tuple((out, s, d) for out, (s, d) in extra),
            key,
            units,
            op.nbytes(stand_ins),
            canonical_signature(op.signature(stand_ins, scalars)),
            kept,
        )
        node = Node(self, len(self.nodes), name, dict(args), _shared(geometry), deps)
        node.from_nodes = tuple((a, v.index) for a, v in args.items() if isinstance(v, Node))
        node.from_placeholders = tuple(
            (a, v) for a, v in args.items() if isinstance(v, Placeholder)
        )
        node.fixed = {a: v for a, v in args.items() if not isinstance(v, Node | Placeholder)}
        node.fixed.update(dict.fromkeys(op.outputs))
        self.nodes.append(node)
        self._plans.clear()
        self._products_checked.clear()
        return node

    def _plan(self, outputs: tuple[int, ...], fed: frozenset[int]) -> RunPlan:
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
            count = len(self.nodes)
            producers: list[tuple[int, ...]] = [()] * count
            consumers: list[list[int]] = [[] for _ in range(count)]
            states: list[NodeState | None] = [None] * count
            waiting = [0] * count
            positions = {p: i for i, p in enumerate(self.placeholders)}
            used: dict[int, int] = {}
            for i in order:
                if i in fed:
                    states[i] = NodeState.FED
                    continue
                node = self.nodes[i]
                states[i] = NodeState.WAITING
                producers[i] = tuple(d.index for d in node.deps)
                waiting[i] = sum(d not in fed for d in producers[i])
                for d in producers[i]:
                    consumers[d].append(i)
                for _, placeholder in node.from_placeholders:
                    used.setdefault(positions[placeholder], i)
            wanted = frozenset(outputs)
            plan = self._plans[key] = _shared_plan(
                RunPlan(
                    order=tuple(order),
                    producers=tuple(producers),
                    consumers=tuple(map(tuple, consumers)),
                    states=tuple(states),
                    waiting=tuple(waiting),
                    consumer_counts=tuple(map(len, consumers)),
                    wanted=wanted,
                    tuples=frozenset(i for i in wanted if len(self.nodes[i].op.outputs) > 1),
                    placeholders=tuple(used.items()),
                    fed=fed,
                    ready=tuple(
                        i for i in order if states[i] is NodeState.WAITING and not waiting[i]
                    ),
                    computed=sum(i not in fed for i in order),
                )
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
