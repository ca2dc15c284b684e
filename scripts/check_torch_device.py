"""Check a torch device end to end: the short script to run where an accelerator is lent.

    python scripts/check_torch_device.py torch:cuda        # or torch:npu:0, torch:cpu

For each operator it submits many requests at once (tensors on the device and numpy
arrays), and checks each result bit for bit against the framework's own call on that request
alone; then a graph, the sync facade, a split request, a large GroupNormBackward (the
framework's own call), fault isolation, a tensor on the wrong device, and the throughput
of tiny requests against the framework's call once per request.
Prints one line per check and exits 1 if any failed. Checks raise :class:`CheckFailed`, never
a bare ``assert`` (``python -O`` would remove those, and a broken device would pass).
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
from opsched.devices import torch_ops as t


class CheckFailed(Exception):
    """A check found the device wrong."""


def require(condition: object, message: str) -> None:
    """Raise CheckFailed(message) unless ``condition`` holds (kept under ``python -O``)."""
    if not condition:
        raise CheckFailed(message)


def main(device: str) -> int:
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
        gn = [(tensor(4, 8, 16), tensor(4, 8, 16), tensor(4, 8, 16), tensor(4, 8),
               tensor(4, 8).abs() + 0.5) for _ in range(32)]  # fmt: skip
        gnb = [(tensor(3, 8, 5), tensor(3, 8, 5), tensor(3, 4), tensor(3, 4).abs() + 0.5,
                tensor(8), 3, 8, 5, 4) for _ in range(32)]  # fmt: skip
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
        want = t.from_torch(t.glu_backward(torch.from_numpy(g).to(target),
                                           torch.from_numpy(x).to(target), -1))  # fmt: skip
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
        r = (tensor(4, 64, 1024), tensor(4, 64, 1024), tensor(4, 16), tensor(4, 16).abs() + 0.5,
             tensor(64), 4, 64, 1024, 16)  # fmt: skip
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
        gnb = [(tensor(4, 8, 64), tensor(4, 8, 64), tensor(4, 4), tensor(4, 4).abs() + 0.5,
                tensor(8), 4, 8, 64, 4) for _ in range(256)]  # fmt: skip
        cases = [
            ("GLU 8x64", glu, lambda a: t.glu_backward(a[0], a[1], -1), "glu_backward"),
            ("GroupNormBackward 4x8x64", gnb, lambda a: t.group_norm_backward(*a, [True] * 3),
             "group_norm_backward"),
        ]  # fmt: skip
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
    return 0 if all(ok for _, ok, _ in results) else 1


def _arguments(argv: list[str]) -> str:
    parser = argparse.ArgumentParser(
        description="Check a torch device end to end; one line per check, exit 1 on any failure.",
    )
    parser.add_argument(
        "device", nargs="?", default="torch:cuda",
        help="torch:cuda[:N], torch:npu[:N] or torch:cpu (default: torch:cuda)",
    )  # fmt: skip
    device: str = parser.parse_args(argv).device
    if not device.startswith("torch:"):
        parser.error(f"device {device!r} is not a torch device; expected torch:cuda[:N], "
                     "torch:npu[:N] or torch:cpu")  # fmt: skip
    return device


if __name__ == "__main__":
    sys.exit(main(_arguments(sys.argv[1:])))
