"""The per-request cost of every way in, against the operator called once per request.

Each path runs the same tiny requests (GluBackward 8x64, GroupNormBackward N=4, C=8,
HxW=64, 4 groups, GroupNormalizationGrad 4x8x64, FLOAT) and is timed right after the peer
on as many requests, in the same round; a row is the median over rounds of the peer's time /
the path's time (above 1.0x the scheduler is cheaper than no scheduler at all) with the
microseconds per request. The peer is torch's CPU operator for GluBackward and
GroupNormBackward, and for GroupNormalizationGrad, which has no aten operator, its own
two-phase call (issue 15): its rows need no torch, and it has no two-phase row of its own.

- ``coroutines``: 256 coroutines each awaiting its share through ``Scheduler``.
- ``submit``: one thread queuing every request with ``submit_*`` on the sync facade, then
  waiting on each future.
- ``sync``: one thread calling the blocking facade one request at a time.
- ``two-phase``: ``opsched.aclnn`` per request (workspace size, workspace, launch).

For GLU two more rows, references without a target, the floors under the coroutine row:

- ``bare batcher``: the issue's 40-line asyncio batcher: a list, one flush per loop turn,
  one stacked numpy GLU backward (on a torch device, the framework's call on stacked
  tensors), ``set_result`` per future. It has no checks, priorities, cancellation,
  bookkeeping or results of their own. On this machine the loop's own wake-up of each
  waiter is most of it.
- ``featured batcher``: the issue's second reference, the bare batcher with the least a
  scheduler's request needs (:class:`_FeaturedBatcher`): a signature cache, a record per
  request, priority lanes, cancellable waits, results handed out as the scheduler hands
  them (a copy of its row each on numpy, a view of the stacked output on a torch device),
  and the product's own GLU kernel (the framework's on a torch device). It has none of the
  rest the scheduler must keep: deadlines, backpressure, error isolation, statistics,
  hand-offs from threads, trio. What it costs over the bare batcher is what those few
  features cost: the floor under a scheduler that keeps them.

Every timed window (torch's and each path's) starts right after a full garbage collection:
a window pays for the collections its own allocations set off, never for a full pass (50-60
ms with numba's objects alive) that another window's leftovers made due.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import statistics
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import numpy as np

import opsched
import opsched.sync
from opsched import aclnn
from opsched.cli.bench_kernels import BenchTarget, torch_peer
from opsched.devices import torch_ops as _torch_ops
from opsched.kernels import glu as _glu
from opsched.ops import GLU_BACKWARD

__all__ = [
    "INPUTS",
    "OPS",
    "PATHS",
    "PATH_TARGETS",
    "bench_memory",
    "bench_paths",
    "glu_inputs",
    "gn_inputs",
    "gnb_inputs",
    "print_paths",
    "torch_per_request",
    "two_phase_call",
]

F32 = np.float32

#: The paths, in the order each round runs them.
PATHS = ("coroutines", "submit", "sync", "two-phase")
#: The reference rows measured for GLU after its paths (no target: see the module docstring).
FLOOR = "bare batcher"
FEATURED = "featured batcher"
FLOORS = (FLOOR, FEATURED)
#: The speed each path should reach against the operator called once per request.
PATH_TARGETS = {"coroutines": 1.5, "submit": 1.0, "sync": 0.5, "two-phase": 0.5}
#: The operators measured, with the name a row prints.
OPS = {"glu": "GLU 8x64", "gnb": "GroupNormBackward 4x8x64", "gn": "GroupNormalizationGrad 4x8x64"}
#: The operator whose peer is its own two-phase call (no aten operator to compare with).
_OWN_PEER = "gn"
#: Each operator's scheduler method (with ``submit_`` before it: its queuing twin).
_METHODS = {"glu": "glu_backward", "gn": "group_norm_grad", "gnb": "group_norm_backward"}
_CLIENTS = 256


def glu_inputs(rng: np.random.Generator, n: int) -> list[tuple[np.ndarray, ...]]:
    """``n`` tiny GluBackward requests: ``(grad_out 8x32, self 8x64)``, FLOAT."""
    return [
        (rng.standard_normal((8, 32)).astype(F32), rng.standard_normal((8, 64)).astype(F32))
        for _ in range(n)
    ]


def gn_inputs(rng: np.random.Generator, n: int) -> list[tuple[np.ndarray, ...]]:
    """``n`` tiny GroupNormalizationGrad requests: ``(x, dy, gamma, mean, rstd)``, x of
    4 samples x 8 groups x 64, FLOAT."""
    out: list[tuple[np.ndarray, ...]] = []
    for _ in range(n):
        x, dy, gamma = (rng.standard_normal((4, 8, 64)).astype(F32) for _ in range(3))
        mean = rng.standard_normal((4, 8)).astype(F32)
        rstd = (rng.random((4, 8)) + 0.5).astype(F32)
        out.append((x, dy, gamma, mean, rstd))
    return out


def gnb_inputs(rng: np.random.Generator, n: int) -> list[tuple[Any, ...]]:
    """``n`` tiny GroupNormBackward requests: N=4, C=8, HxW=64, group=4, FLOAT."""
    out: list[tuple[Any, ...]] = []
    for _ in range(n):
        x, dy = (rng.standard_normal((4, 8, 64)).astype(F32) for _ in range(2))
        mean = rng.standard_normal((4, 4)).astype(F32)
        rstd = (rng.random((4, 4)) + 0.5).astype(F32)
        gamma = rng.standard_normal(8).astype(F32)
        out.append((dy, x, mean, rstd, gamma, 4, 8, 64, 4))
    return out


#: Each operator's tiny requests (``n`` of them from a generator).
INPUTS: dict[str, Callable[[np.random.Generator, int], list[tuple[Any, ...]]]] = {
    "glu": glu_inputs, "gn": gn_inputs, "gnb": gnb_inputs,
}  # fmt: skip


def torch_per_request(op: str, inputs: list[tuple[Any, ...]]) -> Callable[[int], object]:
    """Torch's operator on request ``k`` (``glu``, ``gn`` or ``gnb`` inputs), on tensors
    converted beforehand: the peer of the scheduler benchmarks."""
    tensors = [[_torch_ops.to_torch(a) for a in args[:5]] for args in inputs]
    count = len(tensors)
    if op == "glu":

        def glu(k: int) -> object:
            g, x = tensors[k % count]
            return _torch_ops.glu_backward(g, x, -1)

        return glu
    if op == "gn":

        def gn(k: int) -> object:
            x, dy, gamma, mean, rstd = tensors[k % count]
            return _torch_ops.group_norm_grad(x, dy, gamma, mean, rstd)

        return gn
    n, c, hxw, group = inputs[0][5:9]
    mask = [True] * 3

    def gnb(k: int) -> object:
        dy, x, mean, rstd, gamma = tensors[k % count]
        return _torch_ops.group_norm_backward(dy, x, mean, rstd, gamma, n, c, hxw, group, mask)

    return gnb


async def _clients(sched: Any, op: str, inputs: list[tuple[Any, ...]], n: int) -> None:
    """``_CLIENTS`` coroutines awaiting ``n`` requests in all (results dropped)."""
    call = getattr(sched, _METHODS[op])
    share = n // _CLIENTS

    async def client(i: int) -> None:
        for j in range(share):
            await call(*inputs[(i * share + j) % len(inputs)])

    await asyncio.gather(*(client(i) for i in range(_CLIENTS)))


class _BareBatcher:
    """The floor of the coroutine path (see the module docstring): what batching tiny
    GluBackward requests costs with nothing but asyncio and one stacked launch
    (``launch``: :func:`_numpy_formula`, or :func:`_torch_aten` on a torch device)."""

    def __init__(self, launch: Callable[[list[Any], list[Any]], Any]) -> None:
        self._loop = asyncio.get_running_loop()
        self._launch = launch
        self._queued: list[tuple[Any, Any, asyncio.Future[Any]]] = []

    def glu_backward(self, grad_out: Any, x: Any) -> asyncio.Future[Any]:
        future = self._loop.create_future()
        if not self._queued:
            self._loop.call_soon(self._flush)
        self._queued.append((grad_out, x, future))
        return future

    def _flush(self) -> None:
        queued, self._queued = self._queued, []
        out = self._launch([q[0] for q in queued], [q[1] for q in queued])
        for (_, _, future), result in zip(queued, out, strict=True):
            future.set_result(result)


def _numpy_formula(grads: list[np.ndarray], selves: list[np.ndarray]) -> np.ndarray:
    """The bare batcher's launch on numpy arrays: the issue's formula, numpy calls on the
    stacked operands; a row each."""
    g, x = np.stack(grads), np.stack(selves)
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    s = 1 / (1 + np.exp(-b))
    grad_a = g * s
    return np.concatenate([grad_a, grad_a * (a - a * s)], axis=-1)


def _numpy_kernel(grads: list[np.ndarray], selves: list[np.ndarray]) -> np.ndarray:
    """The product's own GLU kernel on the stacked operands; a row each."""
    g, x = np.stack(grads), np.stack(selves)
    out = np.empty_like(x)
    _glu.glu_backward_fast(_glu.plan_glu_backward(g, x, -1, out), g, x, out, None)
    return out


def _torch_aten(grads: list[Any], selves: list[Any]) -> Any:
    """The framework's GLU backward on the stacked tensors (a torch device's floors); a
    view each."""
    import torch

    out = _torch_ops.glu_backward(torch.stack(grads), torch.stack(selves), -1)
    return out.unbind(0)


class _Record:
    """A request of the featured batcher: its operands, its waiter, its result."""

    __slots__ = ("future", "grad_out", "result", "self")

    def __init__(self, grad_out: Any, x: Any, future: Any) -> None:
        self.grad_out = grad_out
        self.self = x
        self.future = future
        self.result: Any = None


class _FeaturedBatcher:
    """The bare batcher with the least a scheduler's request needs (the module docstring):
    the checks once per signature, a record per request, lanes by signature and priority
    (higher first, FIFO within), a cancelled waiter's request withdrawn, a stacked
    ``launch`` (the product's kernel, :func:`_numpy_kernel`, or the framework's on a torch
    device), and each result handed out by ``own`` (a copy of its row on numpy, its view
    on a torch device: as the scheduler's launches hand them out)."""

    def __init__(
        self,
        launch: Callable[[list[Any], list[Any]], Any],
        own: Callable[[Any], Any],
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._launch, self._own = launch, own
        self._checked: set[tuple[Any, ...]] = set()  # the signatures that passed the checks
        self._lanes: dict[tuple[Any, ...], dict[int, list[_Record]]] = {}
        self._pending = False
        self.completed = self.launches = 0

    async def glu_backward(self, grad_out: Any, x: Any, dim: int = -1, *, priority: int = 0) -> Any:
        signature = (grad_out.shape, grad_out.dtype, x.shape, x.dtype, dim)
        if signature not in self._checked:  # the checks, once per signature
            half = GLU_BACKWARD.grad_shape(x.shape, dim % x.ndim)
            if x.shape[dim] % 2 or grad_out.shape != half:
                msg = f"glu_backward: shapes {grad_out.shape} and {x.shape} do not match"
                raise ValueError(msg)
            self._checked.add(signature)
        record = _Record(grad_out, x, self._loop.create_future())
        lanes = self._lanes.get(signature)
        if lanes is None:
            lanes = self._lanes[signature] = {}
        lane = lanes.get(priority)
        if lane is None:
            lane = lanes[priority] = []
        lane.append(record)
        if not self._pending:
            self._pending = True
            self._loop.call_soon(self._flush)
        await record.future  # cancelled with its task: then never launched
        assert record.result is not None
        return record.result

    def _flush(self) -> None:
        self._pending = False
        for lanes in self._lanes.values():
            for priority in sorted(lanes, reverse=True):
                taken = [r for r in lanes.pop(priority) if not r.future.done()]
                if taken:
                    self._run(taken)

    def _run(self, taken: list[_Record]) -> None:
        out = self._launch([r.grad_out for r in taken], [r.self for r in taken])
        self.launches += 1
        own = self._own
        for record, result in zip(taken, out, strict=True):
            record.result = own(result)
            self.completed += 1
            record.future.set_result(None)


def _as_it_is(result: Any) -> Any:
    return result


def _floor(path: str, target: BenchTarget, inputs: list[tuple[Any, ...]], n: int) -> float:
    """Seconds for ``n`` requests through the floor ``path``: numpy arrays and numpy or
    the product's kernel, or on a torch device the framework's tensors and call."""
    batcher: Callable[[], Any]
    if target.device.startswith("torch"):
        where = target.device.removeprefix("torch:")
        inputs = [tuple(_torch_ops.to_torch(a, where) for a in args) for args in inputs]
        if path == FLOOR:
            batcher = functools.partial(_BareBatcher, _torch_aten)
        else:
            batcher = functools.partial(_FeaturedBatcher, _torch_aten, _as_it_is)
    elif path == FLOOR:
        batcher = functools.partial(_BareBatcher, _numpy_formula)
    else:
        batcher = functools.partial(_FeaturedBatcher, _numpy_kernel, np.copy)

    async def main() -> float:
        floor = batcher()
        await _clients(floor, "glu", inputs, n)  # warm-up, as for the coroutine path
        gc.collect()
        start = time.perf_counter()
        await _clients(floor, "glu", inputs, n)
        return time.perf_counter() - start

    return asyncio.run(main())


def _coroutines(target: BenchTarget, op: str, inputs: list[tuple[Any, ...]], n: int) -> float:
    async def main() -> float:
        async with target.open() as sched:
            await _clients(sched, op, inputs, n)  # warm-up
            gc.collect()
            start = time.perf_counter()
            await _clients(sched, op, inputs, n)
            return time.perf_counter() - start

    return asyncio.run(main())


def bench_memory(target: BenchTarget | None = None, requests: int = 25_600) -> dict[str, Any]:
    """Memory in the steady state, traced (``tracemalloc``): ``_CLIENTS`` coroutines await
    tiny GluBackward requests after a warm-up round. ``held_bytes``: what the round left
    allocated once its results were dropped (anything kept per request shows here);
    ``peak_per_request``: the round's peak per in-flight request, its own output included."""
    target = target or BenchTarget()
    inputs = glu_inputs(np.random.default_rng(0), 64)

    async def main() -> tuple[int, int]:
        async with target.open() as sched:
            await _clients(sched, "glu", inputs, requests)  # warm-up: caches, pools
            gc.collect()
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                await _clients(sched, "glu", inputs, requests)
                await asyncio.sleep(0)  # the loop lets go of the clients' finished tasks
                gc.collect()  # and of anything else only the collector frees
                current, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            return current - base, peak - base

    held, peak = asyncio.run(main())
    return {
        "requests": requests,
        "held_bytes": held,
        "peak_per_request": peak / _CLIENTS,
        "output_bytes": inputs[0][1].nbytes,
    }


def _facade(
    target: BenchTarget, op: str, inputs: list[tuple[Any, ...]], n: int, submit: bool
) -> float:
    with opsched.sync.open_scheduler(target.config, device=target.device) as sched:
        call: Callable[..., Any] = getattr(sched, _METHODS[op])
        queue: Callable[..., Any] = getattr(sched, f"submit_{_METHODS[op]}")
        for args in inputs[: min(n, 256)]:  # warm-up: the signatures, the executors
            call(*args)
        gc.collect()
        start = time.perf_counter()
        if submit:
            futures = [queue(*inputs[k % len(inputs)]) for k in range(n)]
            for future in futures:
                future.result()
        else:
            for k in range(n):
                call(*inputs[k % len(inputs)])
        return time.perf_counter() - start


def two_phase_call(op: str) -> Callable[..., Any]:
    """One request of ``op`` (``glu``, ``gn`` or ``gnb``; its arguments as :data:`INPUTS`
    holds them, GLU's ``dim`` -1 unless given) through ``opsched.aclnn``, as its caller
    writes it: fresh outputs, the workspace size (checked and planned, by one cache lookup
    for a geometry seen before), a workspace, the launch. Returns the result. The baseline
    every scheduler figure calls direct."""
    if op == "glu":

        def glu(grad_out: np.ndarray, x: np.ndarray, dim: int = -1) -> np.ndarray:
            out = np.empty_like(x)
            size, ex = aclnn.glu_backward_get_workspace_size(grad_out, x, dim, out)
            aclnn.glu_backward(np.empty(size, np.uint8) if size else None, size, ex)
            return out

        return glu
    if op == "gn":

        def gn(*args: np.ndarray) -> np.ndarray:
            dx = np.empty_like(args[0])
            size, ex = aclnn.group_norm_grad_get_workspace_size(*args, dx)
            aclnn.group_norm_grad(np.empty(size, np.uint8) if size else None, size, ex)
            return dx

        return gn
    mask = (True, True, True)

    def gnb(*args: Any) -> tuple[np.ndarray, ...]:
        x, c = args[1], args[6]
        outs = np.empty_like(x), np.empty(c, x.dtype), np.empty(c, x.dtype)
        size, ex = aclnn.group_norm_backward_get_workspace_size(*args, mask, *outs)
        aclnn.group_norm_backward(np.empty(size, np.uint8) if size else None, size, ex)
        return outs

    return gnb


def _two_phase(op: str, inputs: list[tuple[Any, ...]], n: int) -> float:
    """``n`` requests through :func:`two_phase_call`, one after another."""
    call = two_phase_call(op)
    count = len(inputs)
    gc.collect()
    start = time.perf_counter()
    for k in range(n):
        call(*inputs[k % count])
    return time.perf_counter() - start


def _calls(call: Callable[[int], object], n: int) -> float:
    """Seconds for ``call(0)`` ... ``call(n - 1)``."""
    start = time.perf_counter()
    for k in range(n):
        call(k)
    return time.perf_counter() - start


def _run_path(
    path: str, target: BenchTarget, op: str, inputs: list[tuple[Any, ...]], n: int
) -> float:
    if path == "coroutines":
        return _coroutines(target, op, inputs, n)
    if path in ("submit", "sync"):
        return _facade(target, op, inputs, n, submit=path == "submit")
    if path in FLOORS:
        return _floor(path, target, inputs, n)
    return _two_phase(op, inputs, n)


def bench_paths(
    target: BenchTarget | None = None,
    repeats: int = 3,
    requests: int = 25_600,
    ops: Sequence[str] = tuple(OPS),
) -> dict[str, Any]:
    """Every path for each operator: seconds per request, and the ratio to its peer (see
    the module docstring; rows of the torch peer have no ratio without torch)."""
    target = target or BenchTarget()
    requests = max(requests, _CLIENTS)  # every coroutine awaits at least one
    torch = torch_peer()
    rows = []
    for op in ops:
        inputs = INPUTS[op](np.random.default_rng(0), 4096)
        own = op == _OWN_PEER
        peer: Callable[[int], float] | None = None  # seconds for the first n requests
        if own:
            peer = functools.partial(_two_phase, op, inputs)
        elif torch is not None:
            peer = functools.partial(_calls, torch_per_request(op, inputs))
        paths = PATHS[:-1] if own else (*PATHS, *FLOORS) if op == "glu" else PATHS
        for path in paths:
            many = path in ("coroutines", "submit", *FLOORS)
            n = requests if many else max(_CLIENTS, requests // 10)
            ours, peers, ratios = [], [], []
            for _ in range(repeats):  # the peer right before the path, in every round
                t_peer = None
                if peer is not None:
                    gc.collect()
                    t_peer = peer(n)
                t_ours = _run_path(path, target, op, inputs, n)
                ours.append(t_ours / n)
                if t_peer is not None:
                    peers.append(t_peer / n)
                    ratios.append(t_peer / t_ours)
            row: dict[str, Any] = {
                "op": op,
                "path": path,
                "requests": n,
                "us": statistics.median(ours) * 1e6,
                "peer": "two-phase" if own else "torch",
            }
            if ratios:
                row["peer_us"] = statistics.median(peers) * 1e6
                row["speedup_vs_peer"] = statistics.median(ratios)
                row["speedup_rounds"] = ratios  # the spread a noisy machine puts on it
            rows.append(row)
    return {"repeats": repeats, "device": target.device, "rows": rows}


def print_paths(result: dict[str, Any], out: TextIO) -> None:
    """Print one row per operator and path, with its target and whether it was reached."""
    print(
        f"{'path (tiny FLOAT requests)':<46}{'us/request':>11}{'peer us':>9}"
        f"{'vs peer':>9}{'target':>9}",
        file=out,
    )
    for row in result["rows"]:
        label = f"{OPS[row['op']]}, {row['path']}"
        target = PATH_TARGETS.get(row["path"])
        if "speedup_vs_peer" not in row:
            print(f"{label:<46}{row['us']:>11.1f}  (no torch: no peer)", file=out)
            continue
        figures = f"{label:<46}{row['us']:>11.1f}{row['peer_us']:>9.1f}"
        speed, rounds = row["speedup_vs_peer"], row.get("speedup_rounds", ())
        spread = f"  (rounds {min(rounds):.2f}-{max(rounds):.2f}x)" if len(rounds) > 1 else ""
        if target is None:  # a reference row
            print(f"{figures}{speed:>8.2f}x{'':>9}  (reference: a floor){spread}", file=out)
        else:
            verdict = "reached" if speed >= target else "NOT reached"
            print(
                f"{figures}{speed:>8.2f}x{'>= ' + str(target) + 'x':>9}  {verdict}{spread}",
                file=out,
            )
