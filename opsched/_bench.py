"""Benchmarks (not timed tests): the kernels against this machine's copy bandwidth.

Every figure is a ratio against a baseline measured in the same run, interleaved with it,
and summarised by the median over repeats, because the machines we run on are shared and
noisy. The baseline for a kernel is ``numpy.copyto`` moving the same number of bytes
(read + written) as the kernel: the practical memory limit of one core.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any, TextIO

import ml_dtypes
import numpy as np

from opsched import aclnn
from opsched._executor import Executor

__all__ = ["KERNEL_SIZES", "bench_kernels", "print_kernel_table"]

#: Element counts of ``self`` / ``x`` measured by default: 1K to 16M.
KERNEL_SIZES = (1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
_DTYPES = {"FLOAT": np.float32, "FLOAT16": np.float16, "BFLOAT16": ml_dtypes.bfloat16}


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _repeats(nbytes: int) -> int:
    """Enough repeats for a stable median without spending minutes on 16M elements."""
    return max(5, min(200, (64 << 20) // max(nbytes, 1)))


def _glu_case(n: int, dtype: Any, rng: np.random.Generator) -> dict[str, Any]:
    cols = min(n, 1024)
    x = rng.standard_normal((n // cols, cols)).astype(dtype)
    g = rng.standard_normal((n // cols, cols // 2)).astype(dtype)
    out = np.empty_like(x)
    size, ex = aclnn.glu_backward_get_workspace_size(g, x, -1, out)
    return {
        "op": "GluBackward",
        "shape": x.shape,
        "nbytes": x.nbytes + g.nbytes + out.nbytes,
        "executor": ex,
        "size": size,
        "launch": aclnn.glu_backward,
        "reference": lambda: ex.op.reference(ex.tensors, ex.scalars),
    }


def _gn_case(n: int, dtype: Any, rng: np.random.Generator) -> dict[str, Any]:
    m = min(n, 1024)
    groups = min(32, n // m)
    shape = (n // (groups * m), groups, m)
    x, dy, gamma = (rng.standard_normal(shape).astype(dtype) for _ in range(3))
    mean = rng.standard_normal(shape[:2]).astype(dtype)
    rstd = (rng.random(shape[:2]) + 0.5).astype(dtype)
    dx = np.empty_like(x)
    size, ex = aclnn.group_norm_grad_get_workspace_size(x, dy, gamma, mean, rstd, dx)
    return {
        "op": "GroupNormalizationGrad",
        "shape": shape,
        "nbytes": 4 * x.nbytes + mean.nbytes + rstd.nbytes,
        "executor": ex,
        "size": size,
        "launch": aclnn.group_norm_grad,
        "reference": lambda: ex.op.reference(ex.tensors, ex.scalars),
    }


def _measure(case: dict[str, Any]) -> dict[str, Any]:
    ex: Executor = case["executor"]
    ex.set_repeatable()
    size = case["size"]
    workspace = np.empty(size, np.uint8) if size else None
    launch = case["launch"]
    nbytes = case["nbytes"]
    src = np.ones(nbytes // 2, np.uint8)  # a copy reads and writes nbytes in all
    dst = np.empty_like(src)
    reps = _repeats(nbytes)
    launch(workspace, size, ex)  # warm up: page in out and the workspace
    np.copyto(dst, src)
    fast, copy, ratios = [], [], []
    for _ in range(reps):  # interleaved, so drift in machine load hits both alike
        t_copy = _timed(lambda: np.copyto(dst, src))
        t_fast = _timed(lambda: launch(workspace, size, ex))
        fast.append(t_fast)
        copy.append(t_copy)
        ratios.append(t_copy / t_fast)
    ref = [_timed(case["reference"]) for _ in range(max(3, reps // 10))]
    ex.destroy()
    t_fast = statistics.median(fast)
    return {
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
    ops: tuple[str, ...] = ("glu", "gn"),
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Measure the fast kernels; return one row per (operator, dtype, size)."""
    rng = np.random.default_rng(seed)
    builders = {"glu": _glu_case, "gn": _gn_case}
    rows = []
    for op in ops:
        for name in dtypes:
            for n in sizes:
                row = _measure(builders[op](n, _DTYPES[name], rng))
                row.update(dtype=name, elements=n)
                rows.append(row)
    return rows


def _human(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K"


def print_kernel_table(rows: list[dict[str, Any]], out: TextIO) -> None:
    """Print the rows as a table."""
    head = (
        f"{'operator':<24}{'dtype':<10}{'elements':>9}{'median':>11}{'GB/s':>8}"
        f"{'copy GB/s':>11}{'vs copy':>9}{'vs ref':>8}"
    )
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in rows:
        print(
            f"{r['op']:<24}{r['dtype']:<10}{_human(r['elements']):>9}"
            f"{r['fast_median_s'] * 1e3:>9.3f}ms{r['fast_gbps']:>8.2f}{r['copy_gbps']:>11.2f}"
            f"{r['ratio_to_copy']:>8.0%}{r['speedup_vs_reference']:>7.1f}x",
            file=out,
        )


def write_json(benchmark: str, result: Any, path: str) -> None:
    """Write a benchmark's result, named, to ``path`` (JSON)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"benchmark": benchmark, "result": result}, f, indent=2)
