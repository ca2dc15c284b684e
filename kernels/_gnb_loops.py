"""The compiled GroupNormBackward loops (:mod:`.group_norm_backward` plans and lays out
their launches): pass 1 sums ``dy`` and ``dy * x`` over each channel row, pass 2 writes
``dx = A * dy + B * x + C`` from per-channel-row coefficients, a row (group) at a time;
then ``dgamma`` / ``dbeta`` are the per-row sums added over the samples in order. One entry
point per storage dtype (FLOAT, and FLOAT16 / BFLOAT16 as raw ``uint16`` converted to
float32 on load, rounded once on store). The table loops run many requests' usual
launches in one call, each on its own arrays, found by address.
"""

from __future__ import annotations

import numba
import numpy as np

from . import _jit

__all__ = ["LOOPS", "TABLE_COLUMNS", "TABLE_LOOPS"]


@_jit.body
def _gnb_body(  # type: ignore[no-untyped-def]
    dy,
    dys,
    x,
    xs,
    dx,
    dxs,
    mean,
    rstd,
    gamma,
    period,
    ds,
    db,
    rows,
    cpg,
    hxw,
    want_dx,
    n,
    c,
    dgamma,
    dbeta,
    load,
    store,
):
    """The compiled GroupNormBackward loop, one (n, g) row (``cpg`` channel rows) at a time.

    Channel row ``k`` of ``dy`` / ``x`` / ``dx`` is ``hxw`` elements at ``k * stride`` of
    its flat array; ``mean`` / ``rstd`` hold a value per row, ``ds`` / ``db`` one per
    channel row, ``gamma`` one per channel row modulo ``period`` (C for a request's
    per-channel gamma). Then, for ``c`` channels (0: none), ``dgamma[k]`` / ``dbeta[k]``
    are the sums of ``db`` / ``ds`` over the ``n`` samples, added in sample order (as
    :func:`reduce_over_samples`); each may be ``db`` / ``ds`` itself.
    """
    if dys == hxw and xs == hxw and dxs == hxw:
        # rows back to back, the usual layout: compiled with the strides known equal to
        # the row length, which short rows gain most from
        _gnb_rows(
            dy,
            hxw,
            x,
            hxw,
            dx,
            hxw,
            mean,
            rstd,
            gamma,
            period,
            ds,
            db,
            rows,
            cpg,
            hxw,
            want_dx,
            load,
            store,
        )
    else:
        _gnb_rows(
            dy,
            dys,
            x,
            xs,
            dx,
            dxs,
            mean,
            rstd,
            gamma,
            period,
            ds,
            db,
            rows,
            cpg,
            hxw,
            want_dx,
            load,
            store,
        )
    # a sample at a time, every channel at once: the channels are independent chains of
    # adds (each still in sample order) the CPU overlaps, where a channel's samples are one
    # chain
    for k in range(c):
        dgamma[k] = db[k]
        dbeta[k] = ds[k]
    for s in range(1, n):
        for k in range(c):
            dgamma[k] += db[s * c + k]
            dbeta[k] += ds[s * c + k]


@_jit.body
def _gnb_rows(  # type: ignore[no-untyped-def]
    dy, dys, x, xs, dx, dxs, mean, rstd, gamma, period, ds, db, rows, cpg, hxw, want_dx, load, store
):
    """Passes 1 and 2 over every row (see :func:`_gnb_body`), one row (group) at a time:
    pass 2 reads the group back from cache.

    A group at a time rather than blocks of groups (pass 1 over a block, then pass 2):
    a group is read back while it is still in cache either way, and a group at a time needs
    no block bookkeeping (``opsched bench kernels`` compares it with torch's kernel)."""
    lanes = _jit.LANES
    full = hxw - hxw % lanes
    m = np.float32(cpg * hxw)
    for r in range(rows):
        mu, rs = mean[r], rstd[r]
        k0 = r * cpg  # (loops over a group count kk from 0: a range from k0 compiles
        # to slower code)
        # pass 1: ds = sum(dy), db = rstd * (sum(dy * x) - mean * ds), per channel row
        for kk in range(cpg):
            k = k0 + kk
            if full:
                dy_row = dy[k * dys : k * dys + hxw]
                x_row = x[k * xs : k * xs + hxw]
                acc_dy, acc_xy = _jit.lanes(), _jit.lanes()
                for i in range(0, full, lanes):
                    dy_part = dy_row[i : i + lanes]
                    x_part = x_row[i : i + lanes]
                    for j in range(lanes):
                        d = load(dy_part[j])
                        acc_dy[j] += d
                        acc_xy[j] += d * load(x_part[j])
                s_dy, s_xy = _jit.fold(acc_dy), _jit.fold(acc_xy)
                for i in range(full, hxw):
                    d = load(dy_row[i])
                    s_dy += d
                    s_xy += d * load(x_row[i])
            else:  # a short row is all tail (the same adds from +0.0), indexed directly:
                # slicing each row would cost more than its sums
                s_dy = s_xy = np.float32(0.0)
                at_dy, at_x = k * dys, k * xs
                for i in range(hxw):
                    d = load(dy[at_dy + i])
                    s_dy += d
                    s_xy += d * load(x[at_x + i])
            ds[k] = s_dy
            db[k] = (s_xy - mu * s_dy) * rs
        if not want_dx:
            continue
        # pass 2: dx = A * dy + B * x + C (the group is still in cache)
        c1 = c2 = np.float32(0.0)
        g0 = (r * cpg) % period  # gamma[k % period], k counting up: no division per k
        g = g0
        for kk in range(cpg):  # the group's channels, in order
            k = k0 + kk
            c1 += gamma[g] * ds[k]
            c2 += gamma[g] * db[k]
            g = g + 1 if g + 1 < period else 0
        c1 /= m
        c2 /= m
        coef_b = -(c2 * rs * rs)
        coef_c = (c2 * rs * mu - c1) * rs
        g = g0
        for kk in range(cpg):
            k = k0 + kk
            coef_a = rs * gamma[g]
            g = g + 1 if g + 1 < period else 0
            dy_row = dy[k * dys : k * dys + hxw]
            x_row = x[k * xs : k * xs + hxw]
            dx_row = dx[k * dxs : k * dxs + hxw]
            for i in range(hxw):
                dx_row[i] = store((load(dy_row[i]) * coef_a + load(x_row[i]) * coef_b) + coef_c)


def _signature(storage: str) -> object:
    i8, inp, out = _jit.I8, _jit.readonly(storage), _jit.writeable(storage)
    f32_in, f32_out = _jit.readonly("float32"), _jit.OUTPUT
    stats = (f32_in, f32_in, f32_in, i8, f32_out, f32_out)  # mean, rstd, gamma, period, ds, db
    sums = (i8, i8, f32_out, f32_out)  # samples, channels, dgamma, dbeta
    return _jit.void(inp, i8, inp, i8, out, i8, *stats, i8, i8, i8, _jit.B1, *sums)


def _gnb_float32(  # type: ignore[no-untyped-def]
    dy,
    dys,
    x,
    xs,
    dx,
    dxs,
    mean,
    rstd,
    gamma,
    period,
    ds,
    db,
    rows,
    cpg,
    hxw,
    want_dx,
    n,
    c,
    dgamma,
    dbeta,
):
    _gnb_body(
        dy,
        dys,
        x,
        xs,
        dx,
        dxs,
        mean,
        rstd,
        gamma,
        period,
        ds,
        db,
        rows,
        cpg,
        hxw,
        want_dx,
        n,
        c,
        dgamma,
        dbeta,
        _jit.same,
        _jit.same,
    )


def _gnb_float16(  # type: ignore[no-untyped-def]
    dy,
    dys,
    x,
    xs,
    dx,
    dxs,
    mean,
    rstd,
    gamma,
    period,
    ds,
    db,
    rows,
    cpg,
    hxw,
    want_dx,
    n,
    c,
    dgamma,
    dbeta,
):
    _gnb_body(
        dy,
        dys,
        x,
        xs,
        dx,
        dxs,
        mean,
        rstd,
        gamma,
        period,
        ds,
        db,
        rows,
        cpg,
        hxw,
        want_dx,
        n,
        c,
        dgamma,
        dbeta,
        _jit.half_to_f32,
        _jit.f32_to_half,
    )


def _gnb_bfloat16(  # type: ignore[no-untyped-def]
    dy,
    dys,
    x,
    xs,
    dx,
    dxs,
    mean,
    rstd,
    gamma,
    period,
    ds,
    db,
    rows,
    cpg,
    hxw,
    want_dx,
    n,
    c,
    dgamma,
    dbeta,
):
    _gnb_body(
        dy,
        dys,
        x,
        xs,
        dx,
        dxs,
        mean,
        rstd,
        gamma,
        period,
        ds,
        db,
        rows,
        cpg,
        hxw,
        want_dx,
        n,
        c,
        dgamma,
        dbeta,
        _jit.bf16_to_f32,
        _jit.f32_to_bf16,
    )


#: The entry point of each storage kind (:data:`._jit.KINDS`), compiled on first use.
LOOPS = _jit.Loops(
    {
        "float32": (_gnb_float32, _signature("float32")),
        "float16": (_gnb_float16, _signature("uint16")),
        "bfloat16": (_gnb_bfloat16, _signature("uint16")),
    }
)


@_jit.body
def _gnb_table_body(table, sums, one, storage, load, store):  # type: ignore[no-untyped-def]
    """The compiled loop of a table launch: for each row of ``table`` (see
    :data:`TABLE_COLUMNS`; C-contiguous operands, FLOAT statistics and gamma, all three
    outputs), that request's own arrays through :func:`_gnb_body` with the arguments its
    solo launch passes (so the same bits), its sums in the front of ``sums``."""
    for r in range(table.shape[0]):
        n, c, group, hxw = table[r, 8], table[r, 9], table[r, 10], table[r, 11]
        size, rows, channel_rows = n * c * hxw, n * group, n * c
        dy = numba.carray(_jit.pointer(table[r, 0]), size, storage)
        x = numba.carray(_jit.pointer(table[r, 1]), size, storage)
        dx = numba.carray(_jit.pointer(table[r, 2]), size, storage)
        mean = numba.carray(_jit.pointer(table[r, 3]), rows, np.float32)
        rstd = numba.carray(_jit.pointer(table[r, 4]), rows, np.float32)
        gamma, period = one, 1
        if table[r, 5]:
            gamma, period = numba.carray(_jit.pointer(table[r, 5]), c, np.float32), c
        dgamma = numba.carray(_jit.pointer(table[r, 6]), c, np.float32)
        dbeta = numba.carray(_jit.pointer(table[r, 7]), c, np.float32)
        _gnb_body(
            dy,
            hxw,
            x,
            hxw,
            dx,
            hxw,
            mean,
            rstd,
            gamma,
            period,
            sums[:channel_rows],
            sums[channel_rows : 2 * channel_rows],
            rows,
            c // group,
            hxw,
            True,
            n,
            c,
            dgamma,
            dbeta,
            load,
            store,
        )


def _gnb_table_float32(table, sums, one):  # type: ignore[no-untyped-def]
    _gnb_table_body(table, sums, one, np.float32, _jit.same, _jit.same)


def _gnb_table_float16(table, sums, one):  # type: ignore[no-untyped-def]
    _gnb_table_body(table, sums, one, np.uint16, _jit.half_to_f32, _jit.f32_to_half)


def _gnb_table_bfloat16(table, sums, one):  # type: ignore[no-untyped-def]
    _gnb_table_body(table, sums, one, np.uint16, _jit.bf16_to_f32, _jit.f32_to_bf16)


#: A table row: the addresses of ``grad_out``, ``input``, ``dx``, ``mean``, ``rstd``,
#: ``gamma`` (0: none), ``dgamma``, ``dbeta``; then N, C, group, HxW.
TABLE_COLUMNS = 12
_TABLE = _jit.void(_jit.TABLE, _jit.OUTPUT, _jit.OUTPUT)
#: The table launch's entry point of each storage kind, compiled on first use.
TABLE_LOOPS = _jit.Loops(
    {
        "float32": (_gnb_table_float32, _TABLE),
        "float16": (_gnb_table_float16, _TABLE),
        "bfloat16": (_gnb_table_bfloat16, _TABLE),
    }
)
