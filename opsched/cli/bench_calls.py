"""Python calls and bytecodes per request: how much Python one request runs, path by path.

Each path serves tiny GluBackward requests (``self`` 8x64, FLOAT) in steady state (after a
warm-up round of the same requests) while a profiler counts the Python function calls
(``sys.setprofile`` 'call' events) of every thread the scheduler runs (the caller's, the
event loop's and the streams'), and of the caller's thread alone. A row is those calls
divided by the requests served. The profiler is installed before the scheduler is opened,
so the threads it starts count too. The path then runs again, on a scheduler of its own,
under a tracer that counts the bytecodes every thread runs (``sys.settrace`` 'opcode'
events): what a request costs in the interpreter, whose time follows it more closely
than the calls' (a call may run three bytecodes or three hundred).

- ``1 coroutine``: one coroutine awaiting ``sched.glu_backward`` request after request.
- ``module-level``: the same through ``opsched.glu_backward`` (the default scheduler).
- ``256 coroutines``: 256 coroutines each awaiting its share.
- ``blocking sync``: one thread calling ``sched.glu_backward`` on the sync facade.
- ``sync futures``: one thread queuing a burst with ``submit_glu_backward``, then waiting.

Under the 256-coroutine row, the same count for the floors of ``--parts paths``
(:mod:`opsched.cli.bench_floors`: the bare batcher, and the featured one that keeps the
least a scheduler's request needs): how many calls a request costs with nothing but
asyncio's own wake-up of its waiter around a stacked launch.

Counting is deterministic up to the scheduler's own choices (how many requests a launch
fuses), so the figures hardly move between runs; they are not times.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any, NamedTuple, TextIO

import numpy as np

import opsched
import opsched.sync
from opsched import kernels
from opsched.cli import bench_floors
from opsched.cli.bench_paths import glu_inputs

__all__ = ["CALL_PATHS", "FLOOR_ROWS", "Calls", "bench_calls", "print_calls"]

#: The paths, in the order they run.
CALL_PATHS = ("1 coroutine", "module-level", "256 coroutines", "blocking sync", "sync futures")
#: The floors' rows (reference rows, under "256 coroutines").
FLOOR_ROWS = tuple(f"256 coroutines, {floor}" for floor in bench_floors.FLOORS)


#: Reads a count so far: every thread's, and the counting thread's.
Reader = Callable[[], tuple[int, int]]


@contextmanager
def _events(
    event: str, hook: Callable[[Any], None], thread_hook: Callable[[Any], None]
) -> Iterator[Reader]:
    """Count ``event`` ('call' with the profile hooks, 'opcode' with the trace hooks) in
    this thread and every thread started inside the block; yields a function returning
    the counts so far: every thread's, and this one's (a read's own events included)."""
    counter, mine = itertools.count(), itertools.count()
    tick, tick_mine = counter.__next__, mine.__next__  # atomic in CPython

    def ticking(*ticks: Callable[[], int]) -> Callable[[Any, str, Any], Any]:
        def count(frame: Any, what: str, arg: Any) -> Any:
            if what == event:
                for advance in ticks:
                    advance()
            elif what == "call":  # (tracing) a new frame: its bytecodes reported, not lines
                frame.f_trace_lines, frame.f_trace_opcodes = False, True
            return count

        return count

    def read() -> tuple[int, int]:
        return next(counter), next(mine)

    thread_hook(ticking(tick))
    hook(ticking(tick, tick_mine))
    try:
        yield read
    finally:
        hook(None)
        thread_hook(None)


@contextmanager
def _counting() -> Iterator[Reader]:
    """Count Python calls in this thread and every thread started inside the block;
    yields a function returning the counts so far: every thread's, and this one's."""
    with _events("call", sys.setprofile, threading.setprofile) as counts:
        reads = itertools.count(1)

        def read() -> tuple[int, int]:
            # each read adds three to each count itself: its own call, the raw read's
            # call, and the raw read's ``next``, which advances the count it reads
            thrice = 3 * next(reads)
            every, mine = counts()
            return every - thrice, mine - thrice

        yield read


def _tracing() -> AbstractContextManager[Reader]:
    """Count the bytecodes run in this thread and every thread started inside the block
    (as :func:`_counting`; a read's own few bytecodes are counted: nothing beside a
    path's thousands)."""
    return _events("opcode", sys.settrace, threading.settrace)


#: What a path's runner counts with: :func:`_counting` (calls) or :func:`_tracing`
#: (bytecodes).
Counter = Callable[[], AbstractContextManager[Reader]]


def _per_request(
    before: tuple[int, int], after: tuple[int, int], requests: int
) -> tuple[float, float]:
    return (after[0] - before[0]) / requests, (after[1] - before[1]) / requests


class Calls(NamedTuple):
    """Python calls per request, in every thread and in the caller's alone, and the
    bytecodes every thread runs per request."""

    all_threads: float
    caller: float
    bytecodes: float


async def _one_coroutine(call: Callable[..., Any], inputs: list[Any]) -> None:
    for g, x in inputs:
        await call(g, x)


async def _many(call: Callable[..., Any], inputs: list[Any], clients: int) -> None:
    async def client(k: int) -> None:
        for g, x in inputs[k::clients]:
            await call(g, x)

    await asyncio.gather(*(client(k) for k in range(clients)))


def _async_path(path: str, inputs: list[Any], counting: Counter) -> tuple[float, float]:
    """Per request of an async path (its own ``asyncio.run``), what ``counting`` counts:
    in every thread, and in the caller's."""
    result: list[tuple[float, float]] = []

    async def main() -> None:
        if path == "module-level":
            call = opsched.glu_backward
            await _one_coroutine(call, inputs)  # warm-up (and the default scheduler made)
            with counting() as read:
                before = read()
                await _one_coroutine(call, inputs)
                result.append(_per_request(before, read(), len(inputs)))
            return
        with counting() as read:
            async with opsched.open_scheduler() as sched:
                call = sched.glu_backward
                run: Callable[[], Any]
                if path == "1 coroutine":
                    run = lambda: _one_coroutine(call, inputs)  # noqa: E731
                else:
                    run = lambda: _many(call, inputs, 256)  # noqa: E731
                await run()  # warm-up
                before = read()
                await run()
                result.append(_per_request(before, read(), len(inputs)))

    asyncio.run(main())
    return result[0]


def _sync_path(path: str, inputs: list[Any], counting: Counter) -> tuple[float, float]:
    """Per request of a path of the sync facade, what ``counting`` counts."""
    with counting() as read, opsched.sync.open_scheduler() as sched:

        def run() -> None:
            if path == "blocking sync":
                for g, x in inputs:
                    sched.glu_backward(g, x)
            else:
                futures = [sched.submit_glu_backward(g, x) for g, x in inputs]
                for f in futures:
                    f.result()

        run()  # warm-up
        before = read()
        run()
        return _per_request(before, read(), len(inputs))


def _floor(floor: str, inputs: list[Any], counting: Counter) -> tuple[float, float]:
    """Per request of a floor of the 256-coroutine path, what ``counting`` counts."""
    make = {
        bench_floors.FLOOR: lambda: bench_floors._BareBatcher(bench_floors._numpy_formula),
        bench_floors.FEATURED: lambda: bench_floors._FeaturedBatcher(bench_floors._numpy_kernel),
    }[floor]
    result: list[tuple[float, float]] = []

    async def main() -> None:
        batcher = make()
        await bench_floors.clients(batcher, "glu", inputs, len(inputs))  # warm-up
        with counting() as read:
            before = read()
            await bench_floors.clients(batcher, "glu", inputs, len(inputs))
            result.append(_per_request(before, read(), len(inputs)))

    asyncio.run(main())
    return result[0]


def _path(path: str, inputs: list[Any], counting: Counter) -> tuple[float, float]:
    """Per request of ``path`` (a path of :data:`CALL_PATHS` or a row of
    :data:`FLOOR_ROWS`), what ``counting`` counts."""
    if path in FLOOR_ROWS:
        return _floor(path.split(", ", 1)[1], inputs, counting)
    if path in ("blocking sync", "sync futures"):
        return _sync_path(path, inputs, counting)
    return _async_path(path, inputs, counting)


def bench_calls(requests: int = 2048) -> dict[str, Calls]:
    """Python calls and bytecodes per request of each path (:data:`CALL_PATHS`) and of the
    floors (:data:`FLOOR_ROWS`, after the 256-coroutine path)."""
    # every kernel compiled (or loaded from numba's cache) first: a path's warm-up round
    # need not launch every kernel its counted round does (which requests fuse depends on
    # timing), and a compile in a counted round would count the compiler's calls
    kernels.warm()
    inputs = glu_inputs(np.random.default_rng(0), requests)
    at = CALL_PATHS.index("256 coroutines") + 1
    figures: dict[str, Calls] = {}
    for path in (*CALL_PATHS[:at], *FLOOR_ROWS, *CALL_PATHS[at:]):
        every, caller = _path(path, inputs, _counting)
        figures[path] = Calls(every, caller, _path(path, inputs, _tracing)[0])
    return figures


def print_calls(figures: dict[str, Any], out: TextIO) -> None:
    """One line per path (the floors indented under theirs): every thread's calls, the
    caller's thread's, and every thread's bytecodes."""
    print("Python calls and bytecodes per request, tiny GLU 8x64 FLOAT, steady state", file=out)
    print(f"   {'path':<28}{'all threads':>12}{'caller':>8}{'bytecodes':>11}", file=out)
    for path, (every, caller, bytecodes) in figures.items():
        name = f"  {path.split(', ')[1]}" if path in FLOOR_ROWS else path
        print(f"   {name:<28}{every:12.1f}{caller:8.1f}{bytecodes:11.0f}", file=out)
