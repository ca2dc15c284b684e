"""Check a torch device end to end: the one-command acceptance check for an accelerator.

    python scripts/check_torch_device.py torch:cuda        # or torch:npu:0, torch:cpu
    python scripts/check_torch_device.py torch:cuda --quick    # smaller workloads

Each check prints one PASS / FAIL line; the last line counts them, and the exit status is
1 if any failed. The checks:

- every operator and dtype (FLOAT, FLOAT16, BFLOAT16; DOUBLE where the operator takes it),
  fused, each result within the tolerance of docs/operators.md of the framework's own
  call in float64 and bit for bit the request launched alone;
- batch invariance of all three operators, rows of 16 to 300 elements, 1 to 6 rows a
  request: alone, then shuffled among the others on 4 streams, the same bits;
- 4 streams under a mixed stress run (20,000 requests; cancelled requests drop their
  results while their launches still use the device), its verdict;
- graph chains across streams; inputs produced on a side stream (the launch waits for the
  stream the caller worked on); the event loop's lag while launches wait on the device;
- the framework allocator's statistics while a scheduler runs, and nothing leaked after
  it closed;
- the sync facade with numpy arrays, a split request, a large GroupNormBackward, fault
  isolation, a tensor on another device;
- the cost per request against the framework's own call once per request, the device
  synchronised (reported; above 1.0x the scheduler is cheaper).

Checks raise :class:`CheckFailed`, never a bare ``assert`` (``python -O`` would remove
those, and a broken device would pass).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import opsched
import opsched.sync
from opsched.devices import make_device
from opsched.devices.torch import aten as t


class CheckFailed(Exception):
    """A check found the device wrong."""


def require(condition: object, message: str) -> None:
    """Raise CheckFailed(message) unless ``condition`` holds (kept under ``python -O``)."""
    if not condition:
        raise CheckFailed(message)


def main(device: str, quick: bool = False) -> int:
    torch = t.require_torch("this check")
    results: list[tuple[str, bool, str]] = []

    def check(name: str, fn: Callable[[], Any]) -> None:
        try:
            detail = fn() or ""
            results.append((name, True, str(detail)))
        except Exception as exc:  # report every check, whatever fails
            results.append((name, False, f"{type(exc).__name__}: {exc}"))

    try:
        dev = make_device(device, 1)
    except Exception as exc:  # no such device here: one failed check, not a traceback
        print(f"FAIL  open {device}: {type(exc).__name__}: {exc}")
        return 1
    target = dev.torch_device  # type: ignore[attr-defined]
    dev.close()
    rng = np.random.default_rng(0)

    def tensor(*shape: int) -> Any:
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(target)

    async def ops() -> str:
        glu = [(tensor(16, 32), tensor(16, 64)) for _ in range(64)]
        gn = [
            (
                tensor(4, 8, 16),
                tensor(4, 8, 16),
                tensor(4, 8, 16),
                tensor(4, 8),
                tensor(4, 8).abs() + 0.5,
            )
            for _ in range(32)
        ]
        gnb = [
            (
                tensor(3, 8, 5),
                tensor(3, 8, 5),
                tensor(3, 4),
                tensor(3, 4).abs() + 0.5,
                tensor(8),
                3,
                8,
                5,
                4,
            )
            for _ in range(32)
        ]
        async with opsched.open_scheduler(device=device, streams=2) as sched:
            a = await asyncio.gather(*(sched.glu_backward(g, x) for g, x in glu))
            b = await asyncio.gather(*(sched.group_norm_grad(*r) for r in gn))
            c = await asyncio.gather(*(sched.group_norm_backward(*r) for r in gnb))
            stats = sched.statistics()
        for (g, x), got in zip(glu, a, strict=True):
            require(torch.equal(got, t.glu_backward(g, x, -1)), "GluBackward differs")
        for r, got in zip(gn, b, strict=True):
            require(torch.equal(got, t.group_norm_grad(*r)), "GroupNormalizationGrad differs")
        for r, got in zip(gnb, c, strict=True):
            want = t.group_norm_backward(*r, [True] * 3)
            require(torch.equal(got[0], want[0]), "GroupNormBackward's dx differs")
            for name, a, b in zip(("dgamma", "dbeta"), got[1:], want[1:], strict=True):
                close = torch.allclose(a, b, rtol=2e-4, atol=2e-4)  # summed per sample
                require(
                    close,
                    f"GroupNormBackward's {name} is outside the tolerance of docs/operators.md",
                )
        require(stats.launches < stats.completed, f"nothing fused: {stats.launches} launches")
        return (
            f"{stats.completed} requests in {stats.launches} launches (GroupNormBackward's "
            f"dgamma, dbeta summed per sample: within tolerance); pool {stats.pool}"
        )

    check("three operators, fused, each = its own framework call", lambda: asyncio.run(ops()))

    backend = getattr(torch, target.type, None) if target.type != "cpu" else None
    dtypes = {
        "FLOAT": torch.float32,
        "FLOAT16": torch.float16,
        "BFLOAT16": torch.bfloat16,
        "DOUBLE": torch.float64,
    }
    #: docs/operators.md's (rtol, atol), doubled: both sides are within it of the exact value
    tolerance = {
        torch.float64: (2e-10, 2e-10),
        torch.float32: (2e-4, 2e-4),
        torch.float16: (2e-2, 2e-3),
        torch.bfloat16: (4e-2, 4e-3),
    }

    def cases(kind: Any, count: int) -> dict[str, list[tuple[Any, ...]]]:
        """Requests of each operator in dtype ``kind``, of mixed geometries: rows of 16 to
        300 elements, 1 to 6 rows a request."""

        def make(*shape: int) -> Any:
            return torch.from_numpy(rng.standard_normal(shape)).to(target, kind)

        glu, gn, gnb = [], [], []
        for _ in range(count):
            rows, row = int(rng.integers(1, 7)), int(rng.integers(8, 151))
            glu.append((make(rows, row), make(rows, 2 * row)))
            m = int(rng.integers(16, 301))
            n, groups = int(rng.integers(1, 4)), int(rng.integers(1, 3))
            gn.append(
                (
                    make(n, groups, m),
                    make(n, groups, m),
                    make(n, groups, m),
                    make(n, groups),
                    make(n, groups).abs() + 0.5,
                )
            )
            hxw, channels = int(rng.integers(16, 301)), 2 * groups
            stats = make(n, groups), make(n, groups).abs() + 0.5
            gnb.append(
                (
                    make(n, channels, hxw),
                    make(n, channels, hxw),
                    *stats,
                    make(channels),
                    n,
                    channels,
                    hxw,
                    groups,
                )
            )
        return {"glu_backward": glu, "group_norm_grad": gn, "group_norm_backward": gnb}

    def exact(method: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """The framework's own call on float64 copies of ``args``."""
        wide = tuple(a.double() if isinstance(a, torch.Tensor) else a for a in args)
        if method == "glu_backward":
            return (t.glu_backward(wide[0], wide[1], -1),)
        if method == "group_norm_grad":
            return (t.group_norm_grad(*wide),)
        return tuple(t.group_norm_backward(*wide, [True] * 3))

    def same_bits(a: Any, b: Any) -> bool:
        return (
            a.dtype == b.dtype
            and a.shape == b.shape
            and bool(
                torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
            )
        )

    async def every_dtype() -> str:
        counted = 0
        for name, kind in dtypes.items():
            for method, work in cases(kind, 4 if quick else 12).items():
                if name == "DOUBLE" and method != "glu_backward":
                    continue  # the group norms take no DOUBLE
                async with opsched.open_scheduler(device=device, streams=2) as sched:
                    call = getattr(sched, method)
                    fused = await asyncio.gather(*(call(*args) for args in work))
                    alone = [await call(*args) for args in work]
                for args, got, solo in zip(work, fused, alone, strict=True):
                    got = got if isinstance(got, tuple) else (got,)
                    solo = solo if isinstance(solo, tuple) else (solo,)
                    for a, b, want in zip(got, solo, exact(method, args), strict=True):
                        require(same_bits(a, b), f"{method} {name}: batched bits differ")
                        rtol, atol = tolerance[kind]
                        close = torch.allclose(a.double(), want, rtol=rtol, atol=atol)
                        require(close, f"{method} {name}: outside the tolerance")
                    counted += 1
        return f"{counted} requests in every dtype each operator takes"

    check(
        "every operator and dtype: within tolerance, the same bits fused and alone",
        lambda: asyncio.run(every_dtype()),
    )

    async def invariance_all() -> str:
        counted = 0
        for kind in (torch.float32, torch.bfloat16):
            for method, work in cases(kind, 8 if quick else 24).items():
                async with opsched.open_scheduler(device=device, streams=1) as sched:
                    call = getattr(sched, method)
                    alone = [await call(*args) for args in work]  # a launch each
                order = rng.permutation(len(work))
                async with opsched.open_scheduler(device=device, streams=4) as sched:
                    call = getattr(sched, method)
                    shuffled = await asyncio.gather(*(call(*work[i]) for i in order))
                for i, got in zip(order, shuffled, strict=True):
                    got = got if isinstance(got, tuple) else (got,)
                    want = alone[i] if isinstance(alone[i], tuple) else (alone[i],)
                    for a, b in zip(got, want, strict=True):
                        require(same_bits(a, b), f"{method} request {i} changed bits")
                    counted += 1
        return f"{counted} requests of rows 16-300, 1-6 rows each, alone then shuffled"

    check("batch invariance, all three operators, 4 streams", lambda: asyncio.run(invariance_all()))

    def stress() -> str:
        import io
        import tempfile

        from opsched.cli.stress import StressOptions, run_stress

        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as config:
            config.write("streams = 4\n")
        out = io.StringIO()
        requests = 2_000 if quick else 20_000
        status = run_stress(
            StressOptions(device=device, requests=requests, config=config.name), out
        )
        text = out.getvalue()
        require(status == 0 and "verdict: PASS" in text, text[-2000:])
        return f"{requests:,} mixed requests on 4 streams (cancellations included): PASS"

    check("a mixed stress run on 4 streams", stress)

    async def chains() -> str:
        g = opsched.Graph()
        x = g.input((4, 8, 8), np.float32, name="x")
        node = x
        for _ in range(7):  # each GroupNormalizationGrad's output feeds the next
            dy = tensor(4, 8, 8)
            node = g.group_norm_grad(node, dy, dy, tensor(4, 8), tensor(4, 8).abs() + 0.5)
        node = g.glu_backward(node, tensor(4, 8, 16))
        inputs = [tensor(4, 8, 8) for _ in range(16)]
        async with opsched.open_scheduler(device=device, streams=4) as sched:
            runs = await asyncio.gather(*(sched.run(g, [node], inputs={x: v}) for v in inputs))
            alone = [(await sched.run(g, [node], inputs={x: v}))[0] for v in inputs[:4]]
        for (got,), want in zip(runs, alone, strict=False):
            require(same_bits(got, want), "a graph chain's bits depend on its streams")
        return f"{len(inputs)} 8-node chains at once on 4 streams, the same bits as alone"

    check("graph chains across streams", lambda: asyncio.run(chains()))

    async def side_stream() -> str:
        if backend is None:
            return "the CPU has no streams: nothing to wait for"
        side = backend.Stream(device=target)
        base = tensor(512, 2048)
        with backend.stream(side):  # the caller works on its own stream
            g = base * 0.5  # still being written on `side` when submitted
            x = torch.cat([base, base.flip(0)], dim=1)
            async with opsched.open_scheduler(device=device, streams=2) as sched:
                got = await sched.glu_backward(g, x)
        backend.synchronize(target)
        require(torch.equal(got, t.glu_backward(g, x, -1)), "a side stream's input was read early")
        return "the launch waited for the caller's stream"

    check("inputs produced on a side stream", lambda: asyncio.run(side_stream()))

    async def lag() -> str:
        work = [(tensor(1024, 4096), tensor(1024, 8192)) for _ in range(16 if quick else 64)]
        lags: list[float] = []
        done = asyncio.Event()

        async def heartbeat() -> None:
            while not done.is_set():
                start = time.perf_counter()
                await asyncio.sleep(0.001)
                lags.append(time.perf_counter() - start - 0.001)

        async with opsched.open_scheduler(device=device, streams=2) as sched:
            beat = asyncio.create_task(heartbeat())
            await asyncio.gather(*(sched.glu_backward(g, x) for g, x in work))
            done.set()
            await beat
        worst = max(lags) * 1e3
        if not quick:  # (a timing: judged on the device, reported in the suite's quick run)
            require(worst < 100, f"the event loop stalled {worst:.1f} ms while launches ran")
        return f"max lag {worst:.2f} ms over {len(lags)} beats while {len(work)} launches ran"

    check("the event loop's lag while launches wait on the device", lambda: asyncio.run(lag()))

    async def memory() -> str:
        import gc

        if backend is None:
            return "the CPU has no framework allocator: torch's memory is malloc's"
        backend.synchronize(target)
        gc.collect()
        before = backend.memory_allocated(target)
        async with opsched.open_scheduler(device=device, streams=2) as sched:
            work = [(tensor(64, 256), tensor(64, 512)) for _ in range(256)]
            results = await asyncio.gather(*(sched.glu_backward(g, x) for g, x in work))
            stats = sched.memory_stats()
            pool = sched.statistics().pool
        require(stats.get("allocated_bytes.all.current", 0) > 0, f"no allocator figures: {stats}")
        del results, work
        backend.synchronize(target)
        gc.collect()
        leaked = backend.memory_allocated(target) - before
        require(leaked <= 0, f"{leaked:,} bytes still allocated after the scheduler closed")
        return f"reserved {pool.current:,} B while running; nothing leaked after close"

    check("allocator statistics, and no leak after close", lambda: asyncio.run(memory()))

    async def invariance() -> str:
        shapes = [(15, 602), (3, 8, 74), (15, 602), (2, 38)]
        work = [(tensor(*s[:-1], s[-1] // 2), tensor(*s)) for s in shapes * 24]
        alone = []
        async with opsched.open_scheduler(device=device, streams=1) as sched:
            for g, x in work:  # one at a time: each launch holds one request
                alone.append(await sched.glu_backward(g, x))
            order = np.random.default_rng(1).permutation(len(work))
            batched = await asyncio.gather(*(sched.glu_backward(*work[i]) for i in order))
            stats = sched.statistics()
        for i, got in zip(order, batched, strict=True):
            require(torch.equal(got, alone[i]), f"request {i} changed bits in a batch")
        return f"{len(work)} GLU requests alone and shuffled in {stats.launches} launches"

    check(
        "batch invariance: alone and in a shuffled batch, the same bits",
        lambda: asyncio.run(invariance()),
    )

    def numpy_in() -> str:
        g = rng.standard_normal((4, 8)).astype(np.float32)
        x = rng.standard_normal((4, 16)).astype(np.float32)
        with opsched.sync.open_scheduler(device=device) as sched:
            out = sched.glu_backward(g, x)
        want = t.from_torch(
            t.glu_backward(torch.from_numpy(g).to(target), torch.from_numpy(x).to(target), -1)
        )
        require(isinstance(out, np.ndarray), f"expected a numpy array, got {type(out)}")
        require(np.array_equal(out, want), "GluBackward through numpy differs")
        return "numpy in, numpy out, sync facade"

    check("numpy arrays through the sync facade", numpy_in)

    async def graph() -> str:
        x, dy, gamma = tensor(2, 4, 8), tensor(2, 4, 8), tensor(2, 4, 8)
        mean, rstd = tensor(2, 4), tensor(2, 4).abs() + 0.5
        gate = tensor(2, 4, 16)
        g = opsched.Graph()
        node = g.glu_backward(g.group_norm_grad(x, dy, gamma, mean, rstd), gate)
        async with opsched.open_scheduler(device=device, streams=2) as sched:
            (out,) = await sched.run(g, [node])
        want = t.glu_backward(t.group_norm_grad(x, dy, gamma, mean, rstd), gate, -1)
        require(torch.equal(out, want), "the graph's result differs")
        return "a two-node chain across streams"

    check("graph", lambda: asyncio.run(graph()))

    async def split() -> str:
        g, x = tensor(256, 2048), tensor(256, 4096)
        cfg = {"streams": 2, "fuse_max_bytes": 1 << 12, "split_min_bytes": 1 << 14}
        async with opsched.open_scheduler(device=device, **cfg) as sched:
            out = await sched.glu_backward(g, x)
            launches = sched.statistics().launches
        require(launches == 2, f"expected 2 launches, got {launches}")
        require(torch.allclose(out, t.glu_backward(g, x, -1)), "the split result differs")
        return f"{launches} parts"

    check("a large request split across streams", lambda: asyncio.run(split()))

    async def large_norm() -> str:
        r = (
            tensor(4, 64, 1024),
            tensor(4, 64, 1024),
            tensor(4, 16),
            tensor(4, 16).abs() + 0.5,
            tensor(64),
            4,
            64,
            1024,
            16,
        )
        async with opsched.open_scheduler(device=device, streams=2) as sched:
            got = await sched.group_norm_backward(*r)
        want = t.group_norm_backward(*r, [True] * 3)
        for name, a, b in zip(("dx", "dgamma", "dbeta"), got, want, strict=True):
            require(torch.equal(a, b), f"GroupNormBackward's {name} differs")
        return "262,144 elements: the framework's own call on its tensors, bit for bit"

    check("a large GroupNormBackward runs whole", lambda: asyncio.run(large_norm()))

    async def isolation() -> str:
        work = [(tensor(4, 8), tensor(4, 16)) for _ in range(10)]
        bad = work[3][1]
        async with opsched.open_scheduler(device=device, streams=1) as sched:
            sched.device.inject_faults(lambda rs: any(r.tensors["self"] is bad for r in rs))
            out = await asyncio.gather(
                *(sched.glu_backward(g, x) for g, x in work), return_exceptions=True
            )
        failed = [i for i, r in enumerate(out) if isinstance(r, Exception)]
        require(failed == [3], f"expected request 3 alone to fail, got {failed}")
        return "one injected fault fails its request only"

    check("error isolation", lambda: asyncio.run(isolation()))

    async def wrong_device() -> str:
        async with opsched.open_scheduler(device=device) as sched:
            try:
                await sched.glu_backward(torch.zeros(2, 2, device="meta"), torch.zeros(2, 4))
            except opsched.ParamInvalidError as exc:
                return str(exc)
        raise CheckFailed("a tensor on another device was accepted")

    check("a tensor on another device", lambda: asyncio.run(wrong_device()))

    def sync() -> None:  # wait for the queued kernels (torch.cuda, torch.npu)
        if target.type != "cpu":
            getattr(torch, target.type).synchronize()

    async def throughput() -> str:
        glu = [(tensor(8, 32), tensor(8, 64)) for _ in range(256)]
        gnb = [
            (
                tensor(4, 8, 64),
                tensor(4, 8, 64),
                tensor(4, 4),
                tensor(4, 4).abs() + 0.5,
                tensor(8),
                4,
                8,
                64,
                4,
            )
            for _ in range(256)
        ]
        cases = [
            ("GLU 8x64", glu, lambda a: t.glu_backward(a[0], a[1], -1), "glu_backward"),
            (
                "GroupNormBackward 4x8x64",
                gnb,
                lambda a: t.group_norm_backward(*a, [True] * 3),
                "group_norm_backward",
            ),
        ]
        rounds = 8
        lines = []
        async with opsched.open_scheduler(device=device, streams=2) as sched:
            for label, work, peer, method in cases:
                call = getattr(sched, method)

                def per_request(work: list[Any] = work, peer: Any = peer) -> float:
                    start = time.perf_counter()
                    for _ in range(rounds):
                        for args in work:
                            peer(args)
                    sync()
                    return time.perf_counter() - start

                async def scheduled(work: list[Any] = work, call: Any = call) -> float:
                    start = time.perf_counter()
                    for _ in range(rounds):
                        await asyncio.gather(*(call(*args) for args in work))
                    return time.perf_counter() - start

                await scheduled()  # warm up
                ratios = [per_request() / await scheduled() for _ in range(3)]
                lines.append(f"{label} {statistics.median(ratios):.2f}x")
        return (
            f"{'; '.join(lines)}: {256 * rounds} requests each, the scheduler against the "
            "framework's call once per request (median of 3; above 1.0x it is cheaper)"
        )

    check("throughput against per-request framework calls", lambda: asyncio.run(throughput()))

    for name, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}")
    passed = sum(ok for _, ok, _ in results)
    print(f"{device}: {passed} passed, {len(results) - passed} failed")
    return 0 if passed == len(results) else 1


def _arguments(argv: list[str]) -> tuple[str, bool]:
    parser = argparse.ArgumentParser(
        description="Check a torch device end to end; one line per check, exit 1 on any failure.",
    )
    parser.add_argument(
        "device",
        nargs="?",
        default="torch:cuda",
        help="torch:cuda[:N], torch:npu[:N] or torch:cpu (default: torch:cuda)",
    )
    parser.add_argument("--quick", action="store_true", help="smaller workloads (seconds)")
    parsed = parser.parse_args(argv)
    device: str = parsed.device
    if not device.startswith("torch:"):
        parser.error(
            f"device {device!r} is not a torch device; expected torch:cuda[:N], "
            "torch:npu[:N] or torch:cpu"
        )
    return device, parsed.quick


if __name__ == "__main__":
    sys.exit(main(*_arguments(sys.argv[1:])))
