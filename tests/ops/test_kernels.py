"""Numerics of both operators through the two-phase API and the kernels directly."""

from __future__ import annotations

import itertools
import tracemalloc

import ml_dtypes
import numpy as np
import pytest

from opsched import aclnn
from opsched.kernels.glu import glu_backward_fast, glu_backward_reference, plan_glu_backward
from opsched.kernels.group_norm import (
    group_norm_grad_fast,
    group_norm_grad_reference,
    group_norm_grad_runner,
    plan_group_norm_grad,
)
from opsched.ops import GLU_BACKWARD, GROUP_NORM_BACKWARD, GROUP_NORM_GRAD
from tests.helpers import (
    GLU_DTYPES,
    GN_DTYPES,
    assert_close,
    assert_same_bits,
    glu_golden,
    gn_golden,
    gn_inputs,
    rand,
)


def run_glu(grad_out, x, dim, out=None):
    out = np.empty(x.shape, x.dtype) if out is None else out
    size, ex = aclnn.glu_backward_get_workspace_size(grad_out, x, dim, out)
    aclnn.glu_backward(np.empty(size, np.uint8) if size else None, size, ex)
    return out


def run_gn(x, dy, gamma, mean, rstd, dx=None):
    dx = np.empty(x.shape, x.dtype) if dx is None else dx
    size, ex = aclnn.group_norm_grad_get_workspace_size(x, dy, gamma, mean, rstd, dx)
    aclnn.group_norm_grad(np.empty(size, np.uint8) if size else None, size, ex)
    return dx


def halved(shape, dim):
    return (*shape[:dim], shape[dim] // 2, *shape[dim + 1 :])


# ------------------------------------------------------------------------------ GluBackward


@pytest.mark.parametrize("ndim", range(1, 9))
def test_glu_every_rank_and_dim(ndim):
    rng = np.random.default_rng(ndim)
    shape = tuple(int(v) for v in rng.integers(1, 4, ndim) * 2)
    for dim in range(-ndim, ndim):
        x = rand(rng, shape, np.dtype(np.float32))
        g = rand(rng, halved(shape, dim % ndim), np.dtype(np.float32))
        assert_close(run_glu(g, x, dim), glu_golden(g, x, dim), x.dtype, "glu")


@pytest.mark.parametrize("dtype", GLU_DTYPES, ids=str)
@pytest.mark.parametrize("shape_dim", [((6, 40), 1), ((300, 4, 10), 1), ((2, 70000), -1)])
def test_glu_every_dtype_matches_golden_and_reference(dtype, shape_dim):
    shape, dim = shape_dim
    rng = np.random.default_rng(0)
    x = rand(rng, shape, dtype, 3.0)
    g = rand(rng, halved(shape, dim % len(shape)), dtype)
    fast = run_glu(g, x, dim)
    assert fast.dtype == dtype
    assert_close(fast, glu_golden(g, x, dim), dtype, "glu")
    assert_close(glu_backward_reference(g, x, dim), glu_golden(g, x, dim), dtype, "glu")


def strided_views(rng, shape, dtype):
    """The same logical tensor as several layouts: transposed, step-sliced, reversed."""
    base = rand(rng, shape, dtype)
    big = np.zeros(tuple(2 * s for s in shape), dtype)
    big[tuple(slice(None, None, 2) for _ in shape)] = base
    return {
        "contiguous": base,
        "step-sliced": big[tuple(slice(None, None, 2) for _ in shape)],
        "reversed": np.ascontiguousarray(base[::-1, ..., ::-1])[::-1, ..., ::-1],
        "transposed": np.ascontiguousarray(base.T).T,
        "fortran": np.asfortranarray(base),
    }


@pytest.mark.parametrize("layout", ["step-sliced", "reversed", "transposed", "fortran"])
@pytest.mark.parametrize("dtype", GLU_DTYPES, ids=str)
def test_glu_non_contiguous_operands_bit_identical(layout, dtype):
    rng = np.random.default_rng(5)
    xs = strided_views(rng, (6, 8, 10), dtype)
    gs = strided_views(rng, (6, 4, 10), dtype)
    expected = run_glu(gs["contiguous"], xs["contiguous"], 1)
    out_views = strided_views(rng, (6, 8, 10), dtype)
    out = out_views[layout]
    got = run_glu(gs[layout], xs[layout], 1, out=out)
    assert got is out
    assert_same_bits(out, expected)
    # a strided out is written in place through its view
    if layout == "step-sliced":
        assert np.array_equal(out, expected)


@pytest.mark.parametrize("dtype", GLU_DTYPES, ids=str)
def test_glu_out_overlapping_self(dtype):
    rng = np.random.default_rng(3)
    x = rand(rng, (4, 8, 6), dtype)
    g = rand(rng, (4, 8, 3), dtype)
    expected = run_glu(g, x.copy(), -1)
    run_glu(g, x, -1, out=x)  # out=self
    assert_same_bits(x, expected)
    # a shifted view of one buffer: out starts one row after self
    buf = rand(rng, (10, 6), dtype)
    x2, out2 = buf[:8], buf[2:]
    g2 = rand(rng, (8, 3), dtype)
    expected = run_glu(g2, x2.copy(), -1)
    run_glu(g2, x2, -1, out=out2)
    assert_same_bits(out2, expected)


@pytest.mark.parametrize("shape_dim", [((0, 4), 1), ((3, 0, 2), -1), ((4, 0), 0)])
def test_glu_empty_succeeds_with_zero_workspace(shape_dim):
    shape, dim = shape_dim
    x = np.zeros(shape, np.float32)
    g = np.zeros(halved(shape, dim % len(shape)), np.float32)
    out = np.full(shape, 7, np.float32)
    size, ex = aclnn.glu_backward_get_workspace_size(g, x, dim, out)
    assert size == 0
    aclnn.glu_backward(None, 0, ex)


def test_glu_nan_and_inf_computed_through():
    x = np.array([np.nan, 1.0, np.inf, -np.inf, 2.0, np.nan, 100.0, -100.0], np.float32)
    g = np.ones(4, np.float32)
    out = run_glu(g, x, 0)
    with np.errstate(all="ignore"):
        golden = glu_golden(g, x, 0)
    # NaN positions equal; inf through exp: b = -100 gives s = 0, b = 100 gives s = 1
    assert_close(out, golden, x.dtype, "glu")
    assert np.isnan(out[1]) and np.isnan(out[5])  # b[1] = NaN poisons both of its outputs
    assert np.isnan(out[4]) and np.isfinite(out[0])  # a[0] = NaN: only grad_b[0]


@pytest.mark.parametrize("block", [7, 64, 1000, 4096, 1 << 20])
@pytest.mark.parametrize("dtype", GLU_DTYPES, ids=str)
def test_glu_block_size_never_changes_bits(block, dtype):
    rng = np.random.default_rng(11)
    x = rand(rng, (37, 2, 300), dtype, 4.0)
    g = rand(rng, (37, 1, 300), dtype)
    results = []
    for blk in (block, 32768):
        out = np.empty_like(x)
        plan = plan_glu_backward(g, x, 1, out, block=blk)
        glu_backward_fast(plan, g, x, out, np.empty(plan.workspace_bytes, np.uint8))
        results.append(out)
    assert_same_bits(*results)


def test_glu_result_independent_of_position_in_buffer():
    """A request computed inside a bigger launch gives the bits it gives alone."""
    rng = np.random.default_rng(2)
    x = rand(rng, (50, 2, 77), np.dtype(np.float32), 5.0)
    g = rand(rng, (50, 1, 77), np.dtype(np.float32))
    whole = run_glu(g, x, 1)
    for lo, hi in [(0, 1), (3, 17), (49, 50)]:
        part = run_glu(g[lo:hi].copy(), x[lo:hi].copy(), 1)
        assert_same_bits(part, whole[lo:hi])


# -------------------------------------------------------------------- GroupNormalizationGrad


@pytest.mark.parametrize("dtype", GN_DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 4, 3, 5), (1, 2, 1, 2, 1, 3, 2, 2), (3, 2, 700)])
def test_gn_matches_golden_and_reference(dtype, shape):
    rng = np.random.default_rng(1)
    args = gn_inputs(rng, shape, dtype)
    golden = gn_golden(*args)
    fast = run_gn(*args)
    assert fast.dtype == dtype
    assert_close(fast, golden, dtype, "gn")
    assert_close(group_norm_grad_reference(*args), golden, dtype, "gn")


@pytest.mark.parametrize("dtype", GN_DTYPES, ids=str)
def test_gn_long_rows_stay_within_tolerance(dtype):
    """70,007 elements a row: each of the 32 lanes adds about 2,200 of them in turn."""
    rng = np.random.default_rng(4)
    args = gn_inputs(rng, (1, 2, 70_007), dtype)
    assert_close(run_gn(*args), gn_golden(*args), dtype, "gn")


@pytest.mark.parametrize("dtype", GN_DTYPES, ids=str)
@pytest.mark.parametrize("m", [1, 31, 32, 33, 700])
def test_gn_reference_gives_the_fast_kernels_bits(dtype, m):
    """The reference device must agree with the cpu device bit for bit: same formula, same
    order of additions (lanes, fold, tail)."""
    args = gn_inputs(np.random.default_rng(m), (3, 2, m), dtype)
    assert_same_bits(run_gn(*args), group_norm_grad_reference(*args))


@pytest.mark.parametrize("layout", ["step-sliced", "reversed", "transposed", "fortran"])
def test_gn_non_contiguous_bit_identical(layout):
    rng = np.random.default_rng(6)
    shape = (3, 4, 5, 6)
    f32 = np.dtype(np.float32)
    views = [strided_views(rng, shape, f32) for _ in range(3)]
    mean = strided_views(rng, shape[:2], f32)
    rstd = {k: np.abs(v) + 0.5 for k, v in strided_views(rng, shape[:2], f32).items()}
    expected = run_gn(*(v["contiguous"] for v in views), mean["contiguous"], rstd["contiguous"])
    dx = strided_views(rng, shape, f32)[layout]
    run_gn(*(v[layout] for v in views), mean[layout], rstd[layout], dx=dx)
    assert_same_bits(dx, expected)


def test_gn_dx_overlapping_inputs():
    rng = np.random.default_rng(8)
    x, dy, gamma, mean, rstd = gn_inputs(rng, (2, 3, 16), np.dtype(np.float32))
    expected = run_gn(x, dy, gamma, mean, rstd)
    run_gn(x, dy, gamma, mean, rstd, dx=dy)  # dx is dy
    assert_same_bits(dy, expected)


@pytest.mark.parametrize("shape", [(0, 3, 4), (2, 0, 4), (2, 3, 0), (2, 3, 4, 0)])
def test_gn_empty_succeeds_with_zero_workspace(shape):
    args = gn_inputs(np.random.default_rng(0), shape, np.dtype(np.float32))
    size, ex = aclnn.group_norm_grad_get_workspace_size(*args, np.empty(shape, np.float32))
    assert size == 0
    aclnn.group_norm_grad(None, 0, ex)


@pytest.mark.parametrize("m", [1, 5, 31, 33, 128, 3000, 70_007])
def test_gn_row_bits_independent_of_position_and_layout(m):
    """A row alone, inside a larger launch, or cut from a wider buffer (rows read in place
    at an odd offset) gives the same bits."""
    rng = np.random.default_rng(m)
    args = gn_inputs(rng, (3, 2, m), np.dtype(np.float32))
    whole = run_gn(*args)
    for i, j in [(0, 0), (1, 1), (2, 0)]:
        alone = run_gn(*(a[i : i + 1, j : j + 1].copy() for a in args))
        assert_same_bits(alone[0, 0], whole[i, j])
    wide = [np.zeros((3, 2, m + 9), np.float32) for _ in range(4)]
    views = [w[:, :, 5 : 5 + m] for w in wide]
    for view, a in zip(views, args[:3], strict=False):
        np.copyto(view, a)
    plan = plan_group_norm_grad(*views)
    assert not (plan.stage_x or plan.stage_dy or plan.stage_gamma or plan.stage_out)
    group_norm_grad_fast(
        plan, *views[:3], *args[3:], views[3], np.empty(plan.workspace_bytes, np.uint8)
    )
    assert_same_bits(views[3], whole)


def test_gn_runner_gives_the_general_launchs_bits_on_later_arrays():
    """The usual launch, its layout checked once: later arrays of the same layout get the
    bits the general launch (layout checked at every call) gives them, within tolerance of
    the float64 formula."""
    rng = np.random.default_rng(5)
    dtype = np.dtype(np.float32)
    first = gn_inputs(rng, (3, 2, 40), dtype)
    dx = np.empty(first[0].shape, dtype)
    plan = plan_group_norm_grad(*first[:3], dx)
    run = group_norm_grad_runner(plan, *first, dx)
    assert run is not None
    for _ in range(2):
        args = gn_inputs(rng, (3, 2, 40), dtype)
        got, want = np.empty_like(dx), np.empty_like(dx)
        run(*args, got)
        group_norm_grad_fast(plan, *args, want, np.empty(plan.workspace_bytes, np.uint8))
        assert_same_bits(got, want)
        assert_close(got, gn_golden(*args), dtype, "group_norm_grad")


def test_gn_runner_is_none_where_the_launch_is_not_the_usual_one():
    rng = np.random.default_rng(6)
    f32 = np.dtype(np.float32)
    x, dy, gamma, mean, rstd = gn_inputs(rng, (2, 2, 8), f32)
    dx = np.empty_like(x)

    def runner(x, dy, gamma, mean, rstd, dx):
        return group_norm_grad_runner(
            plan_group_norm_grad(x, dy, gamma, dx), x, dy, gamma, mean, rstd, dx
        )

    assert runner(x, dy, gamma, mean, rstd, dx) is not None
    assert runner(x, dy, gamma, mean, rstd, x) is None  # dx overlaps x: staged
    assert runner(np.asfortranarray(x), dy, gamma, mean, rstd, dx) is None  # staged input
    assert runner(x, dy, gamma, mean[:, ::-1], rstd, dx) is None  # statistics not C-ordered
    assert runner(x, dy, gamma, mean.astype(np.float64), rstd, dx) is None  # not FLOAT
    half = [a.astype(np.float16) for a in (x, dy, gamma, mean, rstd, np.zeros_like(dx))]
    assert runner(*half) is None  # statistics converted in the workspace
    empty = np.empty((0, 2, 8), f32)
    stats = np.empty((0, 2), f32)
    assert runner(empty, empty, empty, stats, stats, empty.copy()) is None


def test_gn_group_result_independent_of_batch():
    """Rows computed alone or inside a larger tensor give identical bits."""
    rng = np.random.default_rng(9)
    args = gn_inputs(rng, (6, 4, 3, 33), np.dtype(np.float32))
    whole = run_gn(*args)
    for lo, hi in [(0, 1), (2, 5)]:
        part = run_gn(*(a[lo:hi].copy() for a in args))
        assert_same_bits(part, whole[lo:hi])


def test_gn_nan_and_inf_computed_through():
    rng = np.random.default_rng(0)
    x, dy, gamma, mean, rstd = gn_inputs(rng, (2, 2, 8), np.dtype(np.float32))
    x[0, 0, 3] = np.nan
    dy[1, 1, 0] = np.inf
    dx = run_gn(x, dy, gamma, mean, rstd)
    assert np.isnan(dx[0, 0]).all()  # NaN in a group poisons its sums
    assert np.isfinite(dx[0, 1]).all() and np.isfinite(dx[1, 0]).all()
    assert not np.isfinite(dx[1, 1]).all()


# ------------------------------------------------------------------ allocation-free kernels


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float16)], ids=str)
def test_fast_kernels_allocate_nothing_beyond_the_workspace(dtype):
    rng = np.random.default_rng(0)
    x = rand(rng, (64, 2, 4096), dtype)
    g = rand(rng, (64, 1, 4096), dtype)
    out = np.empty_like(x)
    gp = plan_glu_backward(g, x, 1, out)
    gws = np.empty(gp.workspace_bytes, np.uint8)
    args = gn_inputs(rng, (8, 4, 8192), dtype)
    dx = np.empty(args[0].shape, dtype)
    np_ = plan_group_norm_grad(args[0], args[1], args[2], dx)
    nws = np.empty(np_.workspace_bytes, np.uint8)
    for run in (
        lambda: glu_backward_fast(gp, g, x, out, gws),
        lambda: group_norm_grad_fast(np_, *args, dx, nws),
    ):
        run()  # warm up lazy imports and caches
        tracemalloc.start()
        try:
            run()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        # view objects only: far below one block buffer (32K elements)
        assert peak < 16 * 1024, peak


def test_group_norm_kernel_memory_does_not_grow_with_the_data():
    """Tiles of many short rows broadcast the row statistics: numpy's iterator then takes one
    transient 8192-element buffer per call, the same for any input size."""
    rng = np.random.default_rng(1)
    peaks = []
    for n in (4, 64):
        args = gn_inputs(rng, (n, 8, 4096), np.dtype(np.float32))
        dx = np.empty(args[0].shape, np.float32)
        plan = plan_group_norm_grad(args[0], args[1], args[2], dx)
        ws = np.empty(plan.workspace_bytes, np.uint8)
        group_norm_grad_fast(plan, *args, dx, ws)
        tracemalloc.start()
        try:
            group_norm_grad_fast(plan, *args, dx, ws)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
    assert max(peaks) < 64 * 1024, peaks  # 512 KiB and 8 MiB of x alike


def test_kernel_uses_the_workspace_it_planned():
    """The kernel carves its buffers from the workspace: half of the planned size fails."""
    rng = np.random.default_rng(0)
    # DOUBLE carves block buffers; a transposed FLOAT self is staged into the workspace
    for shape, dtype, layout in [
        ((3, 2, 50), np.float64, lambda a: a),
        ((5, 2, 40000), np.float64, lambda a: a),
        ((3, 2, 50), np.float32, lambda a: np.asfortranarray(a)),
    ]:
        x = layout(rand(rng, shape, np.dtype(dtype)))
        g = rand(rng, (shape[0], 1, shape[2]), np.dtype(dtype))
        out = np.empty_like(x)
        plan = plan_glu_backward(g, x, 1, out)
        assert plan.workspace_bytes > 0
        with pytest.raises(ValueError, match="too small"):
            glu_backward_fast(plan, g, x, out, np.zeros(plan.workspace_bytes // 2, np.uint8))


@pytest.mark.parametrize("dims", list(itertools.product([np.float32, np.float16], ["glu", "gn"])))
def test_unaligned_workspace_still_exact(dims):
    dtype, op = np.dtype(dims[0]), dims[1]
    rng = np.random.default_rng(1)
    if op == "glu":
        x, g = rand(rng, (9, 2, 33), dtype), rand(rng, (9, 1, 33), dtype)
        expected = run_glu(g, x, 1)
        out = np.empty_like(x)
        size, ex = aclnn.glu_backward_get_workspace_size(g, x, 1, out)
        aclnn.glu_backward(np.empty(size + 3, np.uint8)[3:], size, ex)
    else:
        args = gn_inputs(rng, (2, 3, 40), dtype)
        expected = run_gn(*args)
        out = np.empty(args[0].shape, dtype)
        size, ex = aclnn.group_norm_grad_get_workspace_size(*args, out)
        aclnn.group_norm_grad(np.empty(size + 5, np.uint8)[5:], size, ex)
    assert_same_bits(out, expected)


@pytest.mark.parametrize(
    "op", [GLU_BACKWARD, GROUP_NORM_GRAD, GROUP_NORM_BACKWARD], ids=lambda op: op.name
)
def test_each_description_s_example_and_oracle_agree_with_the_kernels(op):
    # The description's example inputs run through the operator, and its float64 oracle
    # (written apart from the kernels) holds the results within its tolerance; a second,
    # loop-by-loop oracle of the tests agrees with the description's.
    rng = np.random.default_rng(41)
    args = op.example(rng)
    size, ex = getattr(aclnn, f"{op.method}_get_workspace_size")(*args, *_outputs(op, args))
    outs = ex.tensors
    getattr(aclnn, op.method)(np.empty(size, np.uint8) if size else None, size, ex)
    got = op.result(outs)
    want = op.oracle(*args)
    pairs = zip(*((x,) if not isinstance(x, tuple) else x for x in (got, want)), strict=True)
    for g, w in pairs:
        assert_close(g, w.reshape(g.shape), g.dtype, op.method)
    if op is GROUP_NORM_GRAD:
        np.testing.assert_allclose(want, gn_golden(*args), rtol=1e-12, atol=1e-12)
    # docs/operators.md's table: FLOAT16 GluBackward keeps one rounding, hence its own
    assert GLU_BACKWARD.tolerance(np.float16) == (1e-3, 1e-3)
    for other in (GLU_BACKWARD, GROUP_NORM_GRAD, GROUP_NORM_BACKWARD):
        assert other.tolerance(np.float32) == (1e-4, 1e-4)
        assert other.tolerance(ml_dtypes.bfloat16) == (2e-2, 2e-3)
    assert GROUP_NORM_GRAD.tolerance(np.float16) == (1e-2, 1e-3)


def _outputs(op, args):
    """The rest of ``op``'s two-phase call ``args``: defaulted scalars and fresh outputs."""
    if op is GLU_BACKWARD:
        return (-1, np.empty_like(args[1]))
    if op is GROUP_NORM_GRAD:
        return (np.empty_like(args[0]),)
    x, c = args[1], args[6]
    return ((True, True, True), np.empty_like(x), np.empty(c, x.dtype), np.empty(c, x.dtype))
