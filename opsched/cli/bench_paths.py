"""The per-request cost of every way in, against the operator called once per request.

Each path runs the same tiny requests (GluBackward 8x64, GroupNormBackward N=4, C=8,
HxW=64, 4 groups, GroupNormalizationGrad 4x8x64, FLOAT) and is timed right after the peer
on as many requests, in the same round; a row is the median over rounds of the peer's time /
the path's time (above 1.0x the scheduler is cheaper than no scheduler at all) with the
microseconds per request. The peer is torch's CPU operator for GluBackward and
GroupNormBackward, and for GroupNormalizationGrad, which has no aten operator, its own
two-phase call: its rows need no torch, and it has no two-phase row of its own.

- ``coroutines``: 256 coroutines each awaiting its share through ``Scheduler``.
- ``submit``: one thread queuing every request with ``submit_*`` on the sync facade, then
  waiting on each future. Every result lives until the last future is read, so its peer
  keeps every result until its last call too: each call's output is fresh memory, as
  each future's is, where a peer that dropped its results would reuse one.
- ``sync``: one thread calling the blocking facade one request at a time.
- ``two-phase``: ``opsched.aclnn`` per request (workspace size, workspace, launch).

Under the coroutine row, reference rows without a target: the floors
(:mod:`opsched.cli.bench_floors`), GLU's and GroupNormBackward's, on every device.

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
from opsched.cli.bench_floors import CLIENTS, FLOORS, METHODS, clients, floors_of, run_floor
from opsched.cli.bench_kernels import BenchTarget, torch_peer
from opsched.devices.torch import aten as _aten
from opsched.ops import GLU_BACKWARD, GROUP_NORM_BACKWARD, GROUP_NORM_GRAD

__all__ = [
    "INPUTS",
    "OPS",
    "PATHS",
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
#: The operators measured, with the name a row prints.
OPS = {"glu": "GLU 8x64", "gnb": "GroupNormBackward 4x8x64", "gn": "GroupNormalizationGrad 4x8x64"}
#: The operator whose peer is its own two-phase call (no aten operator to compare with).
_OWN_PEER = "gn"


def glu_inputs(rng: np.random.Generator, n: int) -> list[tuple[Any, ...]]:
    """``n`` tiny GluBackward requests (the description's example: ``self`` 8x64, FLOAT)."""
    return [GLU_BACKWARD.example(rng) for _ in range(n)]


def gn_inputs(rng: np.random.Generator, n: int) -> list[tuple[Any, ...]]:
    """``n`` tiny GroupNormalizationGrad requests (the description's example: x of 4
    samples x 8 groups x 64, FLOAT)."""
    return [GROUP_NORM_GRAD.example(rng) for _ in range(n)]


def gnb_inputs(rng: np.random.Generator, n: int) -> list[tuple[Any, ...]]:
    """``n`` tiny GroupNormBackward requests (the description's example: N=4, C=8,
    HxW=64, group=4, FLOAT)."""
    return [GROUP_NORM_BACKWARD.example(rng) for _ in range(n)]


#: Each operator's tiny requests (``n`` of them from a generator).
INPUTS: dict[str, Callable[[np.random.Generator, int], list[tuple[Any, ...]]]] = {
    "glu": glu_inputs,
    "gn": gn_inputs,
    "gnb": gnb_inputs,
}


def torch_per_request(op: str, inputs: list[tuple[Any, ...]]) -> Callable[[int], object]:
    """Torch's operator on request ``k`` (``glu``, ``gn`` or ``gnb`` inputs), on tensors
    converted beforehand: the peer of the scheduler benchmarks."""
    tensors = [[_aten.to_torch(a) for a in args[:5]] for args in inputs]
    count = len(tensors)
    if op == "glu":

        def glu(k: int) -> object:
            g, x = tensors[k % count]
            return _aten.glu_backward(g, x, -1)

        return glu
    if op == "gn":

        def gn(k: int) -> object:
            x, dy, gamma, mean, rstd = tensors[k % count]
            return _aten.group_norm_grad(x, dy, gamma, mean, rstd)

        return gn
    n, c, hxw, group = inputs[0][5:9]
    mask = [True] * 3

    def gnb(k: int) -> object:
        dy, x, mean, rstd, gamma = tensors[k % count]
        return _aten.group_norm_backward(dy, x, mean, rstd, gamma, n, c, hxw, group, mask)

    return gnb


def _coroutines(target: BenchTarget, op: str, inputs: list[tuple[Any, ...]], n: int) -> float:
    async def main() -> float:
        async with target.open() as sched:
            await clients(sched, op, inputs, n)  # warm-up
            gc.collect()
            start = time.perf_counter()
            await clients(sched, op, inputs, n)
            return time.perf_counter() - start

    return asyncio.run(main())


def bench_memory(target: BenchTarget | None = None, requests: int = 25_600) -> dict[str, Any]:
    """Memory in the steady state, traced (``tracemalloc``): ``CLIENTS`` coroutines await
    tiny GluBackward requests after a warm-up round. ``held_bytes``: what the round left
    allocated once its results were dropped (anything kept per request shows here);
    ``peak_per_request``: the round's peak per in-flight request, its own output included."""
    target = target or BenchTarget()
    inputs = glu_inputs(np.random.default_rng(0), 64)

    async def main() -> tuple[int, int]:
        async with target.open() as sched:
            await clients(sched, "glu", inputs, requests)  # warm-up: caches, pools
            gc.collect()
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                await clients(sched, "glu", inputs, requests)
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
        "peak_per_request": peak / CLIENTS,
        "output_bytes": inputs[0][1].nbytes,
    }


def _facade(
    target: BenchTarget, op: str, inputs: list[tuple[Any, ...]], n: int, submit: bool
) -> float:
    with opsched.sync.open_scheduler(target.config, device=target.device) as sched:
        call: Callable[..., Any] = getattr(sched, METHODS[op])
        queue: Callable[..., Any] = getattr(sched, f"submit_{METHODS[op]}")
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


def _two_phase(op: str, inputs: list[tuple[Any, ...]], n: int, keep: bool = False) -> float:
    """``n`` requests through :func:`two_phase_call`, one after another (``keep``: as
    :func:`_calls`)."""
    call = two_phase_call(op)
    count = len(inputs)
    if keep:  # as in _calls
        _warm_heap(lambda k: call(*inputs[k % count]), n)
    gc.collect()
    start = time.perf_counter()
    if keep:
        _kept = [call(*inputs[k % count]) for k in range(n)]  # alive until timed
    else:
        for k in range(n):
            call(*inputs[k % count])
    return time.perf_counter() - start


def _warm_heap(call: Callable[[int], object], n: int) -> None:
    """Make and drop the results of ``call(0)`` ... ``call(n - 1)``, all alive at once
    (untimed): the memory a timed pass keeping them needs is then the allocator's already,
    and a burst timed after it reuses it. The first touch of fresh pages (many
    microseconds a page on some machines) would otherwise fall on whichever of the two
    runs first in a round."""
    results = [call(k) for k in range(n)]
    del results


def _calls(call: Callable[[int], object], n: int, keep: bool = False) -> float:
    """Seconds for ``call(0)`` ... ``call(n - 1)``; each result dropped at once, or
    (``keep``) all kept until the last call returned, after an untimed pass that keeps
    them too (:func:`_warm_heap`) and a full collection."""
    if keep:
        _warm_heap(call, n)
        gc.collect()
    start = time.perf_counter()
    if keep:
        _kept = [call(k) for k in range(n)]  # alive until timed
    else:
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
        return run_floor(path, target, op, inputs, n)
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
    requests = max(requests, CLIENTS)  # every coroutine awaits at least one
    torch = torch_peer()
    rows = []
    for op in ops:
        inputs = INPUTS[op](np.random.default_rng(0), 4096)
        own = op == _OWN_PEER
        # seconds for the first n requests (``keep``: every result kept, as for a burst)
        peer: Callable[[int, bool], float] | None = None
        if own:
            peer = functools.partial(_two_phase, op, inputs)
        elif torch is not None:
            peer = functools.partial(_calls, torch_per_request(op, inputs))
        paths = PATHS[:-1] if own else (*PATHS, *floors_of(op, target))
        for path in paths:
            many = path in ("coroutines", "submit", *FLOORS)
            n = requests if many else max(CLIENTS, requests // 10)
            ours, peers, ratios = [], [], []
            for _ in range(repeats):  # the peer right before the path, in every round
                t_peer = None
                if peer is not None:
                    gc.collect()
                    t_peer = peer(n, path == "submit")
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
    """Print one row per operator and path: its cost per request against the peer's (the
    operator called once per request), with the spread of the rounds."""
    print(
        f"{'path (tiny FLOAT requests)':<46}{'us/request':>11}{'peer us':>9}{'vs peer':>9}",
        file=out,
    )
    for row in result["rows"]:
        label = f"{OPS[row['op']]}, {row['path']}"
        if "speedup_vs_peer" not in row:
            print(f"{label:<46}{row['us']:>11.1f}  (no torch: no peer)", file=out)
            continue
        figures = f"{label:<46}{row['us']:>11.1f}{row['peer_us']:>9.1f}"
        speed, rounds = row["speedup_vs_peer"], row.get("speedup_rounds", ())
        spread = f"  (rounds {min(rounds):.2f}-{max(rounds):.2f}x)" if len(rounds) > 1 else ""
        floor = "  (a floor: a batcher without the scheduler's features)"
        kind = floor if row["path"] not in PATHS else ""
        print(f"{figures}{speed:>8.2f}x{spread}{kind}", file=out)
