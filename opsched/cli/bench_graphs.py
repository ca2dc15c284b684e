"""The graph benchmark: an 8-node backward chain, as a graph, as awaited calls, direct.

The chain alternates group-norm grad and GLU backward, each consuming the previous output:
GN on x (2, 4, 8) -> GLU whose grad_out is that result and whose input is (2, 4, 16) -> GN
on (2, 4, 16) -> ... up to (2, 4, 128): small FLOAT tensors. 64 clients run their own chain
(own arrays) ``repeats`` times concurrently, (a) as ``sched.run`` of a graph, (b) as the same
chain of ``await sched...`` calls, (c) one call at a time through the two-phase API. Then a
single chain at idle, graph against awaited calls. Medians over rounds; ratios in the same run.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

import opsched
from opsched.cli.bench_kernels import BenchTarget
from opsched.cli.bench_paths import two_phase_call

__all__ = ["bench_graphs", "print_graph_report"]

F32 = np.float32
#: One call through the two-phase API, as its caller writes it (the direct way).
_GN, _GLU = two_phase_call("gn"), two_phase_call("glu")


class _Chain:
    """One client's chain: its arrays, its graph, and the three ways to run it."""

    def __init__(self, rng: np.random.Generator, length: int = 8) -> None:
        self.steps: list[tuple[str, tuple[np.ndarray, ...]]] = []
        self.graph = opsched.Graph()
        prev: Any = None
        shape = (2, 4, 8)
        for i in range(length):
            if i % 2 == 0:
                x, dy, gamma = (rng.standard_normal(shape).astype(F32) for _ in range(3))
                mean = rng.standard_normal(shape[:2]).astype(F32)
                rstd = (rng.random(shape[:2]) + 0.5).astype(F32)
                self.steps.append(("gn", (x, dy, gamma, mean, rstd)))
                prev = self.graph.group_norm_grad(
                    x, dy if prev is None else prev, gamma, mean, rstd
                )
            else:
                shape = (*shape[:-1], 2 * shape[-1])
                gate = rng.standard_normal(shape).astype(F32)
                self.steps.append(("glu", (gate,)))
                prev = self.graph.glu_backward(prev, gate, dim=-1)
        self.last = prev

    async def as_graph(self, sched: opsched.Scheduler) -> np.ndarray:
        (out,) = await sched.run(self.graph, outputs=[self.last])
        return out

    async def as_awaits(self, sched: opsched.Scheduler) -> np.ndarray:
        value: Any = None
        for i, (kind, args) in enumerate(self.steps):
            if kind == "gn":
                x, dy, gamma, mean, rstd = args
                value = await sched.group_norm_grad(x, dy if i == 0 else value, gamma, mean, rstd)
            else:
                value = await sched.glu_backward(value, args[0], -1)
        return value

    def direct(self) -> np.ndarray:
        value: Any = None
        for i, (kind, args) in enumerate(self.steps):
            if kind == "gn":
                x, dy, gamma, mean, rstd = args
                value = _GN(x, dy if i == 0 else value, gamma, mean, rstd)
            else:
                value = _GLU(value, args[0], -1)
        return value


async def _concurrent(
    target: BenchTarget,
    chains: list[_Chain],
    repeats: int,
    way: Callable[..., Any],
    trace: str | None = None,
) -> tuple[float, np.ndarray]:
    async with target.open(trace) as sched:

        async def client(c: _Chain) -> np.ndarray:
            out: np.ndarray | None = None
            for _ in range(repeats):
                out = await way(c, sched)
            assert out is not None
            return out

        await asyncio.gather(*(client(c) for c in chains))  # warm-up
        start = time.perf_counter()
        outs = await asyncio.gather(*(client(c) for c in chains))
        elapsed = time.perf_counter() - start
    return elapsed, outs[0]


async def _idle(target: BenchTarget, chain: _Chain, n: int) -> tuple[list[float], list[float]]:
    graph_s, await_s = [], []
    async with target.open() as sched:
        for _ in range(20):
            await chain.as_graph(sched)
            await chain.as_awaits(sched)
        for _ in range(n):  # alternate, so drift hits both alike
            t0 = time.perf_counter()
            await chain.as_graph(sched)
            t1 = time.perf_counter()
            await chain.as_awaits(sched)
            t2 = time.perf_counter()
            graph_s.append(t1 - t0)
            await_s.append(t2 - t1)
    return graph_s, await_s


def bench_graphs(
    rounds: int = 3,
    clients: int = 64,
    repeats: int = 20,
    target: BenchTarget | None = None,
    trace: str | None = None,
) -> dict[str, Any]:
    """Run the benchmark; return its figures (``trace``: the first graph round's timeline)."""
    target = target or BenchTarget()
    rng = np.random.default_rng(0)
    chains = [_Chain(rng) for _ in range(clients)]
    runs = clients * repeats
    graph_t, await_t, direct_t, ratios = [], [], [], []
    for i in range(rounds):
        t_graph, out_graph = asyncio.run(
            _concurrent(target, chains, repeats, _Chain.as_graph, trace if i == 0 else None)
        )
        t_await, out_await = asyncio.run(_concurrent(target, chains, repeats, _Chain.as_awaits))
        start = time.perf_counter()
        for _ in range(repeats):
            for c in chains:
                c.direct()
        t_direct = time.perf_counter() - start
        # client 0's result, three ways: bit-identical
        assert np.array_equal(out_graph, out_await)
        assert np.array_equal(out_graph, chains[0].direct())
        graph_t.append(t_graph)
        await_t.append(t_await)
        direct_t.append(t_direct)
        ratios.append(t_await / t_graph)
    idle = [asyncio.run(_idle(target, chains[0], 300)) for _ in range(rounds)]
    return {
        "rounds": rounds,
        "chains": runs,
        "graph_chains_per_s": runs / statistics.median(graph_t),
        "awaited_chains_per_s": runs / statistics.median(await_t),
        "direct_chains_per_s": runs / statistics.median(direct_t),
        "graph_vs_awaited": statistics.median(ratios),
        "idle_graph_us": statistics.median(statistics.median(g) for g, _ in idle) * 1e6,
        "idle_awaited_us": statistics.median(statistics.median(a) for _, a in idle) * 1e6,
    }


def print_graph_report(r: dict[str, Any], out: TextIO) -> None:
    """Print the figures: graphs against the same chains awaited call by call."""
    print(
        f"8-node chain (GN 2x4x8 ... GLU 2x4x128, FLOAT), 64 concurrent clients, "
        f"{r['chains']} chains each way, median of {r['rounds']} rounds",
        file=out,
    )
    print(f"  (a) graphs:           {r['graph_chains_per_s']:10,.0f} chains/s", file=out)
    print(f"  (b) awaited calls:    {r['awaited_chains_per_s']:10,.0f} chains/s", file=out)
    print(f"  (c) two-phase direct: {r['direct_chains_per_s']:10,.0f} chains/s", file=out)
    print(f"  (a) / (b) = {r['graph_vs_awaited']:.2f}x", file=out)
    print(
        f"  one chain at idle: graph {r['idle_graph_us']:.0f} us, awaited "
        f"{r['idle_awaited_us']:.0f} us",
        file=out,
    )
