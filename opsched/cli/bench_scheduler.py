"""The scheduler benchmark: thirteen figures, each against a baseline measured in the same run.

1. Small-request throughput: 256 coroutines each awaiting 200 requests through the
   scheduler, against the same requests one at a time through the two-phase API with no
   scheduler, as its caller writes it (fresh outputs, workspace size, workspace, launch:
   :func:`~opsched.cli.bench_paths.two_phase_call`, the direct baseline of every figure).
2. Idle latency: one request at a time; scheduler median minus direct median.
3. Event-loop responsiveness: a 1 ms ticker's lag while 32 large GLU requests run.
4. Stream scaling: 64 requests of GLU 256x8192, streams=2 against streams=1; and one GLU
   of 16M elements (``self`` 2048x8192, ``out=`` given) awaited alone, which the scheduler
   splits across the idle streams: streams=2 against streams=1.
5. Steady state: new workspace allocations and executor-cache hit rate in the measured
   round of (1), after two warm-up rounds of the same workload.
6. Tracing overhead: the throughput of (1) for GLU with a timeline trace recorded, against
   the same run without, interleaved.
7. Sweeps (for the plot): throughput of (1) for GLU against the number of concurrent
   clients, and against the fused batch size (``max_batch_requests``).
8. Paths: the per-request cost of each way in (coroutines, ``submit_*`` from a thread,
   blocking calls, the two-phase API) against the operator called once per request:
   torch's, and for GroupNormalizationGrad its own two-phase call
   (:mod:`opsched.cli.bench_paths`).
9. Memory: what a steady-state round of tiny awaited requests leaves allocated, and its
   peak per in-flight request (``tracemalloc``).
10. Medium requests (64 KiB to 1 MiB) against torch's operator per request
   (:mod:`opsched.cli.bench_medium`).
11. Calls: the Python functions one request enters and the bytecodes it runs on each
   path, in steady state (:mod:`opsched.cli.bench_calls`): counts, not times.
12. Cost targets: every path, device and workload against torch's call per request, each
   beside its target, median and spread of at least five interleaved rounds
   (:mod:`opsched.cli.bench_targets`; on the host device and ``torch:cpu`` whatever
   ``--device`` says).
13. Solo or fused: per operator and size, tiny requests of 256 coroutines all run at
   submit against all fused, on the cpu device (:mod:`opsched.cli.bench_alone`): each
   operator's ``alone_from`` sits where the two cross.

On a torch device the scheduler is given torch tensors (a torch user's calls), and (1)'s
torch line compares it with the framework's call once per request.

Where torch is installed, (1) adds its CPU operator called once per request
(single-threaded) as a peer.

Medians over repeats; the machines we run on are shared and noisy.
"""

from __future__ import annotations

import asyncio
import pathlib
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import numpy as np

import opsched
from opsched.cli.bench_alone import bench_alone, print_alone
from opsched.cli.bench_calls import bench_calls, print_calls
from opsched.cli.bench_kernels import BenchTarget, torch_peer
from opsched.cli.bench_medium import bench_medium, on_device, print_medium
from opsched.cli.bench_paths import (
    INPUTS,
    bench_memory,
    bench_paths,
    glu_inputs,
    print_paths,
    torch_per_request,
    two_phase_call,
)
from opsched.cli.bench_report import added_latency
from opsched.cli.bench_targets import GROUPS as TARGET_GROUPS
from opsched.cli.bench_targets import bench_targets, print_targets

__all__ = ["bench_scheduler", "print_scheduler_report"]

F32 = np.float32


def _submit(sched: opsched.Scheduler, op: str) -> Callable[..., Any]:
    calls: dict[str, Callable[..., Any]] = {
        "glu": sched.glu_backward,
        "gn": sched.group_norm_grad,
        "gnb": sched.group_norm_backward,
    }
    return calls[op]


async def _throughput_run(
    target: BenchTarget,
    op: str,
    inputs: list[tuple[np.ndarray, ...]],
    clients: int,
    per_client: int,
    trace: str | None = None,
    **overrides: Any,
) -> tuple[float, opsched.SchedulerStatistics, opsched.SchedulerStatistics]:
    async with target.open(trace, **overrides) as sched:
        call = _submit(sched, op)

        async def client(i: int) -> None:
            for j in range(per_client):
                await call(*inputs[(i * per_client + j) % len(inputs)])

        for _ in range(2):  # warm-up: two rounds, until batch compositions have settled
            await asyncio.gather(*(client(i) for i in range(clients)))
        before = sched.statistics()
        start = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(clients)))
        elapsed = time.perf_counter() - start
        after = sched.statistics()
    return elapsed, before, after


def _throughput(
    target: BenchTarget,
    op: str,
    repeats: int,
    clients: int,
    per_client: int,
    trace: str | None = None,
) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    inputs = INPUTS[op](rng, 4096)
    total = clients * per_client
    direct = two_phase_call(op)
    torch = torch_peer()
    peer = torch_per_request(op, inputs) if torch is not None else None
    sched_times, direct_times, ratios, torch_ratios = [], [], [], []
    steady: dict[str, Any] = {}
    mine = on_device(target, inputs)  # tensors on a torch device, as a torch user calls
    for i in range(repeats):
        elapsed, before, after = asyncio.run(
            _throughput_run(target, op, mine, clients, per_client, trace if i == 0 else None)
        )
        start = time.perf_counter()
        for k in range(total):
            direct(*inputs[k % len(inputs)])
        t_direct = time.perf_counter() - start
        sched_times.append(elapsed)
        direct_times.append(t_direct)
        ratios.append(t_direct / elapsed)
        if peer is not None:
            start = time.perf_counter()
            for k in range(total):
                peer(k)
            torch_ratios.append((time.perf_counter() - start) / elapsed)
        hits = after.executor_cache.hits - before.executor_cache.hits
        misses = after.executor_cache.misses - before.executor_cache.misses
        steady = {
            "new_workspace_allocations": after.pool.misses - before.pool.misses,
            "new_workspace_bytes": after.pool.allocated - before.pool.allocated,
            "executor_hit_rate": hits / (hits + misses) if hits + misses else 1.0,
            "requests_per_launch_mean": (after.completed - before.completed)
            / max(1, after.launches - before.launches),
        }
    result: dict[str, Any] = {
        "requests": total,
        "scheduler_rps": total / statistics.median(sched_times),
        "direct_rps": total / statistics.median(direct_times),
        "speedup": statistics.median(ratios),
        "steady_state": steady,
    }
    if torch_ratios:
        speedup = statistics.median(torch_ratios)
        result["torch_rps"] = result["scheduler_rps"] / speedup
        result["speedup_vs_torch"] = speedup
    return result


def _tracing(target: BenchTarget, repeats: int, clients: int, per_client: int) -> dict[str, Any]:
    """GLU throughput with a trace recorded against without, interleaved."""
    inputs = glu_inputs(np.random.default_rng(0), 4096)
    total = clients * per_client
    off, on, ratios = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = str(pathlib.Path(tmp) / "bench.trace.json")
        for _ in range(repeats):
            t_off = asyncio.run(_throughput_run(target, "glu", inputs, clients, per_client))[0]
            t_on = asyncio.run(_throughput_run(target, "glu", inputs, clients, per_client, path))[0]
            off.append(t_off)
            on.append(t_on)
            ratios.append(t_on / t_off)
    overhead = statistics.median(ratios) - 1.0
    return {
        "requests": total,
        "untraced_rps": total / statistics.median(off),
        "traced_rps": total / statistics.median(on),
        "overhead": overhead,
    }


#: Concurrent clients and fused batch caps of the sweeps.
SWEEP_CLIENTS = (1, 2, 4, 8, 16, 64, 256)
SWEEP_BATCH = (1, 4, 16, 64, 256, 1024)


def _sweeps(target: BenchTarget, repeats: int, requests: int) -> dict[str, Any]:
    """GLU throughput against concurrency and against the fused batch cap."""
    inputs = glu_inputs(np.random.default_rng(0), 4096)

    def rps(clients: int, **overrides: Any) -> tuple[float, float]:
        per_client = max(1, requests // clients)
        runs = [
            asyncio.run(_throughput_run(target, "glu", inputs, clients, per_client, **overrides))
            for _ in range(repeats)
        ]
        elapsed, before, after = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
        fused = (after.completed - before.completed) / max(1, after.launches - before.launches)
        return clients * per_client / elapsed, fused

    by_clients = []
    for clients in SWEEP_CLIENTS:
        r, fused = rps(clients)
        by_clients.append({"clients": clients, "rps": r, "requests_per_launch": fused})
    by_batch = []
    for cap in SWEEP_BATCH:
        r, fused = rps(256, max_batch_requests=cap)
        by_batch.append({"max_batch_requests": cap, "rps": r, "requests_per_launch": fused})
    direct = two_phase_call("glu")
    start = time.perf_counter()
    for k in range(requests):
        direct(*inputs[k % len(inputs)])
    return {
        "by_clients": by_clients,
        "by_batch": by_batch,
        "direct_rps": requests / (time.perf_counter() - start),
    }


async def _latency_run(
    target: BenchTarget, args: tuple[np.ndarray, ...], n: int
) -> tuple[list[float], list[float]]:
    """Alternate one scheduler request and one direct call, n times: drift in the
    machine's load hits both series alike."""
    direct = two_phase_call("glu")
    g, x = args
    sched_s, direct_s = [], []
    async with target.open() as sched:
        for _ in range(50):
            await sched.glu_backward(g, x)
            direct(g, x)
        for _ in range(n):
            start = time.perf_counter()
            await sched.glu_backward(g, x)
            mid = time.perf_counter()
            direct(g, x)
            end = time.perf_counter()
            sched_s.append(mid - start)
            direct_s.append(end - mid)
    return sched_s, direct_s


def _latency(target: BenchTarget, repeats: int, n: int = 2000) -> dict[str, Any]:
    rng = np.random.default_rng(1)
    args = glu_inputs(rng, 1)[0]
    sched_med, direct_med = [], []
    for _ in range(repeats):
        sched_s, direct_s = asyncio.run(_latency_run(target, args, n))
        sched_med.append(statistics.median(sched_s))
        direct_med.append(statistics.median(direct_s))
    s, d = statistics.median(sched_med), statistics.median(direct_med)
    return {"scheduler_median_us": s * 1e6, "direct_median_us": d * 1e6, "added_us": (s - d) * 1e6}


async def _responsiveness_run(target: BenchTarget, requests: int) -> dict[str, float]:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1024, 8192)).astype(F32)
    g = rng.standard_normal((1024, 4096)).astype(F32)
    lags: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - start - 0.001)

    async with target.open() as sched:
        await sched.glu_backward(g, x)  # warm-up: executors and workspace
        tick = asyncio.ensure_future(ticker())
        start = time.perf_counter()
        results = await asyncio.gather(*(sched.glu_backward(g, x) for _ in range(requests)))
        elapsed = time.perf_counter() - start
        done.set()
        await tick
        # dropped once the ticks are over: freeing the results (1 GiB) is the caller's
        # work, not the scheduler's (measured: about 30 ms of loop time on torch:cpu)
        del results
    lags.sort()
    return {
        "p99_lag_ms": lags[int(0.99 * (len(lags) - 1))] * 1e3,
        "max_lag_ms": lags[-1] * 1e3,
        "ticks": len(lags),
        "seconds": elapsed,
    }


def _responsiveness(target: BenchTarget, repeats: int, requests: int = 32) -> dict[str, Any]:
    runs = [asyncio.run(_responsiveness_run(target, requests)) for _ in range(repeats)]
    return {
        "requests": requests,
        "p99_lag_ms": statistics.median(r["p99_lag_ms"] for r in runs),
        "max_lag_ms": statistics.median(r["max_lag_ms"] for r in runs),
        "ticks": runs[-1]["ticks"],
    }


async def _scaling_run(target: BenchTarget, streams: int, requests: int) -> float:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((256, 8192)).astype(F32)
    g = rng.standard_normal((256, 4096)).astype(F32)
    async with target.open(streams=streams) as sched:
        await asyncio.gather(*(sched.glu_backward(g, x) for _ in range(streams)))  # warm-up
        start = time.perf_counter()
        await asyncio.gather(*(sched.glu_backward(g, x) for _ in range(requests)))
        return time.perf_counter() - start


def _split_arrays() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(grad_out, self, out)`` of the split figure's 16M-element GLU."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2048, 8192)).astype(F32)
    g = rng.standard_normal((2048, 4096)).astype(F32)
    return g, x, np.empty_like(x)


async def _split_run(
    target: BenchTarget, streams: int, calls: int, arrays: tuple[np.ndarray, ...]
) -> float:
    """Seconds per call of one 16M-element GLU awaited alone ``calls`` times (into the same
    ``out=``: the result's fresh pages would cost more than the kernel). Both stream
    counts run on the same ``arrays``: with 160 MiB allocated afresh for each run, the
    figure measured where each run's pages came to lie as much as the streams (the same
    hour: 1.17-1.56x that way, 1.83-1.87x on the same arrays)."""
    g, x, out = arrays
    async with target.open(streams=streams) as sched:
        await sched.glu_backward(g, x, out=out)  # warm-up
        start = time.perf_counter()
        for _ in range(calls):
            await sched.glu_backward(g, x, out=out)
        return (time.perf_counter() - start) / calls


def _copy_scaling() -> float:
    """The machine's own scaling for the split figure: a copy of the 16M-element GLU's bytes
    (160 MiB) on two threads, each half, against one thread: what memory bandwidth allows."""
    src = np.ones(80 << 20, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # pages in
    half = src.size // 2
    start = time.perf_counter()
    np.copyto(dst, src)
    one = time.perf_counter() - start
    parts = [slice(0, half), slice(half, None)]
    threads = [threading.Thread(target=np.copyto, args=(dst[p], src[p])) for p in parts]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return one / (time.perf_counter() - start)


def _scaling(target: BenchTarget, repeats: int, requests: int = 64) -> dict[str, Any]:
    ratios, one, two, split, copy = [], [], [], [], []
    for _ in range(repeats):
        t1 = asyncio.run(_scaling_run(target, 1, requests))
        t2 = asyncio.run(_scaling_run(target, 2, requests))
        one.append(requests / t1)
        two.append(requests / t2)
        ratios.append(t1 / t2)
    arrays = _split_arrays()  # after the rounds above: their memory is not this one's
    for _ in range(repeats):
        one_stream = asyncio.run(_split_run(target, 1, 4, arrays))
        split.append(one_stream / asyncio.run(_split_run(target, 2, 4, arrays)))
        copy.append(_copy_scaling())
    return {
        "requests": requests,
        "streams1_rps": statistics.median(one),
        "streams2_rps": statistics.median(two),
        "speedup": statistics.median(ratios),
        "split_speedup": statistics.median(split),
        "copy_speedup": statistics.median(copy),
    }


#: Every part, in the order they run.
PARTS = (
    "throughput",
    "latency",
    "responsiveness",
    "scaling",
    "tracing",
    "sweeps",
    "paths",
    "memory",
    "medium",
    "calls",
    "targets",
    "alone",
)


def bench_scheduler(
    repeats: int = 3,
    parts: tuple[str, ...] = PARTS,
    clients: int = 256,
    per_client: int = 200,
    target: BenchTarget | None = None,
    trace: str | None = None,
    quick: bool = False,
    target_groups: tuple[str, ...] = TARGET_GROUPS,
) -> dict[str, Any]:
    """Run the chosen parts; return their figures (steady state rides on throughput).

    ``trace``: record the first GLU throughput run's timeline to this path. ``quick``:
    the cost targets on small workloads (a smoke run). ``target_groups``: the cost
    targets' rows to run (:data:`~opsched.cli.bench_targets.GROUPS`).
    """
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        msg = f"unknown scheduler benchmark part(s) {unknown}; valid: {list(PARTS)}"
        raise ValueError(msg)
    target = target or BenchTarget()
    result: dict[str, Any] = {"repeats": repeats, "device": target.device}
    if "throughput" in parts:
        result["throughput_glu"] = _throughput(target, "glu", repeats, clients, per_client, trace)
        result["throughput_gn"] = _throughput(target, "gn", repeats, clients, per_client)
        result["throughput_gnb"] = _throughput(target, "gnb", repeats, clients, per_client)
    if "latency" in parts:
        result["latency"] = _latency(target, repeats)
    if "responsiveness" in parts:
        result["responsiveness"] = _responsiveness(target, repeats)
    if "scaling" in parts:
        result["scaling"] = _scaling(target, repeats)
    if "tracing" in parts:
        result["tracing"] = _tracing(target, repeats, clients, per_client)
    if "sweeps" in parts:
        result["sweeps"] = _sweeps(target, repeats, clients * per_client // 4)
    if "paths" in parts:
        result["paths"] = bench_paths(target, repeats, clients * per_client // 2)
    if "memory" in parts:
        result["memory"] = bench_memory(target, clients * per_client // 4)
    if "medium" in parts:
        result["medium"] = bench_medium(target, repeats)
    if "calls" in parts and target.device == "cpu":
        result["calls"] = bench_calls()
    if "targets" in parts:
        result["targets"] = bench_targets(max(5, repeats), quick=quick, groups=target_groups)
    if "alone" in parts and target.device == "cpu":
        result["alone"] = bench_alone(repeats, 1_024 if quick else 7_680)
    return result


def print_scheduler_report(r: dict[str, Any], out: TextIO) -> None:
    """Print every figure, each against its peer where it has one."""

    def line(name: str, figure: str) -> None:
        print(f"{name:<58}{figure}", file=out)

    print(f"{'figure':<58}{'measured (median of ' + str(r['repeats']) + ')'}", file=out)
    for key, label in (
        ("throughput_glu", "GLU 8x64"),
        ("throughput_gn", "group norm 4x8x64"),
        ("throughput_gnb", "GroupNormBackward 4x8x64"),
    ):
        if key in r:
            t = r[key]
            line(
                f"1. throughput, {label}, {t['requests']} requests",
                f"{t['scheduler_rps']:,.0f}/s vs two-phase calls {t['direct_rps']:,.0f}/s "
                f"= {t['speedup']:.2f}x",
            )
            if "torch_rps" in t:
                where = r.get("device", "cpu")
                peer = where if where.startswith("torch") else "torch CPU"
                line(
                    f"   vs torch's operator per request ({peer})",
                    f"{t['torch_rps']:,.0f}/s; scheduler {t['speedup_vs_torch']:.2f}x",
                )
    if "latency" in r:
        lat = r["latency"]
        line(
            "2. idle latency, added by the scheduler",
            f"{lat['scheduler_median_us']:.0f} us - {lat['direct_median_us']:.0f} us (call) = "
            + added_latency(lat),
        )
    if "responsiveness" in r:
        resp = r["responsiveness"]
        line(
            "3. loop lag, 32 x GLU 1024x8192 running",
            f"p99 {resp['p99_lag_ms']:.2f} ms, max {resp['max_lag_ms']:.2f} ms",
        )
    if "scaling" in r:
        sc = r["scaling"]
        line(
            "4. stream scaling, 64 x GLU 256x8192",
            f"streams=2 {sc['streams2_rps']:.1f}/s vs streams=1 {sc['streams1_rps']:.1f}/s "
            f"= {sc['speedup']:.2f}x",
        )
        line(
            "4. split scaling, one GLU of 16M elements",
            f"streams=2 {sc['split_speedup']:.2f}x streams=1 (a copy: {sc['copy_speedup']:.2f}x)",
        )
    for key in ("throughput_glu", "throughput_gn", "throughput_gnb"):
        if key in r:
            st = r[key]["steady_state"]
            line(
                f"5. steady state ({key[11:]})",
                f"{st['new_workspace_allocations']} new blocks, "
                f"hit rate {st['executor_hit_rate']:.2%}, "
                f"{st['requests_per_launch_mean']:.0f} req/launch",
            )
    if "tracing" in r:
        tr = r["tracing"]
        line(
            "6. tracing overhead, GLU throughput",
            f"{tr['traced_rps']:,.0f}/s traced vs {tr['untraced_rps']:,.0f}/s = "
            f"{tr['overhead']:+.1%}",
        )
    if "sweeps" in r:
        sw = r["sweeps"]
        clients = ", ".join(f"{p['clients']}: {p['rps']:,.0f}" for p in sw["by_clients"])
        batch = ", ".join(f"{p['max_batch_requests']}: {p['rps']:,.0f}" for p in sw["by_batch"])
        print(f"7. GLU req/s by concurrent clients   {clients}", file=out)
        print(f"   GLU req/s by max_batch_requests   {batch}", file=out)
        print(f"   (direct, one request at a time: {sw['direct_rps']:,.0f}/s)", file=out)
    if "paths" in r:
        print(
            "8. the per-request cost of every path, against the operator once per request "
            "(torch's; GroupNormalizationGrad: its own two-phase call)",
            file=out,
        )
        print_paths(r["paths"], out)
    if "memory" in r:
        mem = r["memory"]
        line(
            f"9. memory, {mem['requests']} GLU 8x64 awaited",
            f"{mem['held_bytes']:,} B held after; peak {mem['peak_per_request']:,.0f} B per "
            f"in-flight request (output {mem['output_bytes']:,} B)",
        )
    if "medium" in r:
        print_medium(r["medium"], line, out)
    if "calls" in r:
        print("11. ", end="", file=out)
        print_calls(r["calls"], out)
    if "targets" in r:
        print_targets(r["targets"], out)
    if "alone" in r:
        print_alone(r["alone"], line)
