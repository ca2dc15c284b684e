"""The cost targets: every way into the scheduler against the operator called once per
request, each row beside its target (``opsched bench scheduler --parts targets``).

A row is one path, device and workload; its figure is the peer's time over the path's for
the same requests (above 1.0x the scheduler costs less than no scheduler at all), the
median of interleaved rounds (every row runs once per round, its peer right before it),
printed with the spread of the rounds. The peer is torch's CPU operator at one thread
(``torch.ops.aten.glu_backward``, ``native_group_norm_backward``) on the same tensors;
for the graph row it is the same chains awaited call by call.

- Tiny requests (GluBackward 8x64, GroupNormBackward N=4, C=8, HxW=64, 4 groups, FLOAT):
  the module-level function and an explicit scheduler with 256 coroutines, a burst of
  ``submit_*`` futures from one thread, the blocking facade one call at a time, the
  two-phase API per request; on ``torch:cpu`` with 256 coroutines as well. The peer drops
  each result, as those paths' callers do, except beside the burst, whose results all live
  until the last future is read: its peer keeps each result until its last call.
- Mixed shapes on ``torch:cpu``: GluBackward of 1-8 rows and 16-160 columns,
  GroupNormBackward of N 1-4, C 4-16, HxW 16-160 (groups dividing C), every request its
  own draw: what fusion by signature meets in a real training step.
- Medium requests (:mod:`opsched.cli.bench_medium`): 64 KiB to 1 MiB, 32 coroutines, on
  both devices.
- Graphs (:mod:`opsched.cli.bench_graphs`): 64 clients' 8-node chains as graphs against the
  same chains awaited; beside them the featured batcher running the same chains as graphs
  (:func:`~opsched.cli.bench_floors.run_graph_floor`), against the same peer.

Beside the coroutine rows (tiny, mixed-shape and medium) and the graph row, the floors of
:mod:`opsched.cli.bench_floors` on the same requests from as many coroutines (the same
chains from as many clients), in the same rounds, without a target: a row whose target
lies above the floor of a batcher with the same features cannot reach it.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any, TextIO

import attrs
import numpy as np

import opsched
from opsched.cli.bench_floors import (
    CLIENTS,
    FEATURED,
    clients,
    floors_of,
    run_floor,
    run_graph_floor,
)
from opsched.cli.bench_graphs import _Chain, _concurrent
from opsched.cli.bench_kernels import BenchTarget, torch_peer
from opsched.cli.bench_medium import (
    COROUTINES,
    SIZES,
    _glu,
    _gnb,
    _gnb_peer,
    _scheduled,
    as_tensors,
    on_device,
)
from opsched.cli.bench_paths import (
    INPUTS,
    _calls,
    _coroutines,
    _facade,
    _two_phase,
    torch_per_request,
)
from opsched.cli.bench_report import verdict
from opsched.devices.torch import aten

__all__ = ["GROUPS", "TargetRow", "bench_targets", "print_targets"]

F32 = np.float32
#: Seconds for one round of a row: (the peer's, the path's).
Round = Callable[[], tuple[float, float]]


@attrs.frozen
class TargetRow:
    """One row of the table: what it measures, its target (None: a floor, for reference),
    the requests a round runs, and one round. ``family``: the workload it shares with the
    floors measured on the same requests (a row and its floors have one family; a row
    without floors has its own label)."""

    label: str
    target: float | None
    requests: int
    round: Round
    peer: str = "torch"
    family: str = ""


def _timed(run: Callable[[], object]) -> float:
    gc.collect()  # a window never pays for a full collection another one made due
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _peer_round(peer: Callable[[int], object], n: int, keep: bool) -> float:
    """Seconds for the peer's ``n`` calls, timed from a full collection as
    :func:`_timed` times (``keep``: :func:`~opsched.cli.bench_paths._calls`' untimed pass
    first)."""
    gc.collect()
    return _calls(peer, n, keep)


def _module_level(op: str, inputs: list[Any], n: int) -> float:
    """Seconds for ``n`` requests from :data:`CLIENTS` coroutines through ``opsched``'s
    module-level functions (the default scheduler), after a warm-up round."""

    async def main() -> float:
        await clients(opsched, op, inputs, n)
        gc.collect()
        start = time.perf_counter()
        await clients(opsched, op, inputs, n)
        return time.perf_counter() - start

    return asyncio.run(main())


def _tiny_rows(n: int) -> list[TargetRow]:
    cpu, torch_cpu = BenchTarget(), BenchTarget("torch:cpu")
    rng = np.random.default_rng(0)
    inputs = {"glu": INPUTS["glu"](rng, 4096), "gnb": INPUTS["gnb"](rng, 4096)}
    on_torch = {op: on_device(torch_cpu, work) for op, work in inputs.items()}
    few = max(CLIENTS, n // 10)  # the one-at-a-time paths: fewer requests, the same ratio

    def row(
        label: str,
        target: float | None,
        op: str,
        ours: Callable[[int], float],
        count: int = n,
        family: str = "",
        keep: bool = False,
    ) -> TargetRow:
        peer = torch_per_request(op, inputs[op])
        return TargetRow(
            label,
            target,
            count,
            lambda: (_peer_round(peer, count, keep), ours(count)),
            family=family or label,
        )

    glu, gnb = inputs["glu"], inputs["gnb"]
    rows = [
        row(
            "GLU, module-level `await opsched.glu_backward`, 256 coroutines",
            1.0,
            "glu",
            lambda k: _module_level("glu", glu, k),
            family="GLU",
        ),
        row(
            "GLU, `await sched.glu_backward`, 256 coroutines",
            1.0,
            "glu",
            lambda k: _coroutines(cpu, "glu", glu, k),
            family="GLU",
        ),
        row(
            "GLU, a burst of `submit_glu_backward` futures, one thread",
            1.0,
            "glu",
            lambda k: _facade(cpu, "glu", glu, k, submit=True),
            keep=True,  # every future's result lives until the last is read: the peer's too
        ),
        row(
            "GLU, `opsched.sync.glu_backward` one at a time",
            1.0,
            "glu",
            lambda k: _facade(cpu, "glu", glu, k, submit=False),
            few,
        ),
        row(
            "GLU, two-phase `opsched.aclnn` per request",
            1.0,
            "glu",
            lambda k: _two_phase("glu", glu, k),
            few,
        ),
        row(
            "GLU, torch:cpu, 256 coroutines",
            1.0,
            "glu",
            lambda k: _coroutines(torch_cpu, "glu", on_torch["glu"], k),
            family="GLU, torch:cpu",
        ),
        row(
            "GroupNormBackward 4x8x64, 256 coroutines",
            0.8,
            "gnb",
            lambda k: _coroutines(cpu, "gnb", gnb, k),
            family="GroupNormBackward 4x8x64",
        ),
        row(
            "GroupNormBackward 4x8x64, torch:cpu, 256 coroutines",
            0.8,
            "gnb",
            lambda k: _coroutines(torch_cpu, "gnb", on_torch["gnb"], k),
            family="GroupNormBackward 4x8x64, torch:cpu",
        ),
    ]
    for op, where in (("glu", cpu), ("glu", torch_cpu), ("gnb", cpu), ("gnb", torch_cpu)):
        name = "GLU" if op == "glu" else "GroupNormBackward 4x8x64"
        device = "" if where is cpu else f", {where.device}"
        for floor in floors_of(op, where):
            measure = functools.partial(run_floor, floor, where, op, inputs[op])
            label = f"{name}{device}, floor: {floor}"
            rows.append(row(label, None, op, measure, family=f"{name}{device}"))
    return rows


def mixed_glu(rng: np.random.Generator, n: int) -> list[tuple[Any, ...]]:
    """``n`` GluBackward requests of 1-8 rows and 16-160 (even) columns, FLOAT."""
    out = []
    for _ in range(n):
        rows, cols = int(rng.integers(1, 9)), 2 * int(rng.integers(8, 81))
        x = rng.standard_normal((rows, cols)).astype(F32)
        out.append((rng.standard_normal((rows, cols // 2)).astype(F32), x))
    return out


def mixed_gnb(rng: np.random.Generator, n: int) -> list[tuple[Any, ...]]:
    """``n`` GroupNormBackward requests of N 1-4, C 4-16, HxW 16-160 and a group count
    dividing C, FLOAT, all three outputs."""
    out: list[tuple[Any, ...]] = []
    for _ in range(n):
        c = int(rng.choice([4, 8, 16]))
        samples, hxw = int(rng.integers(1, 5)), int(rng.integers(16, 161))
        group = int(rng.choice([g for g in (1, 2, 4) if c % g == 0]))
        dy, x = (rng.standard_normal((samples, c, hxw)).astype(F32) for _ in range(2))
        mean = rng.standard_normal((samples, group)).astype(F32)
        rstd = (rng.random((samples, group)) + 0.5).astype(F32)
        gamma = rng.standard_normal(c).astype(F32)
        out.append((dy, x, mean, rstd, gamma, samples, c, hxw, group))
    return out


def _mixed_rows(n: int) -> list[TargetRow]:
    torch_cpu = BenchTarget("torch:cpu")
    rng = np.random.default_rng(1)
    rows = []
    for op, make, target in (("glu", mixed_glu, 1.0), ("gnb", mixed_gnb, 0.8)):
        work = make(rng, 4096)
        tensors = as_tensors(work)
        if op == "glu":

            def peer(k: int, tensors: list[Any] = tensors) -> object:
                g, x = tensors[k % len(tensors)]
                return aten.glu_backward(g, x, -1)

        else:

            def peer(k: int, tensors: list[Any] = tensors) -> object:
                return _gnb_peer(tensors[k % len(tensors)])

        def ours(k: int, op: str = op, tensors: list[Any] = tensors) -> float:
            return _coroutines(torch_cpu, op, tensors, k)

        name = "GLU" if op == "glu" else "GroupNormBackward"
        label = f"{name}, torch:cpu, mixed shapes"
        paths: list[tuple[str, float | None, Callable[[int], float]]] = [
            (f"{label}, 256 coroutines", target, ours)
        ]
        for floor in floors_of(op, torch_cpu, one_shape=False):
            measure_floor = functools.partial(run_floor, floor, torch_cpu, op, tensors)
            paths.append((f"{label}, floor: {floor}", None, measure_floor))
        for path_label, path_target, path in paths:

            def measure(
                peer: Callable[[int], object] = peer, path: Callable[[int], float] = path
            ) -> tuple[float, float]:
                return _timed(lambda: _calls(peer, n)), path(n)

            rows.append(TargetRow(path_label, path_target, n, measure, family=label))
    return rows


def _glu_peer(args: tuple[Any, ...]) -> object:
    return aten.glu_backward(args[0], args[1], -1)


def _medium_rows(round_bytes: int) -> list[TargetRow]:
    rng = np.random.default_rng(2)
    rows = []
    for device in ("cpu", "torch:cpu"):
        target = BenchTarget(device)
        for op, make in (("glu_backward", _glu), ("group_norm_backward", _gnb)):
            for nbytes in SIZES:
                n = max(32, round_bytes // nbytes // 32 * 32)
                work = make(rng, nbytes, n)
                tensors = as_tensors(work)
                mine = on_device(target, work)
                call: Callable[[Any], object] = _gnb_peer
                if op == "glu_backward":
                    call = _glu_peer

                def scheduled(
                    target: BenchTarget = target, op: str = op, mine: list[Any] = mine
                ) -> float:
                    (seconds,) = asyncio.run(_scheduled(target, op, mine, 1))
                    return seconds

                name = "GLU" if op == "glu_backward" else "GroupNormBackward"
                where = "" if device == "cpu" else f", {device}"
                label = f"{name} medium {nbytes >> 10} KiB{where}"
                paths: list[tuple[str, float | None, Callable[[], float]]] = [
                    (f"{label}, {COROUTINES} coroutines", 0.95, scheduled)
                ]
                short = "glu" if op == "glu_backward" else "gnb"
                for floor in floors_of(short, target):
                    measure_floor = functools.partial(
                        run_floor, floor, target, short, mine, n, COROUTINES
                    )
                    paths.append((f"{label}, floor: {floor}", None, measure_floor))
                for path_label, path_target, path in paths:

                    def measure(
                        call: Callable[[Any], object] = call,
                        tensors: list[Any] = tensors,
                        path: Callable[[], float] = path,
                    ) -> tuple[float, float]:
                        # each result dropped as the next call starts, as the coroutines
                        # drop theirs: a peer that kept them all would pay for fresh
                        # memory the scheduler's path reuses
                        return _timed(
                            lambda: _calls(lambda k: call(tensors[k]), len(tensors))
                        ), path()

                    rows.append(TargetRow(path_label, path_target, n, measure, family=label))
    return rows


def _graph_rows(chains: int, repeats: int) -> list[TargetRow]:
    target = BenchTarget()
    work = [_Chain(np.random.default_rng(3)) for _ in range(chains)]

    def awaited() -> tuple[float, np.ndarray]:
        return asyncio.run(_concurrent(target, work, repeats, _Chain.as_awaits))

    def measure() -> tuple[float, float]:
        peer, _ = awaited()
        graphs, _ = asyncio.run(_concurrent(target, work, repeats, _Chain.as_graph))
        return peer, graphs

    def measure_floor() -> tuple[float, float]:
        peer, expected = awaited()
        floor, got = run_graph_floor(work, repeats)
        assert np.array_equal(got, expected), "the graph floor's bits differ from the chain's"
        return peer, floor

    label = f"8-node chains as graphs, {chains} clients"
    runs = chains * repeats
    return [
        TargetRow(label, 1.2, runs, measure, peer="awaited chains", family=label),
        TargetRow(
            f"{label}, floor: {FEATURED}",
            None,
            runs,
            measure_floor,
            peer="awaited chains",
            family=label,
        ),
    ]


#: The table's groups of rows, in the order they print.
GROUPS = ("tiny", "mixed", "medium", "graphs")


def bench_targets(
    rounds: int = 5, quick: bool = False, groups: tuple[str, ...] = GROUPS
) -> dict[str, Any]:
    """Every row of the cost table (of ``groups``): per row, the ratio of each round (peer /
    path) and the microseconds per request of both; empty without torch (the peer).
    ``quick``: small workloads (a smoke run)."""
    if torch_peer() is None:
        return {}
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        msg = f"unknown cost-target group(s) {unknown}; valid: {list(GROUPS)}"
        raise ValueError(msg)
    requests = 2048 if quick else 25_600
    makers: dict[str, Callable[[], list[TargetRow]]] = {
        "tiny": lambda: _tiny_rows(requests),
        "mixed": lambda: _mixed_rows(requests),
        "medium": lambda: _medium_rows(8 << 20 if quick else 64 << 20),
        "graphs": lambda: _graph_rows(8 if quick else 64, 2 if quick else 20),
    }
    rows = [row for group in GROUPS if group in groups for row in makers[group]()]
    measured: list[list[tuple[float, float]]] = [[] for _ in rows]
    for _ in range(rounds):  # interleaved: every row once a round
        for row, times in zip(rows, measured, strict=True):
            times.append(row.round())
    out = []
    for row, times in zip(rows, measured, strict=True):
        ratios = [peer / ours for peer, ours in times]
        out.append(
            {
                "path": row.label,
                "target": row.target,
                "peer": row.peer,
                "requests": row.requests,
                "ratio": statistics.median(ratios),
                "rounds": ratios,
                "us": statistics.median(ours for _, ours in times) / row.requests * 1e6,
                "peer_us": statistics.median(peer for peer, _ in times) / row.requests * 1e6,
                "family": row.family,
                # a floor of a batcher with the scheduler's features (see bench_floors)
                "keeps_features": row.target is None and row.label.endswith(f"floor: {FEATURED}"),
            }
        )
    return {"rounds": rounds, "rows": out}


def print_targets(r: dict[str, Any], out: TextIO) -> None:
    """Print the table: each row's median ratio, spread, target and whether it is met."""
    if not r:
        print("12. cost targets: needs torch (the peer); not measured", file=out)
        return
    print(
        f"12. cost targets, median of {r['rounds']} interleaved rounds (peer: torch's call "
        "per request; graphs: the same chains awaited)",
        file=out,
    )
    print(
        f"{'path':<66}{'us':>7}{'peer us':>9}{'ratio':>8}  {'rounds':<13}{'target':>7}",
        file=out,
    )
    for row in r["rows"]:
        rounds = row["rounds"]
        spread = f"{min(rounds):.2f}-{max(rounds):.2f}x"
        stands = verdict(row, r["rows"])
        goal = "" if row["target"] is None else f">= {row['target']:.2f}x"
        print(
            f"{row['path']:<66}{row['us']:>7.1f}{row['peer_us']:>9.1f}{row['ratio']:>7.2f}x  "
            f"{spread:<13}{goal:>7}  {'(a floor)' if stands == 'a floor' else stands}",
            file=out,
        )
