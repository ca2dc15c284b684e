"""GroupNormalizationGrad kernels: the reference formula and a blocked fast kernel.

``x``, ``dy`` and ``gamma`` of shape ``(N, G, *rest)`` are viewed as ``(N * G, M)`` rows, one
row per group, with ``M = prod(rest)``. Per row, with ``xhat = (x - mean) * rstd``::

    s1 = sum(dy * gamma)
    s2 = sum(dy * gamma * xhat)
    dx = (rstd / M) * gamma * (M * dy - s1 - xhat * s2)

Determinism: a row's sums are taken in a fixed order that depends only on ``M``. A row of at
most :data:`CHUNK` elements is summed by one ``add.reduce`` over its contiguous float32 copy
(numpy's pairwise sum, which depends only on the length); a longer row is summed per
:data:`CHUNK`-element piece and the partial sums are then reduced in order. The tunable block
size only decides how many whole short rows share a tile, so it never changes a result, and
neither does batching a row with other requests' rows.

Memory traffic: short rows (the common case) are read once and written once. A row longer
than :data:`CHUNK` takes two passes (sums, then dx), reading its inputs twice.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ._common import (
    DEFAULT_BLOCK,
    Carver,
    as_compute,
    direct,
    overlaps,
    rows_view,
    staged,
    store,
    workspace_bytes,
)

__all__ = [
    "CHUNK",
    "GroupNormPlan",
    "group_norm_grad_fast",
    "group_norm_grad_reference",
    "group_norm_grad_rows",
    "make_group_norm_plan",
    "plan_group_norm_grad",
]

#: Elements of one reduction piece of a long row. A constant of the algorithm, not a tuning
#: knob: changing it changes the low bits of results for rows longer than it.
CHUNK = 65536


@np.errstate(all="ignore")  # NaN / Inf are computed through, as on the device
def group_norm_grad_reference(
    x: np.ndarray, dy: np.ndarray, gamma: np.ndarray, mean: np.ndarray, rstd: np.ndarray
) -> np.ndarray:
    """Return ``dx`` computed straight from the SPEC formula, in float32, rounded once."""
    ct = np.float32
    n, g = x.shape[:2]
    m = math.prod(x.shape[2:])
    x_, dy_, gamma_ = (np.asarray(t, dtype=ct).reshape(n, g, m) for t in (x, dy, gamma))
    mean_ = np.asarray(mean, dtype=ct)[..., None]
    rstd_ = np.asarray(rstd, dtype=ct)[..., None]
    xhat = (x_ - mean_) * rstd_
    s1 = np.sum(dy_ * gamma_, axis=-1, keepdims=True)
    s2 = np.sum(dy_ * gamma_ * xhat, axis=-1, keepdims=True)
    dx = (rstd_ / m) * gamma_ * (m * dy_ - s1 - xhat * s2)
    return dx.reshape(x.shape).astype(x.dtype)


class GroupNormPlan(NamedTuple):
    """The geometry and workspace layout of one GroupNormalizationGrad launch."""

    shape: tuple[int, ...]
    rows: int
    m: int
    dtype: np.dtype
    block: int
    stage_x: bool
    stage_dy: bool
    stage_gamma: bool
    stage_out: bool
    workspace_bytes: int

    @property
    def size(self) -> int:
        """Elements of ``x`` (0 for an empty launch)."""
        return self.rows * self.m


def tile_elements(rows: int, m: int, block: int) -> int:
    """Elements of the largest tile: whole rows for ``m <= CHUNK``, else one CHUNK."""
    if m > CHUNK:
        return CHUNK
    return min(rows, max(1, block // m)) * m


def row_buffers(rows: int, m: int, block: int) -> list[tuple[int, np.dtype]]:
    """The float32 buffers :func:`group_norm_grad_rows` carves, in carving order."""
    f32 = np.dtype(np.float32)
    parts = -(-m // CHUNK) if m > CHUNK else 0
    return [(rows, f32)] * 5 + [(parts, f32)] * 2 + [(tile_elements(rows, m, block), f32)] * 5


def plan_group_norm_grad(
    x: np.ndarray,
    dy: np.ndarray,
    gamma: np.ndarray,
    dx: np.ndarray,
    *,
    block: int = DEFAULT_BLOCK,
) -> GroupNormPlan:
    """Plan a launch on validated arguments: which operands to stage, workspace bytes."""
    shape2 = (x.shape[0] * x.shape[1], math.prod(x.shape[2:]))
    stage_x, stage_dy, stage_gamma = (rows_view(t, shape2) is None for t in (x, dy, gamma))
    return make_group_norm_plan(
        x.shape,
        x.dtype,
        stage_x=stage_x,
        stage_dy=stage_dy,
        stage_gamma=stage_gamma,
        stage_out=rows_view(dx, shape2) is None or overlaps(dx, x, dy, gamma),
        block=block,
    )


def make_group_norm_plan(
    shape: tuple[int, ...],
    dtype: np.dtype,
    *,
    stage_x: bool = False,
    stage_dy: bool = False,
    stage_gamma: bool = False,
    stage_out: bool = False,
    block: int = DEFAULT_BLOCK,
) -> GroupNormPlan:
    """Plan from geometry alone (e.g. for gathered, contiguous operands)."""
    rows = shape[0] * shape[1]
    m = math.prod(shape[2:])
    n = rows * m
    flags = (stage_x, stage_dy, stage_gamma, stage_out)
    copies = [(n if flag else 0, dtype) for flag in flags]
    nbytes = workspace_bytes(copies + row_buffers(rows, m, block)) if n else 0
    return GroupNormPlan(shape, rows, m, dtype, block, *flags, nbytes)


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
    shape2 = (rows, m)
    carve = Carver(workspace)
    x2, dy2, gamma2 = (
        staged(carve, t, flag, shape2)
        for t, flag in ((x, plan.stage_x), (dy, plan.stage_dy), (gamma, plan.stage_gamma))
    )
    if plan.stage_out:
        target = carve.take(rows * m, plan.dtype)
        dx2 = target.reshape(shape2)
    else:
        dx2 = dx.reshape(shape2)  # viewable: the plan checked
    bufs = [carve.take(count, dt) for count, dt in row_buffers(rows, m, plan.block)]
    group_norm_grad_rows(x2, dy2, gamma2, mean, rstd, dx2, bufs, plan.block)
    if plan.stage_out:
        np.copyto(dx, target.reshape(dx.shape))


@np.errstate(all="ignore")  # NaN / Inf are computed through, as on the device
def group_norm_grad_rows(
    x: np.ndarray,
    dy: np.ndarray,
    gamma: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    dx: np.ndarray,
    bufs: list[np.ndarray],
    block: int,
) -> None:
    """The blocked core on ``(rows, M)`` views; ``mean`` / ``rstd`` hold ``rows`` values.

    ``bufs`` are the float32 buffers of :func:`row_buffers`, in that order.
    """
    rows, m = x.shape
    mean32, rstd32, scale, s1, s2, p1, p2 = bufs[:7]
    np.copyto(mean32.reshape(mean.shape), mean, casting="unsafe")
    np.copyto(rstd32.reshape(rstd.shape), rstd, casting="unsafe")
    m32 = np.float32(m)
    np.divide(rstd32, m32, out=scale)  # rstd / M, the outer factor's first product
    if m <= CHUNK:
        step = max(1, block // m)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            t = _Tile(bufs, r0, r1, 0, m)
            t.load(x, dy, gamma, mean32, rstd32)
            np.add.reduce(t.pg, axis=1, out=s1[r0:r1])
            np.multiply(t.pg, t.xh, out=t.q)
            np.add.reduce(t.q, axis=1, out=s2[r0:r1])
            t.store(dx, s1, s2, scale, m32)
        return
    parts = -(-m // CHUNK)
    for r in range(rows):
        for k in range(parts):
            t = _Tile(bufs, r, r + 1, k * CHUNK, min(m, (k + 1) * CHUNK))
            t.load(x, dy, gamma, mean32, rstd32)
            p1[k] = np.add.reduce(t.pg, axis=None)
            np.multiply(t.pg, t.xh, out=t.q)
            p2[k] = np.add.reduce(t.q, axis=None)
        s1[r] = np.add.reduce(p1)
        s2[r] = np.add.reduce(p2)
        for k in range(parts):
            t = _Tile(bufs, r, r + 1, k * CHUNK, min(m, (k + 1) * CHUNK))
            t.load(x, dy, gamma, mean32, rstd32)
            t.store(dx, s1, s2, scale, m32)


class _Tile:
    """One tile ``[r0:r1, c0:c1]`` of the row grid and its float32 working buffers.

    Half-precision operands are cast into the buffers with ``copyto`` (no hidden scratch
    memory); float32 operands are read in place.
    """

    __slots__ = ("c0", "c1", "dy", "gamma", "gm", "pg", "q", "r0", "r1", "xh")

    def __init__(self, bufs: list[np.ndarray], r0: int, r1: int, c0: int, c1: int) -> None:
        self.r0, self.r1, self.c0, self.c1 = r0, r1, c0, c1
        shape = (r1 - r0, c1 - c0)
        n = shape[0] * shape[1]
        self.xh, self.pg, self.gm, self.q, dy_buf = (buf[:n].reshape(shape) for buf in bufs[7:])
        self.dy = self.gamma = dy_buf

    def load(
        self,
        x: np.ndarray,
        dy: np.ndarray,
        gamma: np.ndarray,
        mean32: np.ndarray,
        rstd32: np.ndarray,
    ) -> None:
        """Read the tile: ``pg = dy * gamma`` and ``xh = xhat`` (float32)."""
        r0, r1, c0, c1 = self.r0, self.r1, self.c0, self.c1
        self.gamma = as_compute(self.gm, gamma[r0:r1, c0:c1])
        self.dy = as_compute(self.dy, dy[r0:r1, c0:c1])
        np.multiply(self.dy, self.gamma, out=self.pg)
        np.subtract(as_compute(self.xh, x[r0:r1, c0:c1]), mean32[r0:r1, None], out=self.xh)
        np.multiply(self.xh, rstd32[r0:r1, None], out=self.xh)

    def store(
        self,
        dx: np.ndarray,
        s1: np.ndarray,
        s2: np.ndarray,
        scale: np.ndarray,
        m32: np.floating,
    ) -> None:
        """Write ``dx = ((rstd / M) * gamma) * ((M * dy - s1) - xhat * s2)`` for the tile."""
        r0, r1, c0, c1 = self.r0, self.r1, self.c0, self.c1
        np.multiply(self.xh, s2[r0:r1, None], out=self.xh)
        np.multiply(self.dy, m32, out=self.q)
        np.subtract(self.q, s1[r0:r1, None], out=self.q)
        np.subtract(self.q, self.xh, out=self.q)
        np.multiply(self.gamma, scale[r0:r1, None], out=self.gm)
        target = dx[r0:r1, c0:c1]
        if direct(target, self.q.dtype):
            np.multiply(self.gm, self.q, out=target)
        else:
            np.multiply(self.gm, self.q, out=self.q)
            store(target, self.q)
