"""The floors under the scheduler: what batching requests costs with the least code,
measured beside the scheduler in every ``--parts paths`` and ``--parts targets`` run
(reference rows, no target), for GluBackward and GroupNormBackward on every device: tiny
requests from 256 coroutines, medium ones from 32, and on ``torch:cpu`` requests of many
shapes; and the graph row's chains, as graphs.

- ``bare batcher``: the least asyncio batcher, in 40 lines: a list, one flush per loop
  turn, one stacked launch (the operator's formula in numpy calls on the stacked
  operands; on a torch device the framework's call on stacked tensors), ``set_result``
  per future. It has no checks, priorities,
  cancellation, bookkeeping or results of their own. On this machine the loop's own
  wake-up of each waiter is most of it. It needs requests of one shape.
- ``featured batcher``: the bare batcher with the least a
  scheduler's request needs (:class:`_FeaturedBatcher`): a signature cache, a record per
  request, priority lanes, cancellable waits, results handed out as the scheduler hands
  them (each its own array on numpy, a view of the stacked output on a torch device),
  and the product's own kernel (GluBackward's on the stacked operands, GroupNormBackward's
  table loop on the requests' own arrays; the framework's calls on a torch device). A
  lone request, and requests of at least :data:`OWN_ELEMENTS` elements, run on their own
  arrays instead of a stack (GluBackward's table loop; the framework's own call), as the
  scheduler runs them, except a small lone GroupNormBackward on a torch device: a stack
  of one, so that, like the scheduler's, a request's bits never depend on its batch. It
  has none
  of the rest the scheduler must keep: deadlines, backpressure, error isolation,
  statistics, hand-offs from threads, trio. What it costs over the bare batcher is what
  those few features cost: the floor under a scheduler that keeps them.

The graph row's floor (:func:`run_graph_floor`) is the featured batcher running the
benchmark's chains as graphs: a run's node enters its signature's lane when the node before
it has launched, shared with every other run's nodes of that signature (so a step of 64
runs is one launch, as the scheduler fuses it), and its launch moves the run on without
waking a coroutine; the run's caller awaits one future, and a cancelled run's queued node is
never launched. Its launches are the product's kernels on the stacked operands
(GroupNormalizationGrad's: :func:`_numpy_gn_kernel`), each node's output an array of its
own. The checks run once per signature, as a graph's nodes are checked when added. It has
none of the rest of a scheduler's graph runs: failures passed downstream, deadlines,
intermediates from a pool, waits on stream events.

On a torch device GroupNormBackward's launch (:func:`_torch_gnb`) is the least one aten
call needs: the requests' operands stacked (a copy each: aten reads one contiguous
tensor), gamma repeated per sample, one call, the per-sample dgamma / dbeta summed by one
more, and three views back to each request.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from opsched.cli.bench_kernels import BenchTarget
from opsched.cli.bench_medium import on_device
from opsched.devices.torch import aten as _aten
from opsched.kernels import glu as _glu
from opsched.kernels.group_norm import group_norm_grad_fast, plan_group_norm_grad
from opsched.kernels.group_norm_backward import gnb_table_row, group_norm_backward_table
from opsched.ops import GLU_BACKWARD

__all__ = [
    "CLIENTS",
    "FEATURED",
    "FLOOR",
    "FLOORS",
    "METHODS",
    "clients",
    "floors_of",
    "run_floor",
    "run_graph_floor",
]

#: The reference rows, in the order a round runs them.
FLOOR = "bare batcher"
FEATURED = "featured batcher"
FLOORS = (FLOOR, FEATURED)
#: Each operator's scheduler method (with ``submit_`` before it: its queuing twin).
METHODS = {"glu": "glu_backward", "gn": "group_norm_grad", "gnb": "group_norm_backward"}
#: The coroutines of the coroutine path and of the floors.
CLIENTS = 256


async def clients(
    sched: Any, op: str, inputs: list[tuple[Any, ...]], n: int, coroutines: int = CLIENTS
) -> None:
    """``coroutines`` coroutines awaiting ``n`` requests in all, each its share of
    ``inputs`` in turn (results dropped)."""
    call = getattr(sched, METHODS[op])
    share = n // coroutines

    async def client(i: int) -> None:
        for j in range(share):
            await call(*inputs[(i * share + j) % len(inputs)])

    await asyncio.gather(*(client(i) for i in range(coroutines)))


class _BareBatcher:
    """The floor of the coroutine path (see the module docstring): what batching tiny
    requests costs with nothing but asyncio and one stacked launch (``launch``, on the
    queued requests' arguments: :func:`_numpy_formula`, or on a torch device
    :func:`_torch_aten` / :func:`_torch_gnb`)."""

    def __init__(self, launch: Callable[[list[tuple[Any, ...]]], Any]) -> None:
        self._loop = asyncio.get_running_loop()
        self._launch = launch
        self._queued: list[tuple[tuple[Any, ...], asyncio.Future[Any]]] = []

    def _submit(self, args: tuple[Any, ...]) -> asyncio.Future[Any]:
        future = self._loop.create_future()
        if not self._queued:
            self._loop.call_soon(self._flush)
        self._queued.append((args, future))
        return future

    def glu_backward(self, grad_out: Any, x: Any) -> asyncio.Future[Any]:
        return self._submit((grad_out, x))

    def group_norm_backward(self, *args: Any) -> asyncio.Future[Any]:
        return self._submit(args)

    def _flush(self) -> None:
        queued, self._queued = self._queued, []
        out = self._launch([q[0] for q in queued])
        for (_, future), result in zip(queued, out, strict=True):
            future.set_result(result)


def _numpy_formula(requests: list[tuple[np.ndarray, ...]]) -> np.ndarray:
    """The bare batcher's GLU launch on numpy arrays: the operator's formula, numpy calls on
    the stacked operands; a row each."""
    g, x = np.stack([r[0] for r in requests]), np.stack([r[1] for r in requests])
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    s = 1 / (1 + np.exp(-b))
    grad_a = g * s
    return np.concatenate([grad_a, grad_a * (a - a * s)], axis=-1)


#: Requests of at least this many elements (``self`` / ``x``) run on their own arrays in
#: the featured batcher's launches: stacking them would copy more than it saves.
OWN_ELEMENTS = 4096


def _numpy_kernel(requests: list[tuple[np.ndarray, ...]]) -> list[np.ndarray]:
    """The product's own GLU kernel, each result a new array of its own: on the stacked
    operands (a copy of its row each), or for requests of :data:`OWN_ELEMENTS` its table
    loop on their own arrays (one compiled call, no copies)."""
    if requests[0][1].size >= OWN_ELEMENTS:
        outs, rows = [], []
        for g, x in requests:
            out = np.empty_like(x)
            row = _glu.glu_table_row(g, x, out, -1)
            assert row is not None, "the floors' requests are C-contiguous FLOAT"
            outs.append(out)
            rows.append(row)
        _glu.glu_backward_table(requests[0][1].dtype, rows)()
        return outs
    g, x = np.stack([r[0] for r in requests]), np.stack([r[1] for r in requests])
    out = np.empty_like(x)
    _glu.glu_backward_fast(_glu.plan_glu_backward(g, x, -1, out), g, x, out, None)
    return [row.copy() for row in out]


def _numpy_gn_kernel(requests: list[tuple[np.ndarray, ...]]) -> list[np.ndarray]:
    """The product's GroupNormalizationGrad kernel on the stacked operands (one shape: the
    requests' samples one after another, each ``(sample, group)`` row computed alike
    wherever it sits), each dx a new array of its own."""
    first, stats = requests[0][0], requests[0][3]
    k = len(requests)
    rows, stat_rows = (k * first.shape[0], *first.shape[1:]), (k * stats.shape[0], *stats.shape[1:])
    x, dy, gamma = (np.stack([r[i] for r in requests]).reshape(rows) for i in range(3))
    mean, rstd = (np.stack([r[i] for r in requests]).reshape(stat_rows) for i in (3, 4))
    dx = np.empty_like(x)
    plan = plan_group_norm_grad(x, dy, gamma, dx)
    workspace = np.empty(plan.workspace_bytes, np.uint8) if plan.workspace_bytes else None
    group_norm_grad_fast(plan, x, dy, gamma, mean, rstd, dx, workspace)
    return [sample.copy() for sample in dx.reshape(k, *first.shape)]


def _numpy_gnb_formula(requests: list[tuple[Any, ...]]) -> list[tuple[Any, Any, Any]]:
    """The bare batcher's GroupNormBackward launch on numpy arrays (one shape): the
    operator's formula in float32, numpy calls on the stacked operands; views of the
    results ``(dx, dgamma, dbeta)`` each."""
    dy, x, mean, rstd, gamma = (np.stack([r[i] for r in requests]) for i in range(5))
    k, n, c, hxw = dy.shape
    group = requests[0][8]
    cpg = c // group
    ds = dy.sum(-1)  # (k, n, c)
    stat_mean, stat_rstd = mean.repeat(cpg, -1), rstd.repeat(cpg, -1)
    db = ((dy * x).sum(-1) - stat_mean * ds) * stat_rstd
    g = gamma[:, None, :]
    c1 = (g * ds).reshape(k, n, group, cpg).sum(-1) / (cpg * hxw)
    c2 = (g * db).reshape(k, n, group, cpg).sum(-1) / (cpg * hxw)
    coef_b = (-(c2 * rstd * rstd)).repeat(cpg, -1)[..., None]
    coef_c = ((c2 * rstd * mean - c1) * rstd).repeat(cpg, -1)[..., None]
    dx = dy * (stat_rstd * g)[..., None] + x * coef_b + coef_c
    return list(zip(dx, db.sum(1), ds.sum(1), strict=True))


def _numpy_gnb_kernel(requests: list[tuple[Any, ...]]) -> list[tuple[Any, Any, Any]]:
    """The product's own GroupNormBackward kernel on the requests' own arrays: one call of
    its table loop, the three outputs of each new arrays of its own."""
    rows, outs = [], []
    for dy, x, mean, rstd, gamma, n, c, hxw, group in requests:
        out = np.empty_like(x), np.empty(c, mean.dtype), np.empty(c, mean.dtype)
        row = gnb_table_row(dy, x, mean, rstd, gamma, *out, n, c, hxw, group, True)
        assert row is not None, "the floors' requests are the usual FLOAT layout"
        rows.append(row)
        outs.append(out)
    group_norm_backward_table(requests[0][1].dtype, rows)()
    return outs


def _torch_aten(requests: list[tuple[Any, ...]]) -> Any:
    """The framework's GLU backward on the stacked tensors (a torch device's floors); a
    view each. A lone request, or requests of :data:`OWN_ELEMENTS`, are each the
    framework's own call."""
    import torch

    if len(requests) == 1 or requests[0][1].numel() >= OWN_ELEMENTS:
        return [_aten.glu_backward(g, x, -1) for g, x in requests]
    g, x = torch.stack([r[0] for r in requests]), torch.stack([r[1] for r in requests])
    return _aten.glu_backward(g, x, -1).unbind(0)


def _torch_gnb(requests: list[tuple[Any, ...]]) -> list[tuple[Any, Any, Any]]:
    """The framework's GroupNormBackward on stacked tensors (a torch device's floors):
    the least a launch of one aten call does. The requests (one shape) are stacked as the
    channels of one sample, each gamma repeated per sample by one batched copy, and the
    per-sample dgamma / dbeta summed over each request's samples by one call; each request
    gets views ``(dx, dgamma, dbeta)``. Requests of :data:`OWN_ELEMENTS` are each the
    framework's own call. A smaller lone request is stacked too (a stack of one): those
    sums are not the bits of the framework's own call, so a request's bits would
    otherwise depend on its batch, which the scheduler's never do."""
    import torch

    if requests[0][1].numel() >= OWN_ELEMENTS:
        mask = (True, True, True)
        return [
            _aten.group_norm_backward(dy, x, mean, rstd, gamma, n, c, hxw, group, mask)
            for dy, x, mean, rstd, gamma, n, c, hxw, group in requests
        ]
    k = len(requests)
    n, c, hxw, group = requests[0][5:9]
    channels, groups = k * n * c, k * n * group

    def stacked(i: int, shape: tuple[int, ...]) -> Any:
        return torch.stack([r[i] for r in requests]).view(shape)

    gamma = torch.stack([r[4] for r in requests]).unsqueeze(1).expand(k, n, c).reshape(-1)
    dx, dgamma, dbeta = _aten.group_norm_backward(
        stacked(0, (1, channels, hxw)),
        stacked(1, (1, channels, hxw)),
        stacked(2, (1, groups)),
        stacked(3, (1, groups)),
        gamma,
        1,
        channels,
        hxw,
        groups,
        (True, True, True),
    )
    sums = torch.stack([dgamma, dbeta]).view(2, k, n, c).sum(2)
    dxs, dgammas, dbetas = dx.view(k, n, c, hxw).unbind(0), sums[0].unbind(0), sums[1].unbind(0)
    return list(zip(dxs, dgammas, dbetas, strict=True))


class _Record:
    """A request of the featured batcher: its operands, its waiter, its result."""

    __slots__ = ("args", "future", "result")

    def __init__(self, args: tuple[Any, ...], future: Any) -> None:
        self.args = args
        self.future = future
        self.result: Any = None


class _FeaturedBatcher:
    """The bare batcher with the least a scheduler's request needs (the module docstring):
    the checks once per signature, a record per request, lanes by signature and priority
    (higher first, FIFO within), a cancelled waiter's request withdrawn, and a ``launch``
    of each signature's lane that hands every request its result as the scheduler's
    launches do (the product's kernel, :func:`_numpy_kernel`: each its own array; the
    framework's on a torch device: its view of the stacked output, or its own call's).
    One operator a batcher: the one ``launch`` computes."""

    def __init__(self, launch: Callable[[list[tuple[Any, ...]]], Any]) -> None:
        self._loop = asyncio.get_running_loop()
        self._launch = launch
        #: Each signature that passed the checks, with its lanes by priority (one lookup a
        #: request: a signature is hashed afresh each time, its shapes and dtypes too)
        self._lanes: dict[tuple[Any, ...], dict[int, list[_Record]]] = {}
        #: The signatures' lanes with requests queued since the last flush (a flush looks
        #: at these, not at every signature seen)
        self._queued: list[dict[int, list[_Record]]] = []
        self.completed = self.launches = 0

    async def glu_backward(self, grad_out: Any, x: Any, dim: int = -1, *, priority: int = 0) -> Any:
        signature = (grad_out.shape, grad_out.dtype, x.shape, x.dtype, dim)
        lanes = self._lanes.get(signature)
        if lanes is None:  # the checks, once per signature
            half = GLU_BACKWARD.grad_shape(x.shape, dim % x.ndim)
            if x.shape[dim] % 2 or grad_out.shape != half:
                msg = f"glu_backward: shapes {grad_out.shape} and {x.shape} do not match"
                raise ValueError(msg)
            lanes = self._lanes[signature] = {}
        record = self._queue(lanes, (grad_out, x), priority)
        await record.future  # cancelled with its task: then never launched
        return record.result

    async def group_norm_backward(
        self,
        dy: Any,
        x: Any,
        mean: Any,
        rstd: Any,
        gamma: Any,
        n: int,
        c: int,
        hxw: int,
        group: int,
        *,
        priority: int = 0,
    ) -> Any:
        signature = (
            dy.shape,
            dy.dtype,
            x.shape,
            x.dtype,
            mean.shape,
            mean.dtype,
            rstd.shape,
            rstd.dtype,
            gamma.shape,
            gamma.dtype,
            n,
            c,
            hxw,
            group,
        )
        lanes = self._lanes.get(signature)
        if lanes is None:  # the checks, once per signature
            stats = (n, group)
            if (
                x.shape != (n, c, hxw)
                or dy.shape != x.shape
                or gamma.shape != (c,)
                or mean.shape != stats
                or rstd.shape != stats
                or group <= 0
                or c % group
            ):
                msg = (
                    f"group_norm_backward: shapes {dy.shape}, {x.shape}, {mean.shape}, "
                    f"{rstd.shape}, {gamma.shape} do not match N={n} C={c} HxW={hxw} "
                    f"group={group}"
                )
                raise ValueError(msg)
            lanes = self._lanes[signature] = {}
        record = self._queue(lanes, (dy, x, mean, rstd, gamma, n, c, hxw, group), priority)
        await record.future  # cancelled with its task: then never launched
        return record.result

    def _queue(
        self,
        lanes: dict[int, list[_Record]],
        args: tuple[Any, ...],
        priority: int,
        waiter: Any = None,
    ) -> _Record:
        """A checked request's record, in its signature's lane of ``priority``; the flush
        scheduled. ``waiter``: what its launch sets (default: a new future to await)."""
        record = _Record(args, self._loop.create_future() if waiter is None else waiter)
        if not lanes:
            if not self._queued:
                self._loop.call_soon(self._flush)
            self._queued.append(lanes)
        lane = lanes.get(priority)
        if lane is None:
            lane = lanes[priority] = []
        lane.append(record)
        return record

    def _flush(self) -> None:
        queued, self._queued = self._queued, []
        for lanes in queued:
            for priority in sorted(lanes, reverse=True):
                taken = [r for r in lanes.pop(priority) if not r.future.done()]
                if taken:
                    self._run(taken)

    def _run(self, taken: list[_Record]) -> None:
        out = self._launch([r.args for r in taken])
        self.launches += 1
        for record, result in zip(taken, out, strict=True):
            record.result = result
            self.completed += 1
            record.future.set_result(None)


#: A chain's node on the graph floor: its batcher, its signature's lanes, its kind and the
#: arrays it was built with.
_Node = tuple["_FeaturedBatcher", dict[int, list[_Record]], str, tuple[Any, ...]]


class _FloorRun:
    """One run of a chain on the graph floor: its nodes (each with its batcher and its
    signature's lanes), the node in flight, the caller's future. It is its node's waiter
    in the featured batcher: the launch moves the run on (no coroutine woken per node),
    and a node of a run whose future is cancelled is never launched."""

    __slots__ = ("future", "index", "nodes", "priority", "record")

    def __init__(self, nodes: list[_Node], future: asyncio.Future[Any], priority: int) -> None:
        self.nodes, self.future, self.priority = nodes, future, priority
        self.index = 0
        self.record: _Record | None = None

    def submit(self, value: Any) -> None:
        """Queue the next node, its input ``value`` (the previous node's output)."""
        batcher, lanes, kind, args = self.nodes[self.index]
        if kind == "gn":  # (x, dy, gamma, mean, rstd): the first node's dy is its own
            x, dy, gamma, mean, rstd = args
            args = (x, dy if value is None else value, gamma, mean, rstd)
        else:  # GLU's grad_out is the previous output, its input the node's own
            args = (value, args[0])
        self.record = batcher._queue(lanes, args, self.priority, self)

    def done(self) -> bool:
        """Whether the caller no longer waits (its queued node is then skipped)."""
        return self.future.done()

    def set_result(self, _: object) -> None:
        """The node in flight has launched: its consumer is queued, or the run is done."""
        assert self.record is not None
        value = self.record.result
        self.index += 1
        if self.index == len(self.nodes):
            self.future.set_result(value)
        else:
            self.submit(value)


class _GraphFloor:
    """The featured batcher's graph runs (the module docstring): one batcher an operator,
    shared by every run."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._batchers = {
            "gn": _FeaturedBatcher(_numpy_gn_kernel),
            "glu": _FeaturedBatcher(_numpy_kernel),
        }

    def nodes_of(self, steps: list[tuple[str, tuple[Any, ...]]]) -> list[_Node]:
        """A chain's steps as nodes, each checked once per signature (as a graph's nodes
        are checked when added; the nodes of every chain of the same shapes share their
        signature's lanes)."""
        nodes: list[_Node] = []
        for kind, args in steps:
            batcher = self._batchers[kind]
            signature = (kind, *[(a.shape, a.dtype) for a in args])
            lanes = batcher._lanes.get(signature)
            if lanes is None:
                _check_node(kind, args)
                lanes = batcher._lanes[signature] = {}
            nodes.append((batcher, lanes, kind, args))
        return nodes

    async def run(self, nodes: list[_Node], priority: int = 0) -> Any:
        """Run a chain's ``nodes``; return its last node's output."""
        future = self._loop.create_future()
        _FloorRun(nodes, future, priority).submit(None)
        return await future  # cancelled with its caller: its queued node never launches


def _check_node(kind: str, args: tuple[Any, ...]) -> None:
    """The checks of a graph floor's node: GroupNormalizationGrad's operands of one shape
    and dtype (its kernel stacks them alike), mean and rstd one per ``(sample, group)``;
    GLU's input halved along its last axis."""
    first = args[0]
    if kind == "gn":
        x, dy, gamma, mean, rstd = args
        ok = dy.shape == gamma.shape == x.shape and mean.shape == rstd.shape == x.shape[:2]
    else:
        ok = first.ndim > 0 and first.shape[-1] % 2 == 0
    if not ok or any(a.dtype != first.dtype for a in args):
        shapes = ", ".join(f"{a.shape} {a.dtype}" for a in args)
        msg = f"graph floor: a {kind} node's arrays do not fit its operator: {shapes}"
        raise ValueError(msg)


def run_graph_floor(chains: list[Any], repeats: int) -> tuple[float, Any]:
    """Seconds for one client a chain (:class:`~opsched.cli.bench_graphs._Chain`: its
    ``steps``) running it ``repeats`` times as graphs on the featured batcher, after a
    warm-up round as :func:`~opsched.cli.bench_graphs._concurrent` times the scheduler's;
    and the first client's last output."""

    async def main() -> tuple[float, Any]:
        floor = _GraphFloor()
        nodes = [floor.nodes_of(chain.steps) for chain in chains]

        async def client(chain_nodes: list[_Node]) -> Any:
            out = None
            for _ in range(repeats):
                out = await floor.run(chain_nodes)
            return out

        await asyncio.gather(*(client(n) for n in nodes))  # warm-up
        start = time.perf_counter()
        outs = await asyncio.gather(*(client(n) for n in nodes))
        return time.perf_counter() - start, outs[0]

    return asyncio.run(main())


#: The operators with floors, and their launch on a torch device.
_TORCH_FLOOR_LAUNCH = {"glu": _torch_aten, "gnb": _torch_gnb}
#: The operators with floors, and their launches on numpy arrays: the bare batcher's and
#: the featured batcher's.
_NUMPY_FLOOR_LAUNCH: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "glu": (_numpy_formula, _numpy_kernel),
    "gnb": (_numpy_gnb_formula, _numpy_gnb_kernel),
}


def floors_of(op: str, target: BenchTarget, one_shape: bool = True) -> tuple[str, ...]:
    """The floor rows of ``op`` on ``target``: GluBackward's and GroupNormBackward's on
    every device (see the module docstring); of requests of many shapes
    (``one_shape=False``) the featured batcher's only (the bare one stacks one shape)."""
    if op not in _TORCH_FLOOR_LAUNCH:
        return ()
    return FLOORS if one_shape else (FEATURED,)


def run_floor(
    path: str,
    target: BenchTarget,
    op: str,
    inputs: list[tuple[Any, ...]],
    n: int,
    coroutines: int = CLIENTS,
) -> float:
    """Seconds for ``n`` requests of ``op`` from ``coroutines`` coroutines through the
    floor ``path``: numpy arrays and numpy or the product's kernel, or on a torch device
    the framework's tensors and call."""
    batcher: Callable[[], Any]
    if target.device.startswith("torch"):
        inputs = on_device(target, inputs)
        bare = featured = _TORCH_FLOOR_LAUNCH[op]
    else:
        bare, featured = _NUMPY_FLOOR_LAUNCH[op]
    if path == FLOOR:
        batcher = functools.partial(_BareBatcher, bare)
    else:
        batcher = functools.partial(_FeaturedBatcher, featured)

    async def main() -> float:
        floor = batcher()
        await clients(floor, op, inputs, n, coroutines)  # warm-up, as for the scheduler
        gc.collect()
        start = time.perf_counter()
        await clients(floor, op, inputs, n, coroutines)
        return time.perf_counter() - start

    return asyncio.run(main())
