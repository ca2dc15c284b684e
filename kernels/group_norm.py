"""GroupNormalizationGrad kernels: the reference formula and a compiled fast kernel.

``x``, ``dy`` and ``gamma`` of shape ``(N, G, *rest)`` are viewed as ``(N * G, M)`` rows, one
row per group, with ``M = prod(rest)``. Per row, with ``xhat = (x - mean) * rstd``::

    s1 = sum(dy * gamma)
    s2 = sum(dy * gamma * xhat)
    dx = (rstd / M) * gamma * (M * dy - s1 - xhat * s2)

Every dtype is computed in float32 and rounded once into ``dx``, by one compiled loop
(:mod:`._jit`) that takes a row at a time: pass 1 takes both sums, pass 2 writes
``dx = ((rstd / M) * gamma) * ((M * dy - s1) - xhat * s2)``, reading the row back from
cache when it fits.

Determinism: a row's sums are taken in :data:`._jit.LANES` lanes, in an order fixed by ``M``
alone (:func:`._jit.lane_sums` is the same order in numpy), so neither a row's position in
a launch nor batching it with other requests' rows changes a bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from . import _jit
from ._common import Carver, must_stage, overlaps, staged, workspace_bytes

__all__ = [
    "GroupNormPlan",
    "group_norm_grad_fast",
    "group_norm_grad_reference",
    "group_norm_grad_runner",
    "make_group_norm_plan",
    "plan_group_norm_grad",
]

F32 = np.dtype(np.float32)


@np.errstate(all="ignore")  # NaN / Inf are computed through, as on the device
def group_norm_grad_reference(
    x: np.ndarray, dy: np.ndarray, gamma: np.ndarray, mean: np.ndarray, rstd: np.ndarray
) -> np.ndarray:
    """Return ``dx`` straight from its formula (docs/operators.md), in float32, rounded once, with
    the fast kernel's order of additions (so the reference device gives its bits)."""
    ct = np.float32
    n, g = x.shape[:2]
    m = math.prod(x.shape[2:])
    x_, dy_, gamma_ = (np.asarray(t, dtype=ct).reshape(n, g, m) for t in (x, dy, gamma))
    mean_ = np.asarray(mean, dtype=ct)[..., None]
    rstd_ = np.asarray(rstd, dtype=ct)[..., None]
    xhat = (x_ - mean_) * rstd_
    pg = dy_ * gamma_
    s1 = _jit.lane_sums(pg.reshape(n * g, m)).reshape(n, g, 1)  # the fast kernel's order
    s2 = _jit.lane_sums((pg * xhat).reshape(n * g, m)).reshape(n, g, 1)
    dx = (rstd_ / m) * gamma_ * (m * dy_ - s1 - xhat * s2)
    return dx.reshape(x.shape).astype(x.dtype)


class GroupNormPlan(NamedTuple):
    """The geometry and workspace layout of one GroupNormalizationGrad launch."""

    shape: tuple[int, ...]
    rows: int
    m: int
    dtype: np.dtype
    stage_x: bool
    stage_dy: bool
    stage_gamma: bool
    stage_out: bool
    workspace_bytes: int

    @property
    def size(self) -> int:
        """Elements of ``x`` (0 for an empty launch)."""
        return self.rows * self.m


def plan_group_norm_grad(
    x: np.ndarray, dy: np.ndarray, gamma: np.ndarray, dx: np.ndarray
) -> GroupNormPlan:
    """Plan a launch on validated arguments: which operands to stage, workspace bytes."""
    shape2 = (x.shape[0] * x.shape[1], math.prod(x.shape[2:]))
    stage_x, stage_dy, stage_gamma = (must_stage(t, shape2, True) for t in (x, dy, gamma))
    return make_group_norm_plan(
        x.shape,
        x.dtype,
        stage_x=stage_x,
        stage_dy=stage_dy,
        stage_gamma=stage_gamma,
        stage_out=must_stage(dx, shape2, True) or overlaps(dx, x, dy, gamma),
    )


def make_group_norm_plan(
    shape: tuple[int, ...],
    dtype: np.dtype,
    *,
    stage_x: bool = False,
    stage_dy: bool = False,
    stage_gamma: bool = False,
    stage_out: bool = False,
) -> GroupNormPlan:
    """Plan from geometry alone (e.g. for gathered, contiguous operands)."""
    rows = shape[0] * shape[1]
    m = math.prod(shape[2:])
    n = rows * m
    flags = (stage_x, stage_dy, stage_gamma, stage_out)
    copies = [(n if flag else 0, dtype) for flag in flags]
    nbytes = workspace_bytes(copies + [(rows, F32)] * 2) if n else 0  # + mean, rstd
    return GroupNormPlan(shape, rows, m, dtype, *flags, nbytes)


def group_norm_grad_fast(
    plan: GroupNormPlan,
    x: np.ndarray,
    dy: np.ndarray,
    gamma: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    dx: np.ndarray,
    workspace: np.ndarray | None,
) -> None:
    """Compute GroupNormalizationGrad into ``dx`` using only ``workspace`` for scratch.

    Args:
        plan: from :func:`plan_group_norm_grad` on arrays of the same geometry, or from
            :func:`make_group_norm_plan` for more rows of the same M and layout (sizes are
            read from the arrays).
        x, dy, gamma, mean, rstd, dx: the operands (any strides).
        workspace: a ``uint8`` array of at least ``plan.workspace_bytes`` (None when 0).
    """
    rows, m = x.shape[0] * x.shape[1], math.prod(x.shape[2:])  # <= the plan's sizes
    if rows * m == 0:
        return
    kind = _jit.KINDS[plan.dtype]  # FLOAT, FLOAT16, BFLOAT16 (docs/operators.md)
    staging = plan.stage_x or plan.stage_dy or plan.stage_gamma or plan.stage_out
    carve: Carver | None = None
    if not staging and (
        x.flags.c_contiguous
        and dy.flags.c_contiguous
        and gamma.flags.c_contiguous
        and dx.flags.c_contiguous
    ):
        # the usual call: flat views, row stride m (no 2-D views, no stride lookups)
        xf, dyf = _jit.storage(x, kind), _jit.storage(dy, kind)
        gf, of = _jit.storage(gamma, kind), _jit.storage(dx, kind)
        xs = dys = gs = os_ = m
    else:
        shape2 = (rows, m)
        carve = Carver(workspace)
        x2 = staged(carve, x, plan.stage_x, shape2)
        dy2 = staged(carve, dy, plan.stage_dy, shape2)
        gamma2 = staged(carve, gamma, plan.stage_gamma, shape2)
        if plan.stage_out:
            target = carve.take(rows * m, plan.dtype)
            dx2 = target.reshape(shape2)
        else:
            dx2 = dx.reshape(shape2)  # viewable: the plan checked
        xf, xs = _jit.flat(x2, kind)
        dyf, dys = _jit.flat(dy2, kind)
        gf, gs = _jit.flat(gamma2, kind)
        of, os_ = _jit.flat(dx2, kind)
    stats = []
    for array in (mean, rstd):
        if (array.dtype is F32 or array.dtype == F32) and array.flags.c_contiguous:
            stats.append(array.ravel())  # a view: the array is C-contiguous
        else:  # converted into the workspace, after any staged operand
            carve = carve or Carver(workspace)
            copy = carve.take(rows, F32)
            np.copyto(copy.reshape(array.shape), array, casting="unsafe")
            stats.append(copy)
    _LOOPS[kind.name](xf, xs, dyf, dys, gf, gs, of, os_, stats[0], stats[1], rows, m)
    if plan.stage_out:
        np.copyto(dx, target.reshape(dx.shape))


def group_norm_grad_runner(
    plan: GroupNormPlan,
    x: np.ndarray,
    dy: np.ndarray,
    gamma: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    dx: np.ndarray,
) -> (
    Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], None] | None
):
    """The usual launch of ``plan`` with its layout checked once, on these arrays: a
    function ``run(x, dy, gamma, mean, rstd, dx)`` for every later call whose arrays have
    these shapes, dtypes and strides and whose output overlaps no input (it needs no
    workspace). None for any other launch: FLOAT16 and BFLOAT16 (their statistics are
    converted to float32 in the workspace), a staged operand, an operand that is not
    C-contiguous, or nothing to compute; those go through :func:`group_norm_grad_fast`,
    which checks the layout at every call.

    The same compiled body on the same values as :func:`group_norm_grad_fast`'s (so the
    same bits), through an entry point of eight arguments instead of twelve."""
    rows, m = x.shape[0] * x.shape[1], math.prod(x.shape[2:])
    if rows * m == 0 or plan.stage_x or plan.stage_dy or plan.stage_gamma or plan.stage_out:
        return None
    arrays = (x, dy, gamma, mean, rstd, dx)
    if any(a.dtype != F32 or not a.flags.c_contiguous for a in arrays):
        return None
    loop = _ROWS_LOOPS["float32"]

    def run(
        x: np.ndarray,
        dy: np.ndarray,
        gamma: np.ndarray,
        mean: np.ndarray,
        rstd: np.ndarray,
        dx: np.ndarray,
    ) -> None:
        loop(x.ravel(), dy.ravel(), gamma.ravel(), dx.ravel(), mean.ravel(), rstd.ravel(), rows, m)

    return run


@_jit.body
def _gn_body(x, xs, dy, dys, gamma, gs, dx, dxs, mean, rstd, rows, m, load, store):  # type: ignore[no-untyped-def]
    """The compiled GroupNormalizationGrad loop: row ``r`` of ``x`` / ``dy`` / ``gamma`` /
    ``dx`` is ``m`` elements at ``r * stride`` of its flat array; ``mean`` / ``rstd`` hold
    a float32 per row."""
    lanes = _jit.LANES
    full = m - m % lanes
    m32 = np.float32(m)
    for r in range(rows):
        mu, rs = mean[r], rstd[r]
        x_row = x[r * xs : r * xs + m]
        dy_row = dy[r * dys : r * dys + m]
        g_row = gamma[r * gs : r * gs + m]
        # pass 1: s1 = sum(dy * gamma), s2 = sum(dy * gamma * xhat)
        acc1, acc2 = _jit.lanes(), _jit.lanes()
        for i in range(0, full, lanes):
            x_part = x_row[i : i + lanes]
            dy_part = dy_row[i : i + lanes]
            g_part = g_row[i : i + lanes]
            for j in range(lanes):
                pg = load(dy_part[j]) * load(g_part[j])
                acc1[j] += pg
                acc2[j] += pg * ((load(x_part[j]) - mu) * rs)
        s1, s2 = _jit.folded(acc1, full), _jit.folded(acc2, full)
        for i in range(full, m):
            pg = load(dy_row[i]) * load(g_row[i])
            s1 += pg
            s2 += pg * ((load(x_row[i]) - mu) * rs)
        # pass 2
        scale = rs / m32
        dx_row = dx[r * dxs : r * dxs + m]
        for i in range(m):
            xhat = (load(x_row[i]) - mu) * rs
            q = (load(dy_row[i]) * m32 - s1) - xhat * s2
            dx_row[i] = store((load(g_row[i]) * scale) * q)


def _signature(storage: str) -> object:
    i8, inp, stats = _jit.I8, _jit.readonly(storage), _jit.readonly("float32")
    out = _jit.writeable(storage)
    # x, dy, gamma are read; dx written; mean and rstd read
    return _jit.void(inp, i8, inp, i8, inp, i8, out, i8, stats, stats, i8, i8)


def _gn_float32(x, xs, dy, dys, gamma, gs, dx, dxs, mean, rstd, rows, m):  # type: ignore[no-untyped-def]
    _gn_body(x, xs, dy, dys, gamma, gs, dx, dxs, mean, rstd, rows, m, _jit.same, _jit.same)


def _gn_float16(x, xs, dy, dys, gamma, gs, dx, dxs, mean, rstd, rows, m):  # type: ignore[no-untyped-def]
    _gn_body(
        x,
        xs,
        dy,
        dys,
        gamma,
        gs,
        dx,
        dxs,
        mean,
        rstd,
        rows,
        m,
        _jit.half_to_f32,
        _jit.f32_to_half,
    )


def _gn_bfloat16(x, xs, dy, dys, gamma, gs, dx, dxs, mean, rstd, rows, m):  # type: ignore[no-untyped-def]
    _gn_body(
        x,
        xs,
        dy,
        dys,
        gamma,
        gs,
        dx,
        dxs,
        mean,
        rstd,
        rows,
        m,
        _jit.bf16_to_f32,
        _jit.f32_to_bf16,
    )


#: The entry point of each storage kind (:data:`._jit.KINDS`), compiled on first use.
_LOOPS = _jit.Loops(
    {
        "float32": (_gn_float32, _signature("float32")),
        "float16": (_gn_float16, _signature("uint16")),
        "bfloat16": (_gn_bfloat16, _signature("uint16")),
    }
)


def _rows_signature(storage: str) -> object:
    inp, stats = _jit.readonly(storage), _jit.readonly("float32")
    # x, dy, gamma read; dx written; mean and rstd read; rows, m
    return _jit.void(inp, inp, inp, _jit.writeable(storage), stats, stats, _jit.I8, _jit.I8)


def _gn_rows_float32(x, dy, gamma, dx, mean, rstd, rows, m):  # type: ignore[no-untyped-def]
    """:func:`_gn_float32` on C-contiguous operands (every row ``m`` elements after the
    last): eight arguments instead of twelve, since numba types and converts each argument
    of every call."""
    _gn_body(x, m, dy, m, gamma, m, dx, m, mean, rstd, rows, m, _jit.same, _jit.same)


#: The usual launch's entry point (:func:`group_norm_grad_runner`: FLOAT requests only),
#: compiled on first use.
_ROWS_LOOPS = _jit.Loops({"float32": (_gn_rows_float32, _rows_signature("float32"))})
