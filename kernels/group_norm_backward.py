"""GroupNormBackward kernels: the true gradient of group norm, with dgamma and dbeta.

For ``N`` samples of ``C`` channels of ``HxW`` elements in ``group`` groups (``cpg = C /
group`` channels each, ``M = cpg * HxW`` elements per group), per ``(n, g)``, with
``xhat = (x - mean) * rstd`` and, for each channel ``c`` of the group,
``ds_c = sum_HxW dy`` and ``db_c = sum_HxW dy * xhat``:

    c1 = sum_c gamma_c * ds_c / M        c2 = sum_c gamma_c * db_c / M
    dx = rstd * (gamma_c * dy - c1 - c2 * xhat)
    dbeta_c = sum_n ds_c                 dgamma_c = sum_n db_c

Everything is computed in float32 and rounded once into the outputs.

Determinism. The kernel works on "channel rows" (one channel of one sample: ``HxW``
elements). Each channel row is reduced by one ``add.reduce`` over a contiguous float32
buffer when ``HxW <= CHUNK``, else per CHUNK with the partials added in order, so ``ds`` and
``db`` never depend on tiling, position or what a launch was fused with. ``dgamma`` and
``dbeta`` then add the per-sample rows ``n = 0, 1, ..., N - 1`` in that order
(:func:`reduce_over_samples`), for a request alone or inside a fused launch alike.
"""

from __future__ import annotations

from collections.abc import Iterator
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
    "GnbPlan",
    "group_norm_backward_fast",
    "group_norm_backward_reference",
    "group_norm_backward_rows_reference",
    "make_gnb_plan",
    "plan_group_norm_backward",
    "reduce_over_samples",
]

#: Channel rows longer than this are reduced per CHUNK, the partials added in order.
CHUNK = 65536

F32 = np.dtype(np.float32)


def group_norm_backward_rows_reference(
    grad_out: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    gamma_rows: np.ndarray | None,
    rows: int,
    cpg: int,
    hxw: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The formula on ``rows`` (n, g) rows of ``cpg`` channels of ``hxw`` elements, float32,
    in plain numpy (whole arrays, no workspace), in the fast kernel's order of operations.

    ``gamma_rows``: ``rows * cpg`` values (gamma per row and channel), or None for ones.
    Returns ``dx`` as ``(rows * cpg, hxw)`` in ``grad_out``'s dtype, and ``ds``, ``db`` per
    channel row (float32, ``rows * cpg``).
    """
    dy = np.asarray(grad_out, F32).reshape(rows, cpg, hxw)
    xx = np.asarray(x, F32).reshape(rows, cpg, hxw)
    mu = np.asarray(mean, F32).reshape(rows, 1)
    rs = np.asarray(rstd, F32).reshape(rows, 1)
    g = np.ones((rows, cpg), F32) if gamma_rows is None else np.asarray(gamma_rows, F32)
    g = g.reshape(rows, cpg)
    with np.errstate(all="ignore"):
        ds = np.add.reduce(dy, axis=-1)  # (rows, cpg)
        db = (np.add.reduce(dy * xx, axis=-1) - mu * ds) * rs
        m = np.float32(cpg * hxw)
        c1 = np.add.reduce(g * ds, axis=-1, keepdims=True) / m
        c2 = np.add.reduce(g * db, axis=-1, keepdims=True) / m
        coef_a = rs * g
        coef_b = -(c2 * rs * rs)
        coef_c = (c2 * rs * mu - c1) * rs
        dx = (dy * coef_a[..., None] + xx * coef_b[..., None]) + coef_c[..., None]
    return (
        dx.reshape(rows * cpg, hxw).astype(grad_out.dtype),
        ds.reshape(rows * cpg),
        db.reshape(rows * cpg),
    )


def group_norm_backward_reference(
    grad_out: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    gamma: np.ndarray | None,
    n: int,
    c: int,
    hxw: int,
    group: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dx, dgamma, dbeta)`` straight from the formula, float32, in ``grad_out``'s dtype
    (``dx`` shaped as ``x``, the others ``(C,)``)."""
    cpg = c // group
    rows_gamma = None
    if gamma is not None:
        rows_gamma = np.broadcast_to(np.reshape(gamma, (1, group, cpg)), (n, group, cpg))
    dx, ds, db = group_norm_backward_rows_reference(
        grad_out, x, mean, rstd, rows_gamma, n * group, cpg, hxw
    )
    stat_dtype = np.asarray(mean).dtype  # grad_out's, or FLOAT statistics
    dgamma, dbeta = np.empty(c, stat_dtype), np.empty(c, stat_dtype)
    reduce_over_samples(db, n, c, dgamma)
    reduce_over_samples(ds, n, c, dbeta)
    return dx.reshape(x.shape), dgamma, dbeta


class GnbPlan(NamedTuple):
    """The geometry and workspace layout of one GroupNormBackward launch.

    ``rows`` is ``N * group``; ``cpg`` channels of ``hxw`` elements per row. ``row_gamma``:
    gamma is given per row, ``(rows, cpg)`` (a fused launch), not per channel ``(C,)``.
    ``stats_out``: ``ds`` / ``db`` are written to caller arrays (a fused launch reduces them
    per request afterwards) instead of workspace buffers reduced into dgamma / dbeta here.
    """

    n: int
    c: int
    hxw: int
    group: int
    dtype: np.dtype
    want_dx: bool
    want_dgamma: bool
    want_dbeta: bool
    has_gamma: bool
    row_gamma: bool
    stats_out: bool
    stage_x: bool
    stage_dy: bool
    stage_dx: bool
    block: int
    workspace_bytes: int

    @property
    def rows(self) -> int:
        """``N * group``."""
        return self.n * self.group

    @property
    def cpg(self) -> int:
        """Channels per group."""
        return self.c // self.group


def _tile_rows(hxw: int, block: int) -> int:
    """Channel rows per tile: as many whole rows as fit ``block``; 1 for long rows."""
    return max(1, block // max(hxw, 1)) if hxw <= CHUNK else 1


def _buffers(
    channel_rows: int, rows: int, cpg: int, hxw: int, block: int, stats_in_workspace: bool
) -> list[tuple[int, np.dtype]]:
    """The float32 buffers the kernel carves, in carving order."""
    per_row = [(rows, F32)] * 4  # mean, rstd, c1, c2
    # gamma, mean, rstd, sum(dy * x), and the coefficients A, B, C of dx, per channel row
    per_channel_row = [(channel_rows, F32)] * 7
    stats = [(channel_rows, F32)] * 2 if stats_in_workspace else []
    parts = -(-hxw // CHUNK) if hxw > CHUNK else 0
    tile = min(channel_rows, _tile_rows(hxw, block)) * min(hxw, CHUNK)
    return (
        per_row + per_channel_row + stats + [(rows * cpg, F32)] + [(parts, F32)] * 2
        + [(tile, F32)] * 4
    )  # fmt: skip


def make_gnb_plan(
    n: int,
    c: int,
    hxw: int,
    group: int,
    dtype: np.dtype,
    mask: tuple[bool, bool, bool],
    *,
    has_gamma: bool,
    row_gamma: bool = False,
    stats_out: bool = False,
    stage_x: bool = False,
    stage_dy: bool = False,
    stage_dx: bool = False,
    block: int = DEFAULT_BLOCK,
) -> GnbPlan:
    """Plan a launch from its geometry; count the workspace it carves."""
    rows, cpg = n * group, c // group
    channel_rows = n * c
    size = channel_rows * hxw
    copies = [(size if stage_x else 0, dtype), (size if stage_dy else 0, dtype)]
    copies.append((size if stage_dx and mask[0] else 0, dtype))
    bufs = _buffers(channel_rows, rows, cpg, hxw, block, not stats_out)
    nbytes = workspace_bytes(copies + bufs) if channel_rows and hxw else 0
    return GnbPlan(
        n, c, hxw, group, np.dtype(dtype), *mask, has_gamma, row_gamma, stats_out,
        stage_x, stage_dy, stage_dx, block, nbytes,
    )  # fmt: skip


def reduce_over_samples(stats: np.ndarray, n: int, c: int, out: np.ndarray) -> None:
    """``out[c] = sum over n of stats[n, c]``, adding samples in order ``0, 1, ..., n-1``.

    ``stats``: ``n * c`` float32 values, sample-major. ``out``: ``(C,)``-sized (any shape
    of C elements), rounded once into its dtype.
    """
    rows = stats.reshape(n, c)
    if n == 0:
        out[...] = 0
        return
    if out.dtype == F32 and out.flags.c_contiguous:
        acc = out.reshape(c)
        np.copyto(acc, rows[0])
        for i in range(1, n):
            np.add(acc, rows[i], out=acc)
        return
    # accumulate in the first row of the caller's float32 stats, then round once
    acc = rows[0]
    for i in range(1, n):
        np.add(acc, rows[i], out=acc)
    store(out.reshape(c), acc)


@np.errstate(all="ignore")  # NaN / Inf are computed through, as on the device
def group_norm_backward_fast(
    plan: GnbPlan,
    grad_out: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    gamma: np.ndarray | None,
    dx: np.ndarray | None,
    dgamma: np.ndarray | None,
    dbeta: np.ndarray | None,
    workspace: np.ndarray | None,
    *,
    ds_out: np.ndarray | None = None,
    db_out: np.ndarray | None = None,
) -> None:
    """Compute GroupNormBackward using only ``workspace`` for scratch.

    Sizes are read from the arrays (a fused launch runs the prefix of a larger plan):
    ``N = mean.size // group``. With ``plan.row_gamma`` gamma is ``(rows, cpg)``; with
    ``plan.stats_out`` the per-channel-row sums go to ``ds_out`` / ``db_out`` (float32,
    ``N * C``) and dgamma / dbeta are not written here.

    Two passes over the data, as the device kernel: the first sums ``dy`` and ``dy * x``
    per channel row (``db = rstd * (sum(dy * x) - mean * ds)``); the second writes
    ``dx = A * dy + B * x + C`` with per-channel-row coefficients ``A = rstd * gamma``,
    ``B = -rstd**2 * c2``, ``C = rstd * (rstd * c2 * mean - c1)``.
    """
    group, cpg, hxw = plan.group, plan.cpg, plan.hxw
    rows = mean.size
    n = rows // group
    c = plan.c
    channel_rows = n * c
    if channel_rows == 0 or hxw == 0:
        for out in (dgamma, dbeta, ds_out, db_out):
            if out is not None:
                out[...] = 0
        return
    carve = Carver(workspace)
    shape2 = (channel_rows, hxw)
    x2 = staged(carve, x, plan.stage_x, shape2)
    dy2 = staged(carve, grad_out, plan.stage_dy, shape2)
    dx_target = None
    if plan.want_dx and plan.stage_dx:
        dx_target = carve.take(channel_rows * hxw, plan.dtype)
    mean32, rstd32, c1, c2 = (carve.take(rows, F32) for _ in range(4))
    gamma_cr, mean_cr, rstd_cr, sxy, coef_a, coef_b, coef_c = (
        carve.take(channel_rows, F32) for _ in range(7)
    )
    if plan.stats_out:
        assert ds_out is not None and db_out is not None
        ds, db = ds_out.reshape(channel_rows), db_out.reshape(channel_rows)
    else:
        ds, db = carve.take(channel_rows, F32), carve.take(channel_rows, F32)
    prod = carve.take(rows * cpg, F32).reshape(rows, cpg)
    parts = -(-hxw // CHUNK) if hxw > CHUNK else 0
    p1, p2 = carve.take(parts, F32), carve.take(parts, F32)
    tile = min(channel_rows, _tile_rows(hxw, plan.block)) * min(hxw, CHUNK)
    x_buf, dy_buf, q_buf, t_buf = (carve.take(tile, F32) for _ in range(4))

    np.copyto(mean32.reshape(mean.shape), mean, casting="unsafe")
    np.copyto(rstd32.reshape(rstd.shape), rstd, casting="unsafe")
    np.copyto(mean_cr.reshape(rows, cpg), mean32[:, None])
    np.copyto(rstd_cr.reshape(rows, cpg), rstd32[:, None])
    g3 = gamma_cr.reshape(n, group, cpg)
    if gamma is None:
        g3[...] = 1
    elif plan.row_gamma:
        np.copyto(g3, gamma.reshape(n, group, cpg), casting="unsafe")
    else:
        np.copyto(g3, gamma.reshape(1, group, cpg), casting="unsafe")

    # Pass 1: ds = sum(dy), sxy = sum(dy * x) per channel row.
    for k0, k1, h0, h1, part in _tiles(channel_rows, hxw, plan.block):
        xt, dyt = _load(x2, dy2, k0, k1, h0, h1, x_buf, dy_buf)
        q = q_buf[: xt.size].reshape(xt.shape)
        np.multiply(dyt, xt, out=q)
        if part < 0:
            np.add.reduce(dyt, axis=1, out=ds[k0:k1])
            np.add.reduce(q, axis=1, out=sxy[k0:k1])
        else:
            p1[part] = np.add.reduce(dyt, axis=None)
            p2[part] = np.add.reduce(q, axis=None)
            if part == parts - 1:
                ds[k0] = np.add.reduce(p1)
                sxy[k0] = np.add.reduce(p2)
    # db = rstd * (sxy - mean * ds)
    np.multiply(mean_cr, ds, out=db)
    np.subtract(sxy, db, out=db)
    np.multiply(db, rstd_cr, out=db)

    if plan.want_dx:
        # c1, c2 per (n, g): sum over the group's channels of gamma * ds (db), / M.
        m32 = np.float32(cpg * hxw)
        g2 = gamma_cr.reshape(rows, cpg)
        np.multiply(g2, ds.reshape(rows, cpg), out=prod)
        np.add.reduce(prod, axis=1, out=c1)
        np.divide(c1, m32, out=c1)
        np.multiply(g2, db.reshape(rows, cpg), out=prod)
        np.add.reduce(prod, axis=1, out=c2)
        np.divide(c2, m32, out=c2)
        # the coefficients, per channel row
        np.multiply(rstd_cr, gamma_cr, out=coef_a)
        np.copyto(coef_b.reshape(rows, cpg), c2[:, None])  # c2 per channel row
        np.multiply(coef_b, rstd_cr, out=coef_c)  # rstd * c2
        np.multiply(coef_c, mean_cr, out=coef_c)  # rstd * c2 * mean
        np.copyto(sxy.reshape(rows, cpg), c1[:, None])  # c1 per channel row (sxy is free)
        np.subtract(coef_c, sxy, out=coef_c)
        np.multiply(coef_c, rstd_cr, out=coef_c)  # C = rstd * (rstd * c2 * mean - c1)
        np.multiply(coef_b, rstd_cr, out=coef_b)
        np.multiply(coef_b, rstd_cr, out=coef_b)
        np.negative(coef_b, out=coef_b)  # B = -rstd**2 * c2
        target2 = dx_target.reshape(shape2) if dx_target is not None else None
        if target2 is None:
            assert dx is not None
            target2 = dx.reshape(shape2)  # viewable: the plan checked
        # Pass 2: dx = A * dy + B * x + C.
        for k0, k1, h0, h1, _ in _tiles(channel_rows, hxw, plan.block):
            xt, dyt = _load(x2, dy2, k0, k1, h0, h1, x_buf, dy_buf)
            q = q_buf[: xt.size].reshape(xt.shape)
            t = t_buf[: xt.size].reshape(xt.shape)
            np.multiply(dyt, coef_a[k0:k1, None], out=q)
            np.multiply(xt, coef_b[k0:k1, None], out=t)
            np.add(q, t, out=q)
            target = target2[k0:k1, h0:h1]
            if direct(target, F32):
                np.add(q, coef_c[k0:k1, None], out=target)
            else:
                np.add(q, coef_c[k0:k1, None], out=q)
                store(target, q)
        if dx_target is not None and dx is not None:
            np.copyto(dx, dx_target.reshape(dx.shape))

    if not plan.stats_out:
        if plan.want_dgamma and dgamma is not None:
            reduce_over_samples(db, n, c, dgamma)
        if plan.want_dbeta and dbeta is not None:
            reduce_over_samples(ds, n, c, dbeta)


def _tiles(channel_rows: int, hxw: int, block: int) -> Iterator[tuple[int, int, int, int, int]]:
    """``(k0, k1, h0, h1, part)``: whole channel rows per tile (``part`` -1), or, for rows
    longer than CHUNK, one CHUNK of one row (``part`` its index)."""
    if hxw <= CHUNK:
        step = _tile_rows(hxw, block)
        for k0 in range(0, channel_rows, step):
            yield k0, min(channel_rows, k0 + step), 0, hxw, -1
        return
    for k in range(channel_rows):
        for part, h0 in enumerate(range(0, hxw, CHUNK)):
            yield k, k + 1, h0, min(hxw, h0 + CHUNK), part


def _load(
    x2: np.ndarray,
    dy2: np.ndarray,
    k0: int,
    k1: int,
    h0: int,
    h1: int,
    x_buf: np.ndarray,
    dy_buf: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """The tile's ``x`` and ``dy`` as float32 contiguous arrays (views when they are)."""
    shape = (k1 - k0, h1 - h0)
    size = shape[0] * shape[1]
    xt = as_compute(x_buf[:size].reshape(shape), x2[k0:k1, h0:h1])
    dyt = as_compute(dy_buf[:size].reshape(shape), dy2[k0:k1, h0:h1])
    return xt, dyt


def plan_group_norm_backward(
    grad_out: np.ndarray,
    x: np.ndarray,
    dx: np.ndarray | None,
    n: int,
    c: int,
    hxw: int,
    group: int,
    mask: tuple[bool, bool, bool],
    has_gamma: bool,
    *,
    block: int = DEFAULT_BLOCK,
) -> GnbPlan:
    """Plan a launch on checked arguments: which operands to stage, workspace bytes."""
    shape2 = (n * c, hxw)
    stage_x = rows_view(x, shape2) is None
    stage_dy = rows_view(grad_out, shape2) is None
    stage_dx = dx is not None and (rows_view(dx, shape2) is None or overlaps(dx, x, grad_out))
    return make_gnb_plan(
        n, c, hxw, group, x.dtype, mask, has_gamma=has_gamma, stage_x=stage_x,
        stage_dy=stage_dy, stage_dx=stage_dx, block=block,
    )  # fmt: skip
