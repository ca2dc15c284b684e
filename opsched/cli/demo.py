"""``python -m opsched demo``: the seeds through the two-phase API, then the scheduler.

1. The worked examples of the vendor's operator documents through the two-phase API.
2. An async "training loop": many coroutines, each running a small backward step
   (group-norm grad, then GLU backward on the result) for several iterations, both as
   awaited calls and as a two-node graph; its timeline is written as a trace.
3. A sync batch script queueing thousands of requests through ``opsched.sync``.

Every scheduler result is checked bit for bit against the same request run alone through
the two-phase API (on a torch device: the framework's own call on that request); the demo
exits 1 if any differs. A summary table ends the output.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, TextIO

import numpy as np

import opsched
import opsched.sync
from opsched import SchedulerConfig
from opsched.cli.seeds import glu_seed, group_norm_seed
from opsched.cli.solo import same_bits, solo_glu, solo_gn, solo_gnb
from opsched.devices import make_device
from opsched.ops.products import product_named

__all__ = ["run_demo"]


_DX_ONLY = (True, False, False)


class _Solo:
    """The oracle: each request alone, through the two-phase API on the numpy devices, or as
    the framework's own call on a torch device (whose results are the framework's)."""

    def __init__(self, device: str) -> None:
        self.torch = device.startswith("torch")

    def glu(self, g: np.ndarray, x: np.ndarray, dim: int) -> np.ndarray:
        if not self.torch:
            return solo_glu(g, x, dim)
        from opsched.devices.torch import aten as t

        return t.from_torch(t.glu_backward(t.to_torch(g), t.to_torch(x), dim))

    def gn(self, *args: np.ndarray) -> np.ndarray:
        if not self.torch:
            return solo_gn(*args)
        from opsched.devices.torch import aten as t

        return t.from_torch(t.group_norm_grad(*(t.to_torch(a) for a in args)))

    def gnb_dx(self, x: np.ndarray, dy: np.ndarray, mean: np.ndarray, rstd: np.ndarray) -> Any:
        if not self.torch:
            n, g, m = x.shape
            dx = solo_gnb(dy, x, mean, rstd, None, n, g, m, g, _DX_ONLY)[0]
            assert dx is not None
            return dx
        from opsched.devices.torch import aten as t

        n, g, m = x.shape
        args = (t.to_torch(dy), t.to_torch(x), t.to_torch(mean), t.to_torch(rstd))
        dx = t.group_norm_backward(*args, None, n, g, m, g, _DX_ONLY)[0]
        return t.from_torch(dx.reshape(x.shape))


def _seeds(out: TextIO) -> None:
    grad_out, x, dim = glu_seed()
    result = solo_glu(grad_out, x, dim)
    print("1. The seed examples through the two-phase API (aclnn)", file=out)
    print(f"   GluBackward, self {x.shape} FLOAT, grad_out = 1, dim = {dim}:", file=out)
    print(f"     out[0, 0] = {np.array2string(result[0, 0], precision=6)}", file=out)
    x, dy, gamma, mean, rstd = group_norm_seed()
    dx = solo_gn(x, dy, gamma, mean, rstd)
    print(f"   GroupNormalizationGrad, x {x.shape}, x[..., i] = i / 128, dy = 0.5:", file=out)
    print(f"     dx[1, 3, -3:] = {np.array2string(dx[1, 3, -3:], precision=6)}", file=out)
    print("     (every group is -31.75 / 128 * x: s1 = 64 cancels M * dy)", file=out)


async def _training_loop(
    workers: int,
    steps: int,
    rng: np.random.Generator,
    config: SchedulerConfig,
    device: str,
    trace: str | None,
) -> dict[str, Any]:
    """Each worker, per step: x -> group-norm grad -> GLU backward on that gradient, as two
    awaited calls and as a graph run."""
    shapes = [(4, 8, 32), (2, 8, 64), (8, 4, 16)]
    data = []
    for w in range(workers):
        n, g, m = shapes[w % len(shapes)]
        x, dy, gamma = (rng.standard_normal((n, g, m)).astype(np.float32) for _ in range(3))
        mean = rng.standard_normal((n, g)).astype(np.float32)
        rstd = (rng.random((n, g)) + 0.5).astype(np.float32)
        gate = rng.standard_normal((n, g, 2 * m)).astype(np.float32)
        data.append((x, dy, gamma, mean, rstd, gate))
    results: list[list[np.ndarray]] = [[] for _ in range(workers)]

    # The product's group-norm operator: GroupNormalizationGrad, else GroupNormBackward's dx
    # (channels = groups, gamma ones) on products without it.
    full = "GroupNormalizationGrad" not in product_named(config.product).ops

    async def worker(w: int) -> None:
        x, dy, gamma, mean, rstd, gate = data[w]
        n, g, m = x.shape
        graph = opsched.Graph()
        if full:
            gn = graph.group_norm_backward(dy, x, mean, rstd, None, n, g, m, g, _DX_ONLY)
        else:
            gn = graph.group_norm_grad(x, dy, gamma, mean, rstd)
        step = graph.glu_backward(gn, gate, dim=-1)
        for _ in range(steps):
            dx: Any
            if full:
                dx, _, _ = await opsched.group_norm_backward(
                    dy, x, mean, rstd, None, n, g, m, g, _DX_ONLY
                )
            else:
                dx = await opsched.group_norm_grad(x, dy, gamma, mean, rstd)
            results[w].append(await opsched.glu_backward(dx, gate, dim=-1))
            results[w].extend(await opsched.run(graph, [step]))

    async with opsched.open_scheduler(config, device=device, trace=trace) as sched:
        start = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(workers)))
        elapsed = time.perf_counter() - start
        stats = sched.statistics()
    mismatches = 0
    for (x, dy, gamma, mean, rstd, gate), outs in zip(data, results, strict=True):
        solo = _Solo(device)
        dx = solo.gnb_dx(x, dy, mean, rstd) if full else solo.gn(x, dy, gamma, mean, rstd)
        expected = solo.glu(dx, gate, -1)
        mismatches += sum(not same_bits(o, expected) for o in outs)
    return {"stats": stats, "seconds": elapsed, "mismatches": mismatches}


def _batch_script(
    requests: int, rng: np.random.Generator, config: SchedulerConfig, device: str
) -> dict[str, Any]:
    inputs = [
        (
            rng.standard_normal((16, 32)).astype(np.float32),
            rng.standard_normal((16, 64)).astype(np.float32),
        )
        for _ in range(64)
    ]
    with opsched.sync.open_scheduler(config, device=device) as sched:
        start = time.perf_counter()
        futures = [sched.submit_glu_backward(*inputs[i % 64]) for i in range(requests)]
        results = [f.result() for f in futures]
        elapsed = time.perf_counter() - start
        stats = sched.statistics()
    expected = [_Solo(device).glu(g, x, -1) for g, x in inputs]
    mismatches = sum(not same_bits(r, expected[i % 64]) for i, r in enumerate(results))
    return {"stats": stats, "seconds": elapsed, "mismatches": mismatches}


def _print_stats(stats: opsched.SchedulerStatistics, seconds: float, out: TextIO) -> None:
    print(
        f"   {stats.completed} requests in {stats.launches} launches "
        f"({stats.requests_per_launch_mean:.1f} per launch on average, "
        f"{stats.requests_per_launch_max} at most) in {seconds * 1e3:.0f} ms",
        file=out,
    )
    streams = ", ".join(
        f"stream {s.index}: {s.launches} launches, {s.busy_seconds * 1e3:.0f} ms busy"
        for s in stats.streams
    )
    print(f"   {streams}", file=out)
    pool, cache = stats.pool, stats.executor_cache
    print(
        f"   workspace pool: peak {pool.peak / 1024:.0f} KiB, {pool.hits} hits / "
        f"{pool.misses} misses; executor cache: {cache.hits} hits / {cache.misses} misses",
        file=out,
    )


def _summary_table(rows: list[tuple[str, dict[str, Any]]], out: TextIO) -> None:
    head = (
        f"{'workload':<22}{'requests':>9}{'launches':>10}{'per launch':>11}{'ms':>8}"
        f"{'pool peak':>11}{'cache hits':>12}{'bit-identical':>15}"
    )
    print(head, file=out)
    print("-" * len(head), file=out)
    for name, r in rows:
        st = r["stats"]
        print(
            f"{name:<22}{st.completed:>9}{st.launches:>10}{st.requests_per_launch_mean:>11.1f}"
            f"{r['seconds'] * 1e3:>8.0f}{st.pool.peak / 1024:>8.0f} KiB"
            f"{st.executor_cache.hits:>12}{'yes' if r['mismatches'] == 0 else 'NO':>15}",
            file=out,
        )


def run_demo(
    out: TextIO,
    config: SchedulerConfig | None = None,
    device: str = "cpu",
    trace: str | None = None,
) -> int:
    """Run the demo, printing to ``out``; return the exit status (1 on a mismatch).

    Args:
        config: the scheduler config (default: the defaults with two streams).
        device: the device both schedulers run on.
        trace: write the training loop's timeline here (Chrome trace / Perfetto JSON).
    """
    config = config or SchedulerConfig(streams=2)
    make_device(device, 1).close()  # an unknown or absent device: said before any output
    product = product_named(config.product)
    if "GluBackward" not in product.ops or not {
        "GroupNormalizationGrad",
        "GroupNormBackward",
    } & set(product.ops):
        print(
            f"{product.name} ({product.description}) lacks the operators the demo runs "
            f"(it has: {', '.join(product.ops) or 'none'}); see opsched products",
            file=out,
        )
        return 2
    rng = np.random.default_rng(0)
    _seeds(out)

    workers, steps = 64, 20
    loop = asyncio.run(_training_loop(workers, steps, rng, config, device, trace))
    print(
        f"\n2. Async training loop: {workers} coroutines x {steps} steps of "
        "group-norm grad -> GLU backward, awaited and as a graph",
        file=out,
    )
    _print_stats(loop["stats"], loop["seconds"], out)
    print(f"   results bit-identical to solo launches: {loop['mismatches'] == 0}", file=out)
    if trace:
        print(f"   timeline written to {trace} (open it in https://ui.perfetto.dev)", file=out)

    batch = _batch_script(5000, rng, config, device)
    print("\n3. Sync batch script: 5000 GLU backward requests queued with opsched.sync", file=out)
    _print_stats(batch["stats"], batch["seconds"], out)
    print(f"   results bit-identical to solo launches: {batch['mismatches'] == 0}", file=out)

    print("\nSummary", file=out)
    _summary_table([("async training loop", loop), ("sync batch script", batch)], out)
    return 1 if loop["mismatches"] or batch["mismatches"] else 0
