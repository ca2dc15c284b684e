"""The per-request cost of every way in, against torch's CPU operator called once per request.

Each path runs the same tiny requests (GluBackward 8x64, GroupNormBackward N=4, C=8,
HxW=64, 4 groups, FLOAT) and is timed right after torch's operator on as many requests, in
the same round; a row is the median over rounds of torch's time / the path's time (above
1.0x the scheduler is cheaper than no scheduler at all) with the microseconds per request:

- ``coroutines``: 256 coroutines each awaiting its share through ``Scheduler``.
- ``submit``: one thread queuing every request with ``submit_*`` on the sync facade, then
  waiting on each future.
- ``sync``: one thread calling the blocking facade one request at a time.
- ``two-phase``: ``opsched.aclnn`` per request (workspace size, workspace, launch).

For GLU one more row, a reference without a target: ``bare batcher``, the floor under the
coroutine row. It is the issue's 40-line asyncio batcher: a list, one flush per loop turn,
one stacked numpy GLU backward, ``set_result`` per future. It has no checks, priorities,
cancellation, bookkeeping or results of their own. On this machine the loop's own wake-up
of each waiter is most of it.

Every timed window (torch's and each path's) starts right after a full garbage collection:
a window pays for the collections its own allocations set off, never for a full pass (50-60
ms with numba's objects alive) that another window's leftovers made due.
"""

from __future__ import annotations

import asyncio
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

__all__ = [
    "PATHS",
    "PATH_TARGETS",
    "bench_memory",
    "bench_paths",
    "glu_inputs",
    "gnb_inputs",
    "print_paths",
    "torch_per_request",
]

F32 = np.float32

#: The paths, in the order each round runs them.
PATHS = ("coroutines", "submit", "sync", "two-phase")
#: The reference row measured for GLU after its paths (no target: see the module docstring).
FLOOR = "bare batcher"
#: The speed each path should reach against torch's operator per request.
PATH_TARGETS = {"coroutines": 1.5, "submit": 1.0, "sync": 0.5, "two-phase": 0.5}
_CLIENTS = 256


def glu_inputs(rng: np.random.Generator, n: int) -> list[tuple[np.ndarray, ...]]:
    """``n`` tiny GluBackward requests: ``(grad_out 8x32, self 8x64)``, FLOAT."""
    return [
        (rng.standard_normal((8, 32)).astype(F32), rng.standard_normal((8, 64)).astype(F32))
        for _ in range(n)
    ]


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
    call = sched.glu_backward if op == "glu" else sched.group_norm_backward
    share = n // _CLIENTS

    async def client(i: int) -> None:
        for j in range(share):
            await call(*inputs[(i * share + j) % len(inputs)])

    await asyncio.gather(*(client(i) for i in range(_CLIENTS)))


class _BareBatcher:
    """The floor of the coroutine path (see the module docstring): what batching tiny
    GluBackward requests costs with nothing but asyncio and numpy."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queued: list[tuple[np.ndarray, np.ndarray, asyncio.Future[np.ndarray]]] = []

    def glu_backward(self, grad_out: np.ndarray, x: np.ndarray) -> asyncio.Future[np.ndarray]:
        future = self._loop.create_future()
        if not self._queued:
            self._loop.call_soon(self._flush)
        self._queued.append((grad_out, x, future))
        return future

    def _flush(self) -> None:
        queued, self._queued = self._queued, []
        g = np.stack([q[0] for q in queued])
        x = np.stack([q[1] for q in queued])
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        s = 1 / (1 + np.exp(-b))
        grad_a = g * s
        out = np.concatenate([grad_a, grad_a * (a - a * s)], axis=-1)
        for (_, _, future), result in zip(queued, out, strict=True):
            future.set_result(result)


def _bare_batcher(inputs: list[tuple[Any, ...]], n: int) -> float:
    async def main() -> float:
        batcher = _BareBatcher()
        await _clients(batcher, "glu", inputs, n)  # warm-up, as for the coroutine path
        gc.collect()
        start = time.perf_counter()
        await _clients(batcher, "glu", inputs, n)
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
        call: Callable[..., Any] = sched.glu_backward
        queue: Callable[..., Any] = sched.submit_glu_backward
        if op == "gnb":
            call, queue = sched.group_norm_backward, sched.submit_group_norm_backward
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


def _two_phase(op: str, inputs: list[tuple[Any, ...]], n: int) -> float:
    """What a caller of ``opsched.aclnn`` writes: outputs, workspace size, launch."""
    gc.collect()
    start = time.perf_counter()
    if op == "glu":
        for k in range(n):
            g, x = inputs[k % len(inputs)]
            out = np.empty_like(x)
            size, ex = aclnn.glu_backward_get_workspace_size(g, x, -1, out)
            aclnn.glu_backward(np.empty(size, np.uint8) if size else None, size, ex)
    else:
        mask = (True, True, True)
        for k in range(n):
            args = inputs[k % len(inputs)]
            c = args[6]
            outs = np.empty_like(args[1]), np.empty(c, F32), np.empty(c, F32)
            size, ex = aclnn.group_norm_backward_get_workspace_size(*args, mask, *outs)
            aclnn.group_norm_backward(np.empty(size, np.uint8) if size else None, size, ex)
    return time.perf_counter() - start


def _run_path(
    path: str, target: BenchTarget, op: str, inputs: list[tuple[Any, ...]], n: int
) -> float:
    if path == "coroutines":
        return _coroutines(target, op, inputs, n)
    if path in ("submit", "sync"):
        return _facade(target, op, inputs, n, submit=path == "submit")
    if path == FLOOR:
        return _bare_batcher(inputs, n)
    return _two_phase(op, inputs, n)


def bench_paths(
    target: BenchTarget | None = None,
    repeats: int = 3,
    requests: int = 25_600,
    ops: Sequence[str] = ("glu", "gnb"),
) -> dict[str, Any]:
    """Every path for each operator: seconds per request, and the ratio to torch's call."""
    target = target or BenchTarget()
    requests = max(requests, _CLIENTS)  # every coroutine awaits at least one
    torch = torch_peer()
    rows = []
    for op in ops:
        inputs = (glu_inputs if op == "glu" else gnb_inputs)(np.random.default_rng(0), 4096)
        peer = torch_per_request(op, inputs) if torch is not None else None
        for path in (*PATHS, FLOOR) if op == "glu" else PATHS:
            many = path in ("coroutines", "submit", FLOOR)
            n = requests if many else max(_CLIENTS, requests // 10)
            ours, peers, ratios = [], [], []
            for _ in range(repeats):  # torch right before the path, in every round
                t_peer = None
                if peer is not None:
                    gc.collect()
                    start = time.perf_counter()
                    for k in range(n):
                        peer(k)
                    t_peer = time.perf_counter() - start
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
            }
            if ratios:
                row["torch_us"] = statistics.median(peers) * 1e6
                row["speedup_vs_torch"] = statistics.median(ratios)
            rows.append(row)
    return {"repeats": repeats, "device": target.device, "rows": rows}


def print_paths(result: dict[str, Any], out: TextIO) -> None:
    """Print one row per operator and path, with its target and whether it was reached."""
    names = {"glu": "GLU 8x64", "gnb": "GroupNormBackward 4x8x64"}
    print(
        f"{'path (tiny FLOAT requests)':<40}{'us/request':>11}{'torch us':>10}"
        f"{'vs torch':>10}{'target':>9}",
        file=out,
    )
    for row in result["rows"]:
        label = f"{names[row['op']]}, {row['path']}"
        target = PATH_TARGETS.get(row["path"])
        if target is None and "speedup_vs_torch" in row:  # the reference row
            print(
                f"{label:<40}{row['us']:>11.1f}{row['torch_us']:>10.1f}"
                f"{row['speedup_vs_torch']:>9.2f}x{'':>9}  (reference: the floor)",
                file=out,
            )
        elif "speedup_vs_torch" in row:
            speed = row["speedup_vs_torch"]
            verdict = "reached" if speed >= target else "NOT reached"
            print(
                f"{label:<40}{row['us']:>11.1f}{row['torch_us']:>10.1f}{speed:>9.2f}x"
                f"{'>= ' + str(target) + 'x':>9}  {verdict}",
                file=out,
            )
        else:
            print(f"{label:<40}{row['us']:>11.1f}{'(no torch)':>10}", file=out)
