"""Medium requests (64 KiB to 1 MiB each) through the scheduler, against torch's operator
called once per request on the same tensors: figure 10 of ``opsched bench scheduler``.

Tiny requests win by fusion; a medium request is worth a launch of its own, so what it
measures is what the scheduler's path (checks, the record, its solo launch at submit or a
queued launch on a stream, the result's hand-off) adds to the request's own call. 32
coroutines await the requests; each round moves 64 MiB of ``self`` / ``input``; the ratio
is the median of interleaved rounds.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

from opsched.cli.bench_kernels import BenchTarget, torch_peer
from opsched.devices.torch import aten

__all__ = ["COROUTINES", "SIZES", "as_tensors", "bench_medium", "on_device", "print_medium"]

F32 = np.float32
#: Bytes of one request's ``self`` (GLU) / ``input`` (GroupNormBackward).
SIZES = (64 << 10, 256 << 10, 1 << 20)
_ROUND_BYTES = 64 << 20
#: The coroutines awaiting medium requests, each its share in turn.
COROUTINES = 32


def _glu(rng: np.random.Generator, nbytes: int, n: int) -> list[tuple[Any, ...]]:
    rows = nbytes // (1024 * 4)
    return [
        (
            rng.standard_normal((rows, 512)).astype(F32),
            rng.standard_normal((rows, 1024)).astype(F32),
        )
        for _ in range(n)
    ]


def _gnb(rng: np.random.Generator, nbytes: int, n: int) -> list[tuple[Any, ...]]:
    hxw = nbytes // (4 * 64 * 4)
    out: list[tuple[Any, ...]] = []
    for _ in range(n):
        dy, x = (rng.standard_normal((4, 64, hxw)).astype(F32) for _ in range(2))
        mean = rng.standard_normal((4, 16)).astype(F32)
        rstd = (rng.random((4, 16)) + 0.5).astype(F32)
        out.append((dy, x, mean, rstd, rng.standard_normal(64).astype(F32), 4, 64, hxw, 16))
    return out


def _gnb_peer(args: tuple[Any, ...]) -> object:
    dy, x, mean, rstd, gamma, n, c, hxw, group = args
    return aten.group_norm_backward(dy, x, mean, rstd, gamma, n, c, hxw, group, [True] * 3)


def as_tensors(work: list[tuple[Any, ...]], device: str = "cpu") -> list[tuple[Any, ...]]:
    """Each call of ``work`` with its numpy arrays as torch tensors on ``device`` (a torch
    device string: ``cpu``, ``cuda:0``, ``npu``)."""
    return [
        tuple(aten.to_torch(a, device) if isinstance(a, np.ndarray) else a for a in w) for w in work
    ]


def on_device(target: BenchTarget, work: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``work`` as the scheduler takes it: on a torch device, tensors on that device (a
    torch user's own calls; the scheduler refuses tensors on another); numpy arrays
    elsewhere."""
    if not target.device.startswith("torch"):
        return work
    where = target.device.removeprefix("torch:")
    if where.startswith("npu"):
        import torch_npu  # noqa: F401 - registers the npu device with torch

    return as_tensors(work, where)


async def _scheduled(
    target: BenchTarget, op: str, work: list[tuple[Any, ...]], rounds: int
) -> list[float]:
    async with target.open() as sched:
        call: Callable[..., Any] = getattr(sched, op)
        share = len(work) // COROUTINES

        async def client(i: int) -> None:
            for args in work[i * share : (i + 1) * share]:
                await call(*args)

        times = []
        for _ in range(rounds + 1):  # the first round warms up
            start = time.perf_counter()
            await asyncio.gather(*(client(i) for i in range(COROUTINES)))
            times.append(time.perf_counter() - start)
    return times[1:]


def bench_medium(
    target: BenchTarget, repeats: int, round_bytes: int = _ROUND_BYTES
) -> dict[str, Any]:
    """Figure 10: per size and operator, the scheduler's time against torch's per-request
    calls (median ratio of ``repeats`` interleaved rounds of ``round_bytes`` of input);
    empty without torch."""
    torch = torch_peer()
    if torch is None:
        return {}
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    cases: list[tuple[str, Callable[..., Any], Callable[[Any], object]]] = [
        ("glu_backward", _glu, lambda a: aten.glu_backward(a[0], a[1], -1)),
        ("group_norm_backward", _gnb, _gnb_peer),
    ]
    for op, make, peer in cases:
        for nbytes in SIZES:
            n = max(COROUTINES, round_bytes // nbytes // COROUTINES * COROUTINES)
            work = make(rng, nbytes, n)
            tensors = as_tensors(work)
            mine = on_device(target, work)
            ratios = []
            for _ in range(repeats):
                start = time.perf_counter()
                for args in tensors:
                    peer(args)
                direct = time.perf_counter() - start
                (scheduled,) = asyncio.run(_scheduled(target, op, mine, 1))
                ratios.append(direct / scheduled)
            rows.append(
                {"op": op, "bytes": nbytes, "requests": n, "speedup": statistics.median(ratios)}
            )
    return {"rows": rows}


def print_medium(r: dict[str, Any], line: Callable[[str, str], None], out: TextIO) -> None:
    """Print figure 10's rows (``line`` prints one figure)."""
    if not r:
        print("10. medium requests: needs torch (the peer); not measured", file=out)
        return
    for row in r["rows"]:
        line(
            f"10. medium, {row['op']} {row['bytes'] >> 10} KiB x {row['requests']}",
            f"{row['speedup']:.2f}x torch's operator per request",
        )
