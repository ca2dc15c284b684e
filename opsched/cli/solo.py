"""Each operator called alone through the two-phase API, into fresh outputs.

The oracle the demo checks the scheduler against (bit for bit): check, plan, workspace,
launch, for one request. One generic function serves every operator, from its description.
(The benchmarks' direct baseline is the leaner call a two-phase caller writes, with no
check of its own before ``get_workspace_size``: :func:`opsched.cli.bench_paths.two_phase_call`.)
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from opsched.devices.host.executor import Executor, get_workspace_size, launch
from opsched.ops import GLU_BACKWARD, GROUP_NORM_BACKWARD, GROUP_NORM_GRAD, Operator
from opsched.ops.products import product_named

__all__ = ["same_bits", "solo", "solo_glu", "solo_gn", "solo_gnb", "solo_workspace"]


def solo(op: Operator, *args: Any, product: str = "generic") -> Any:
    """``op`` on ``args`` (its parameters, in order) alone: its result in fresh arrays
    (a tuple for several outputs, None where not asked for)."""
    tensors, size, executor = _planned(op, args, product)
    launch(op, np.empty(size, np.uint8) if size else None, size, executor, None)
    return op.result(tensors)


def solo_workspace(op: Operator, *args: Any) -> int:
    """Bytes of workspace ``op`` on ``args`` needs launched alone (planned, not run)."""
    _, size, executor = _planned(op, args, "generic")
    executor.destroy()
    return size


def _planned(
    op: Operator, args: tuple[Any, ...], product: str
) -> tuple[dict[str, Any], int, Executor]:
    """Checked, outputs allocated, planned: ``(tensors, workspace size, executor)``."""
    tensors, scalars = op.arguments(args, None)
    checked = op.check_on(product_named(product), tensors, scalars, allocate=True)
    op.allocate(tensors, checked)
    size, executor = get_workspace_size(op, tensors, scalars, product)
    return tensors, size, executor


def same_bits(got: Any, want: Any) -> bool:
    """Bit-identical results: arrays of one dtype and shape whose every element has the
    same bits (compared as unsigned integers, so -0.0 differs from +0.0 and NaN payloads
    count), or tuples of such arrays and Nones."""
    if isinstance(want, tuple):
        return (
            isinstance(got, tuple)
            and len(got) == len(want)
            and all(
                (g is None and w is None) or (g is not None and w is not None and same_bits(g, w))
                for g, w in zip(got, want, strict=True)
            )
        )
    if not isinstance(got, np.ndarray) or got.dtype != want.dtype or got.shape != want.shape:
        return False
    bits = np.dtype(f"u{got.dtype.itemsize}")
    return bool(
        np.array_equal(np.ascontiguousarray(got).view(bits), np.ascontiguousarray(want).view(bits))
    )


#: GluBackward of one request: ``solo_glu(grad_out, x, dim)``.
solo_glu = functools.partial(solo, GLU_BACKWARD)
#: GroupNormalizationGrad of one request: ``solo_gn(x, dy, gamma, mean, rstd)``.
solo_gn = functools.partial(solo, GROUP_NORM_GRAD)
#: GroupNormBackward of one request: ``(dx, dgamma, dbeta)``.
solo_gnb = functools.partial(solo, GROUP_NORM_BACKWARD)
