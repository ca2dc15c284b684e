"""Solo or fused: figure 13 of ``opsched bench scheduler``.

On the cpu device, the scheduler runs a coroutine's request at submit, alone, once it is
at least its operator's :attr:`~opsched.devices.host.launcher.HostLauncher.alone_from`
bytes, however many other coroutines are about to submit (while no launch is in flight);
smaller requests queue for a fused launch. This figure measures both routes on the same
requests: 256 coroutines awaiting tiny requests of one geometry, once with every request
run at submit (the device says company gains none: ``Device.runs_alone_from`` of 0) and
once with every one queued for fusion (it says company gains all), in interleaved rounds.
Per operator and size, the solo route's time over the fused one's: each launcher's
constant sits where the two cross.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from opsched.cli.bench_floors import clients
from opsched.cli.bench_kernels import BenchTarget
from opsched.devices.host.launchers import LAUNCHERS
from opsched.ops import GLU_BACKWARD, GROUP_NORM_BACKWARD, GROUP_NORM_GRAD, Operator

__all__ = ["COROUTINES", "bench_alone", "print_alone"]

F32 = np.float32
#: The awaiting coroutines: many, so the fused route gets batches of this size.
COROUTINES = 256
#: Distinct argument sets the clients cycle through, per size.
_ARGUMENTS = 16
#: GroupNormalizationGrad's and GroupNormBackward's ``(N, C, HxW)`` at each size.
_GEOMETRIES = ((2, 4, 8), (4, 8, 16), (4, 8, 32), (4, 8, 64), (4, 8, 256))

#: A request: its arguments, and its bytes with its outputs.
Request = tuple[tuple[Any, ...], int]


def _glu(rng: np.random.Generator, rows: int) -> Request:
    g, x = (rng.standard_normal((rows, cols)).astype(F32) for cols in (32, 64))
    return (g, x), g.nbytes + 2 * x.nbytes


def _gn(rng: np.random.Generator, shape: tuple[int, int, int]) -> Request:
    n, c, hxw = shape
    x, dy, gamma = (rng.standard_normal((n, c, hxw)).astype(F32) for _ in range(3))
    mean = rng.standard_normal((n, c)).astype(F32)
    rstd = (rng.random((n, c)) + 0.5).astype(F32)
    return (x, dy, gamma, mean, rstd), 4 * x.nbytes + 2 * mean.nbytes


def _gnb(rng: np.random.Generator, shape: tuple[int, int, int]) -> Request:
    n, c, hxw = shape
    dy, x = (rng.standard_normal((n, c, hxw)).astype(F32) for _ in range(2))
    group = c // 2
    mean = rng.standard_normal((n, group)).astype(F32)
    rstd = (rng.random((n, group)) + 0.5).astype(F32)
    gamma = rng.standard_normal(c).astype(F32)
    nbytes = 3 * x.nbytes + 2 * mean.nbytes + 3 * gamma.nbytes  # with dx, dgamma, dbeta
    return (dy, x, mean, rstd, gamma, n, c, hxw, group), nbytes


#: Per operator: its benchmark name, its description, and its request at each size.
_CASES: list[tuple[str, Operator, list[Callable[[np.random.Generator], Request]]]] = [
    ("glu", GLU_BACKWARD, [functools.partial(_glu, rows=k) for k in (1, 4, 8, 32)]),
    ("gn", GROUP_NORM_GRAD, [functools.partial(_gn, shape=s) for s in _GEOMETRIES]),
    ("gnb", GROUP_NORM_BACKWARD, [functools.partial(_gnb, shape=s) for s in _GEOMETRIES]),
]


def _route(
    target: BenchTarget, op: str, name: str, work: list[tuple[Any, ...]], n: int, solo: bool
) -> float:
    """Seconds for ``n`` requests of ``work`` from :data:`COROUTINES` coroutines, every
    one run at submit (``solo``) or queued for fusion, after a warm-up round."""

    async def main() -> float:
        async with target.open() as sched:
            sched.device.runs_alone_from = {name: 0} if solo else {}
            await clients(sched, op, work, n, COROUTINES)
            gc.collect()
            start = time.perf_counter()
            await clients(sched, op, work, n, COROUTINES)
            return time.perf_counter() - start

    return asyncio.run(main())


def bench_alone(repeats: int, requests: int = 7_680) -> dict[str, Any]:
    """Figure 13: per operator and size, the solo route's and the fused route's
    microseconds a request (medians of ``repeats`` interleaved rounds of ``requests``),
    and each operator's ``alone_from`` on the cpu device."""
    target = BenchTarget("cpu")
    rng = np.random.default_rng(0)
    rows = []
    for op, desc, sizes in _CASES:
        for make in sizes:
            made = [make(rng) for _ in range(_ARGUMENTS)]
            work, nbytes = [args for args, _ in made], made[0][1]
            solo, fused = [], []
            for _ in range(repeats):
                fused.append(_route(target, op, desc.name, work, requests, False))
                solo.append(_route(target, op, desc.name, work, requests, True))
            rows.append(
                {
                    "op": desc.name,
                    "bytes": nbytes,
                    "solo_us": statistics.median(solo) / requests * 1e6,
                    "fused_us": statistics.median(fused) / requests * 1e6,
                    "ratio": statistics.median(s / f for s, f in zip(solo, fused, strict=True)),
                }
            )
    alone_from = {desc.name: LAUNCHERS[desc.name].alone_from for _, desc, _ in _CASES}
    return {"coroutines": COROUTINES, "rows": rows, "alone_from": alone_from}


def print_alone(r: dict[str, Any], line: Callable[[str, str], None]) -> None:
    """Print figure 13's rows (``line`` prints one figure)."""
    for row in r["rows"]:
        alone = r["alone_from"][row["op"]]
        route = "at submit" if row["bytes"] >= alone else "fused"
        line(
            f"13. solo or fused, {row['op']} {row['bytes']:,} B",
            f"solo {row['solo_us']:.2f} us, fused {row['fused_us']:.2f} us: "
            f"{row['ratio']:.2f}x ({route}: alone_from {alone >> 10} KiB)",
        )
