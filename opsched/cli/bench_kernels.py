"""Benchmarks (not timed tests): the kernels against this machine's copy bandwidth.

Every figure is a ratio against a baseline measured in the same run, interleaved with it,
and summarised by the median over repeats, because the machines we run on are shared and
noisy. The baseline for a kernel is ``numpy.copyto`` moving the same number of bytes
(read + written) as the kernel: the practical memory limit of one core. Where torch is
installed, its own CPU operator (single-threaded, like our kernels) is the peer column.
Where the operator writes into a given output in place (GluBackward's ``grad_input``
variant; GroupNormalizationGrad's torch formula), the peer writes into one made once, as
our launches write into the ``out`` arrays given to the two-phase call: a new output a
call would time the allocator's fresh pages (a 64 MB output was new memory, page by page,
at every call on this machine), not the kernel. GroupNormBackward's ``out`` variant
computes new tensors and copies them, so its peer is the plain call, new output and all.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any, TextIO

import attrs
import ml_dtypes
import numpy as np

import opsched
from opsched import Executor, SchedulerConfig, aclnn
from opsched.devices.host.launchers import launcher_of
from opsched.devices.torch import aten as _aten

__all__ = [
    "KERNEL_DTYPES",
    "KERNEL_SIZES",
    "BenchTarget",
    "bench_kernels",
    "print_kernel_table",
    "torch_peer",
    "write_json",
]


@attrs.frozen
class BenchTarget:
    """Where the scheduler benchmarks run: the device, the config, an optional trace."""

    device: str = "cpu"
    config: SchedulerConfig | None = None

    def open(self, trace: str | None = None, **overrides: Any) -> Any:
        """``opsched.open_scheduler`` for this target (``overrides``: config fields)."""
        return opsched.open_scheduler(self.config, device=self.device, trace=trace, **overrides)


def torch_peer() -> Any:
    """torch, set to one thread for a fair peer column, or None when not installed."""
    if not _aten.torch_available():
        return None
    import torch

    torch.set_num_threads(1)
    return torch


#: Element counts of ``self`` / ``x`` measured by default: 1K to 16M.
KERNEL_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
_DTYPES = {"FLOAT": np.float32, "FLOAT16": np.float16, "BFLOAT16": ml_dtypes.bfloat16}
#: The dtype names the kernel benchmark takes.
KERNEL_DTYPES = tuple(_DTYPES)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


#: Rounds of each interleaved loop run first and not counted (see :func:`_measure`).
_WARM_ROUNDS = 8


def _repeats(nbytes: int, least: int = 1) -> int:
    """Enough repeats for a stable median without spending minutes on 16M elements (at
    least 9, and at least ``least``)."""
    return max(9, least, min(200, (64 << 20) // max(nbytes, 1)))


def _glu_case(n: int, dtype: Any, rng: np.random.Generator, torch: Any) -> dict[str, Any]:
    cols = min(n, 1024)
    x = rng.standard_normal((n // cols, cols)).astype(dtype)
    g = rng.standard_normal((n // cols, cols // 2)).astype(dtype)
    out = np.empty_like(x)
    size, ex = aclnn.glu_backward_get_workspace_size(g, x, -1, out)
    peer = None
    if torch is not None:
        tg, tx = _aten.to_torch(g), _aten.to_torch(x)
        t_out = torch.empty_like(tx)

        def peer() -> None:
            _aten.glu_backward(tg, tx, -1, out=t_out)

    return {
        "peer": peer,
        "op": "GluBackward",
        "shape": x.shape,
        "nbytes": x.nbytes + g.nbytes + out.nbytes,
        "executor": ex,
        "size": size,
        "launch": aclnn.glu_backward,
        "reference": lambda: launcher_of(ex.op.name).reference(ex.tensors, ex.scalars),
    }


def _gn_case(n: int, dtype: Any, rng: np.random.Generator, torch: Any) -> dict[str, Any]:
    m = min(n, 1024)
    groups = min(32, n // m)
    shape = (n // (groups * m), groups, m)
    x, dy, gamma = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
    mean = rng.standard_normal(shape[:2]).astype(dtype)
    rstd = (rng.random(shape[:2]) + 0.5).astype(dtype)
    dx = np.empty_like(x)
    size, ex = aclnn.group_norm_grad_get_workspace_size(x, dy, gamma, mean, rstd, dx)
    peer = None
    if torch is not None:
        tensors = [_aten.to_torch(a) for a in (x, dy, gamma, mean, rstd)]
        t_dx = torch.empty_like(tensors[0])

        def peer() -> None:
            _aten.group_norm_grad(*tensors, out=t_dx)

    return {
        "peer": peer,
        "op": "GroupNormalizationGrad",
        "shape": shape,
        "nbytes": 4 * x.nbytes + mean.nbytes + rstd.nbytes,
        "executor": ex,
        "size": size,
        "launch": aclnn.group_norm_grad,
        "reference": lambda: launcher_of(ex.op.name).reference(ex.tensors, ex.scalars),
    }


def _gnb_case(n: int, dtype: Any, rng: np.random.Generator, torch: Any) -> dict[str, Any]:
    # a training geometry: N=8, C=64, 16 groups; HxW makes up the size
    batch, c, group = 8, 64, 16
    hxw = max(1, n // (batch * c))
    x, dy = (rng.standard_normal((batch, c, hxw)).astype(dtype) for _ in range(2))
    mean = rng.standard_normal((batch, group)).astype(dtype)
    rstd = (rng.random((batch, group)) + 0.5).astype(dtype)
    gamma = rng.standard_normal(c).astype(dtype)
    dx, dgamma, dbeta = np.empty_like(x), np.empty(c, dtype), np.empty(c, dtype)
    mask = (True, True, True)
    args = (dy, x, mean, rstd, gamma, batch, c, hxw, group)
    size, ex = aclnn.group_norm_backward_get_workspace_size(*args, mask, dx, dgamma, dbeta)
    peer = None
    if torch is not None:
        t_dy, t_x, t_mean, t_rstd, t_gamma = (_aten.to_torch(a) for a in args[:5])

        def peer() -> None:  # (aten's out variant computes new tensors and copies them)
            _aten.group_norm_backward(
                t_dy, t_x, t_mean, t_rstd, t_gamma, batch, c, hxw, group, mask
            )

    return {
        "peer": peer,
        "op": "GroupNormBackward",
        "shape": x.shape,
        "nbytes": 3 * x.nbytes,  # reads x and dy, writes dx
        "executor": ex,
        "size": size,
        "launch": aclnn.group_norm_backward,
        "reference": lambda: launcher_of(ex.op.name).reference(ex.tensors, ex.scalars),
    }


def _measure(case: dict[str, Any], least: int = 1) -> dict[str, Any]:
    """One row: our kernel against a copy of its bytes, then against torch's operator,
    each pair interleaved; the float64 reference last.

    Each interleaved loop starts with :data:`_WARM_ROUNDS` rounds of both sides that are not
    counted: what ran before (the previous loop, the copies) leaves the caches holding
    other bytes, and a working set that fits in the last-level cache takes several launches
    to get back into it. On our Zen 3 machine, whose L3 is filled by what L2 evicts, a 1M
    GroupNormBackward took 0.64, 0.53, 0.49, 0.44 ... 0.41 ms in the first launches after
    the copies (9 counted repeats: the median fell in that recovery, 1.10-1.19x torch;
    after 8 warm rounds, 1.19-1.38x in five runs). The reference runs last for the same
    reason: its float64 temporaries evict everything.
    """
    ex: Executor = case["executor"]
    ex.set_repeatable()
    size = case["size"]
    workspace = np.empty(size, np.uint8) if size else None
    launch = case["launch"]
    nbytes = case["nbytes"]
    src = np.ones(nbytes // 2, np.uint8)  # a copy reads and writes nbytes in all
    dst = np.empty_like(src)
    reps = _repeats(nbytes, least)
    fast, copy, ratios = [], [], []
    for i in range(_WARM_ROUNDS + reps):  # interleaved: drift in machine load hits both
        t_copy = _timed(lambda: np.copyto(dst, src))
        t_fast = _timed(lambda: launch(workspace, size, ex))
        if i >= _WARM_ROUNDS:
            fast.append(t_fast)
            copy.append(t_copy)
            ratios.append(t_copy / t_fast)
    t_fast = statistics.median(fast)
    peer: dict[str, Any] = {}
    if case["peer"] is not None:
        peer_times, peer_ratios = [], []
        for i in range(_WARM_ROUNDS + reps):  # interleaved with our kernel, like the copy
            t_peer = _timed(case["peer"])
            t_ours = _timed(lambda: launch(workspace, size, ex))
            if i >= _WARM_ROUNDS:
                peer_times.append(t_peer)
                peer_ratios.append(t_peer / t_ours)
        peer = {
            "torch_gbps": nbytes / statistics.median(peer_times) / 1e9,
            "speedup_vs_torch": statistics.median(peer_ratios),
        }
    ref = [_timed(case["reference"]) for _ in range(max(3, reps // 10))]
    ex.destroy()
    return {
        **peer,
        "op": case["op"],
        "shape": list(case["shape"]),
        "bytes": nbytes,
        "repeats": reps,
        "fast_median_s": t_fast,
        "fast_gbps": nbytes / t_fast / 1e9,
        "copy_gbps": nbytes / statistics.median(copy) / 1e9,
        "ratio_to_copy": statistics.median(ratios),
        "speedup_vs_reference": statistics.median(ref) / t_fast,
    }


def bench_kernels(
    sizes: tuple[int, ...] = KERNEL_SIZES,
    dtypes: tuple[str, ...] = tuple(_DTYPES),
    ops: tuple[str, ...] = ("glu", "gn", "gnb"),
    seed: int = 0,
    repeats: int = 1,
) -> list[dict[str, Any]]:
    """Measure the fast kernels; return one row per (operator, dtype, size), each the
    median of interleaved repeats (at least ``repeats``; more for small sizes)."""
    rng = np.random.default_rng(seed)
    builders = {"glu": _glu_case, "gn": _gn_case, "gnb": _gnb_case}
    torch = torch_peer()
    rows = []
    for op in ops:
        for name in dtypes:
            for n in sizes:
                row = _measure(builders[op](n, _DTYPES[name], rng, torch), repeats)
                row.update(dtype=name, elements=n)
                rows.append(row)
    return rows


def _human(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


def print_kernel_table(rows: list[dict[str, Any]], out: TextIO) -> None:
    """Print the rows as a table: each kernel against a copy of the same bytes, the
    reference kernel and (where torch is installed) torch's operator."""
    peer = bool(rows) and "speedup_vs_torch" in rows[0]
    head = (
        f"{'operator':<24}{'dtype':<10}{'elements':>9}{'median':>11}{'GB/s':>8}"
        f"{'copy GB/s':>11}{'vs copy':>9}{'vs ref':>8}"
    ) + (f"{'torch GB/s':>12}{'vs torch':>10}" if peer else "")
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in rows:
        print(
            f"{r['op']:<24}{r['dtype']:<10}{_human(r['elements']):>9}"
            f"{r['fast_median_s'] * 1e3:>9.3f}ms{r['fast_gbps']:>8.2f}{r['copy_gbps']:>11.2f}"
            f"{r['ratio_to_copy']:>8.0%}{r['speedup_vs_reference']:>7.1f}x"
            + (f"{r['torch_gbps']:>12.2f}{r['speedup_vs_torch']:>9.2f}x" if peer else ""),
            file=out,
        )


#: Bumped when the layout of the result file changes.
RESULT_SCHEMA_VERSION = 1


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }
    if _aten.torch_available():
        import torch

        info["torch"] = torch.__version__
    return info


def write_json(
    benchmark: str, results: dict[str, Any], path: str, command: str | None = None
) -> None:
    """Write benchmark results (benchmark name -> its result) to ``path`` as JSON, with the
    command that produced them (``command``) when given."""
    document: dict[str, Any] = {
        "schema": RESULT_SCHEMA_VERSION,
        "benchmark": benchmark,
        "machine": machine(),
        "results": results,
    }
    if command is not None:
        document["command"] = command
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2)
