"""The table loops: many requests in one compiled call, each on its own arrays.

A fused launch of requests that run on their own arrays is one call of the operator's
table loop (the cpu device's; :meth:`HostLauncher.table`): each request's operands found by
address, computed with the arguments of its solo launch. Each result must be that solo
launch's bit for bit, and within docs/operators.md's tolerance of the float64 oracle; a
request the loop cannot take (its own layout, an output over an input, DOUBLE) is refused,
to run its own launch.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from opsched import aclnn
from opsched.kernels.glu import glu_backward_table, glu_table_row
from opsched.kernels.group_norm_backward import gnb_table_row, group_norm_backward_table
from opsched.ops import GROUP_NORM_BACKWARD
from tests.helpers import assert_close, assert_same_bits, glu_golden, rand

F32 = np.dtype(np.float32)
HALVES = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


def solo_glu(g, x, dim):
    out = np.empty(x.shape, x.dtype)
    size, ex = aclnn.glu_backward_get_workspace_size(g, x, dim, out)
    aclnn.glu_backward(np.empty(size, np.uint8) if size else None, size, ex)
    return out


def solo_gnb(dy, x, mean, rstd, gamma, n, c, hxw, group):
    outs = np.empty_like(x), np.empty(c, mean.dtype), np.empty(c, mean.dtype)
    mask = (True, True, True)
    size, ex = aclnn.group_norm_backward_get_workspace_size(
        dy, x, mean, rstd, gamma, n, c, hxw, group, mask, *outs
    )
    aclnn.group_norm_backward(np.empty(size, np.uint8) if size else None, size, ex)
    return outs


@pytest.mark.parametrize("dtype", [F32, *HALVES], ids=str)
def test_a_glu_table_gives_each_request_its_solo_bits(dtype):
    # shapes of every kind of row: one element, odd lengths, rows longer than a vector,
    # the split along an inner dim; the same loop for all of them, in one call
    rng = np.random.default_rng(1)
    calls = []
    for shape, dim in [((2,), 0), ((3, 5, 6), -1), ((4, 6, 3), 1), ((16, 1030), -1), ((1, 2), 1)]:
        x = rand(rng, shape, dtype, 3.0)
        g = rand(
            rng,
            (*shape[: dim % len(shape)], shape[dim] // 2, *shape[dim % len(shape) + 1 :]),
            dtype,
        )
        calls.append((g, x, dim))
    outs = [np.full(x.shape, np.nan, dtype) for _, x, _ in calls]
    rows = [glu_table_row(g, x, o, dim) for (g, x, dim), o in zip(calls, outs, strict=True)]
    assert all(row is not None for row in rows)
    glu_backward_table(dtype, rows)()
    for (g, x, dim), out in zip(calls, outs, strict=True):
        assert_same_bits(out, solo_glu(g, x, dim))
        assert_close(out, glu_golden(g, x, dim), dtype, "glu")


def test_a_glu_table_refuses_what_its_loop_cannot_take():
    rng = np.random.default_rng(2)
    x, g = rand(rng, (8, 64), F32), rand(rng, (8, 32), F32)
    out = np.zeros_like(x)
    assert glu_table_row(g, x, out, -1) is not None
    assert glu_table_row(g, x, x, -1) is None  # out over an input: its launch stages it
    assert glu_table_row(g, x, np.empty((64, 8), F32).T, -1) is None  # not C-contiguous
    assert glu_table_row(g[:, ::2].copy()[:, :16], x[:, ::2], out[:, ::2], -1) is None
    assert (
        glu_table_row(g.astype(np.float64), x.astype(np.float64), out.astype(np.float64), -1)
        is None
    )
    assert glu_table_row(g[:0], x[:0], out[:0], -1) is None  # nothing to compute


def gnb_call(rng, n, c, hxw, group, gamma=True):
    dy, x = rand(rng, (n, c, hxw), F32), rand(rng, (n, c, hxw), F32, 2.0)
    mean = rand(rng, (n, group), F32)
    rstd = (rng.random((n, group)) + 0.5).astype(F32)
    return dy, x, mean, rstd, rand(rng, (c,), F32) if gamma else None, n, c, hxw, group


def test_a_group_norm_backward_table_gives_each_request_its_solo_bits():
    # every geometry in one call, the sums of each request its own, with and without gamma
    rng = np.random.default_rng(3)
    calls = [
        gnb_call(rng, 4, 8, 64, 4),
        gnb_call(rng, 2, 6, 7, 3, gamma=False),
        gnb_call(rng, 1, 64, 300, 16),
        gnb_call(rng, 3, 4, 1, 1),
    ]
    outs = [
        (np.full(a[1].shape, np.nan, F32), np.full(a[6], np.nan, F32), np.full(a[6], np.nan, F32))
        for a in calls
    ]
    rows = [gnb_table_row(*a[:5], *o, *a[5:]) for a, o in zip(calls, outs, strict=True)]
    assert all(row is not None for row in rows)
    group_norm_backward_table(F32, rows)()
    tolerance = GROUP_NORM_BACKWARD.tolerance(F32)
    for a, o in zip(calls, outs, strict=True):
        assert_same_bits(o, solo_gnb(*a))
        want = GROUP_NORM_BACKWARD.oracle(*a[:5], *a[5:9])
        for got, exact in zip(o, want, strict=True):
            np.testing.assert_allclose(got, exact, rtol=tolerance[0], atol=tolerance[1])


def test_a_group_norm_backward_table_refuses_what_its_loop_cannot_take():
    rng = np.random.default_rng(4)
    dy, x, mean, rstd, gamma, n, c, hxw, group = gnb_call(rng, 2, 4, 8, 2)
    dx, dgamma, dbeta = np.empty_like(x), np.empty(c, F32), np.empty(c, F32)
    tail = (n, c, hxw, group)
    assert gnb_table_row(dy, x, mean, rstd, gamma, dx, dgamma, dbeta, *tail) is not None
    assert gnb_table_row(dy, x, mean, rstd, gamma, dy, dgamma, dbeta, *tail) is None
    assert gnb_table_row(dy, x, mean, rstd, gamma, dx, gamma, dbeta, *tail) is None
    strided = np.empty((n, c, 2 * hxw), F32)[:, :, ::2]
    assert gnb_table_row(dy, x, mean, rstd, gamma, strided, dgamma, dbeta, *tail) is None
    half = [a.astype(np.float16) for a in (dy, x, mean, rstd, gamma)]  # FLOAT16 statistics
    assert gnb_table_row(*half, dx.astype(np.float16), dgamma, dbeta, *tail) is None
    assert (
        gnb_table_row(
            dy[:0], x[:0], mean[:0], rstd[:0], gamma, dx[:0], dgamma, dbeta, 0, c, hxw, group
        )
        is None
    )
