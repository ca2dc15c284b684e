"""GroupNormBackward: checks in order, the true gradient, fusion bit for bit, every surface."""

from __future__ import annotations

import asyncio
import math
import tracemalloc

import numpy as np
import pytest

import opsched
import opsched.sync
from opsched import ParamInvalidError, ParamNullptrError, aclnn
from opsched.devices.host.launchers import launcher_of
from opsched.kernels.group_norm_backward import (
    plan_group_norm_backward,
    prepare_group_norm_backward,
)
from tests.helpers import BF16, GN_DTYPES, assert_same_bits, rand, tolerance

F32 = np.dtype(np.float32)
ALL = (True, True, True)


def case(rng, n, c, hxw, group, dtype=F32, *, gamma=True, shape=None, stats_from_x=False):
    """``(grad_out, input, mean, rstd, gamma, N, C, HxW, group)``."""
    shape = shape or (n, c, hxw)
    x = rand(rng, shape, dtype)
    dy = rand(rng, shape, dtype)
    if stats_from_x:
        xr = x.astype(np.float64).reshape(n, group, -1)
        mean = xr.mean(-1).astype(dtype)
        rstd = (1 / np.sqrt(xr.var(-1) + 1e-5)).astype(dtype)
    else:
        mean = rand(rng, (n, group), dtype, 0.5)
        rstd = (rng.random((n, group)) + 0.5).astype(dtype)
    g = rand(rng, (c,), dtype) if gamma else None
    return dy, x, mean, rstd, g, n, c, hxw, group


def solo(args, mask=ALL):
    """One request alone through the two-phase API."""
    dy, x, mean, rstd, gamma, n, c, hxw, group = args
    stat_shape = gamma.shape if gamma is not None else (c,)
    outs = [
        np.empty(x.shape, x.dtype) if mask[0] else None,
        np.empty(stat_shape, x.dtype) if mask[1] else None,
        np.empty(stat_shape, x.dtype) if mask[2] else None,
    ]
    size, ex = aclnn.group_norm_backward_get_workspace_size(*args, mask, *outs)
    aclnn.group_norm_backward(np.empty(size, np.uint8) if size else None, size, ex)
    return tuple(outs)


def golden(args):
    """dx, dgamma, dbeta in float64, one (n, g) at a time, from the formula of docs/operators.md."""
    dy, x, mean, rstd, gamma, n, c, hxw, group = args
    cpg = c // group
    m = cpg * hxw
    x4 = x.astype(np.float64).reshape(n, group, cpg, hxw)
    d4 = dy.astype(np.float64).reshape(n, group, cpg, hxw)
    g = np.ones(c) if gamma is None else gamma.astype(np.float64).ravel()
    dx = np.empty_like(x4)
    dgamma, dbeta = np.zeros(c), np.zeros(c)
    for i in range(n):
        for j in range(group):
            mu, r = float(mean.reshape(n, group)[i, j]), float(rstd.reshape(n, group)[i, j])
            xhat = (x4[i, j] - mu) * r
            gc = g[j * cpg : (j + 1) * cpg]
            ds = np.array([math.fsum(d4[i, j, k]) for k in range(cpg)])
            db = np.array([math.fsum(d4[i, j, k] * xhat[k]) for k in range(cpg)])
            c1 = math.fsum(gc * ds) / m
            c2 = math.fsum(gc * db) / m
            dx[i, j] = r * (gc[:, None] * d4[i, j] - c1 - c2 * xhat)
            dgamma[j * cpg : (j + 1) * cpg] += db
            dbeta[j * cpg : (j + 1) * cpg] += ds
    return dx.reshape(x.shape), dgamma, dbeta


def close(result, expected, dtype):
    rtol, atol = tolerance(dtype, "gn")
    scale = max(1.0, float(np.abs(expected).max(initial=0.0)))
    np.testing.assert_allclose(result.astype(np.float64), expected, rtol=rtol, atol=atol * scale)


# ------------------------------------------------------------------------------ checks


def _call(**changes):
    rng = np.random.default_rng(0)
    dy, x, mean, rstd, gamma, n, c, hxw, group = case(rng, 2, 4, 3, 2)
    kw = dict(
        grad_out=dy,
        input=x,
        mean=mean,
        rstd=rstd,
        gamma=gamma,
        N=n,
        C=c,
        HxW=hxw,
        group=group,
        output_mask=[True, True, True],
        dx=np.empty_like(x),
        dgamma=np.empty(c, F32),
        dbeta=np.empty(c, F32),
    )
    kw.update(changes)
    return aclnn.group_norm_backward_get_workspace_size(**kw)


@pytest.mark.parametrize("name", ["grad_out", "input", "mean", "rstd"])
def test_missing_input_is_161001(name):
    with pytest.raises(ParamNullptrError, match=name) as info:
        _call(**{name: None, "output_mask": [True]})  # 161001 comes first
    assert info.value.status == 161001


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"output_mask": [True, True]}, "output_mask has 2 entries"),
        ({"dx": None}, "dx is None but output_mask asks for it"),
        ({"dgamma": None, "grad_out": np.zeros((2, 4, 3))}, "dgamma is None"),  # before dtype
        ({"grad_out": np.zeros((2, 4, 3))}, "grad_out.dtype is DOUBLE"),
        ({"mean": np.zeros((2, 2), np.float16)}, "mean.dtype is FLOAT16 but grad_out"),
        ({"dbeta": np.zeros(4, BF16)}, "dbeta.dtype is BFLOAT16"),
        ({"group": 0}, "group=0 must be > 0 and divide C=4"),
        ({"group": 3, "C": 4}, "group=3 must be > 0 and divide C=4"),
        ({"group": 0, "input": np.zeros((1,) * 9, F32)}, "group=0"),  # group before rank
        ({"input": np.zeros((1,) * 8 + (24,), F32)}, "input has 9 dims"),
        ({"input": np.zeros((2, 4, 4), F32)}, "input has 32 elements"),
        ({"grad_out": np.zeros((24, 1), F32), "dx": np.empty((24, 1), F32)}, "dx.shape"),
        ({"rstd": np.zeros(5, F32)}, r"rstd has 5 elements \(shape \(5,\)\); expected N\*group"),
        ({"gamma": np.zeros(3, F32)}, "gamma has 3 elements"),
        ({"dx": np.empty((4, 2, 3), F32)}, r"dx.shape is \(4, 2, 3\); expected \(2, 4, 3\)"),
        ({"dgamma": np.empty((4, 1), F32)}, r"dgamma.shape is \(4, 1\); expected \(4,\)"),
        ({"gamma": None, "dbeta": np.empty(5, F32)}, r"expected \(4,\) \(\(C,\) without gamma\)"),
        ({"N": -1}, "N=-1 is negative"),
    ],
)
def test_invalid_arguments_are_161002_in_order(changes, message):
    with pytest.raises(ParamInvalidError, match=message) as info:
        _call(**changes)
    assert info.value.status == 161002


@pytest.mark.parametrize(
    "changes",
    [
        {"input": [1.0]},
        {"N": 2.0},
        {"group": True},
        {"output_mask": [1, 1, 1]},
        {"output_mask": "yes"},
    ],
)
def test_wrong_kinds_are_type_errors(changes):
    with pytest.raises(TypeError):
        _call(**changes)


def test_masked_outputs_may_be_none_and_stay_none():
    rng = np.random.default_rng(1)
    args = case(rng, 2, 4, 3, 2)
    dx, dg, db = solo(args, (True, False, False))
    assert dg is None and db is None
    assert_same_bits(dx, solo(args)[0])


@pytest.mark.parametrize("unasked", range(3))
def test_an_output_given_but_masked_off_is_never_written(unasked):
    # Every output is a float32 array here (the two-phase API's usual call), but the mask
    # leaves one out: that array keeps its contents, the others get the gradient.
    rng = np.random.default_rng(2 + unasked)
    args = case(rng, 2, 4, 6, 2)
    mask = tuple(k != unasked for k in range(3))
    outs = (np.full_like(args[1], 7.0), np.full(4, 7.0, F32), np.full(4, 7.0, F32))
    size, ex = aclnn.group_norm_backward_get_workspace_size(*args, mask, *outs)
    aclnn.group_norm_backward(np.empty(size, np.uint8) if size else None, size, ex)
    for k, (result, expected) in enumerate(zip(outs, golden(args), strict=True)):
        if k == unasked:
            assert np.all(result == 7.0)
        else:
            close(result, expected, F32)


# ------------------------------------------------------------------------ correctness


@pytest.mark.parametrize("dtype", GN_DTYPES, ids=str)
@pytest.mark.parametrize(
    "geometry",
    [(2, 4, 3, 2), (3, 6, 5, 3), (1, 8, 1, 8), (4, 4, 7, 1), (2, 2, 70_017, 1)],
)
def test_matches_an_independent_float64_derivation(dtype, geometry):
    rng = np.random.default_rng(2)
    args = case(rng, *geometry, dtype=dtype)
    for result, expected in zip(solo(args), golden(args), strict=True):
        close(result, expected, dtype)
    ref = launcher_of("GroupNormBackward").reference(
        dict(zip(("grad_out", "input", "mean", "rstd", "gamma"), args[:5], strict=True)),
        dict(zip(("N", "C", "HxW", "group"), args[5:], strict=True)),
    )
    for result, expected in zip(ref, golden(args), strict=True):
        close(result, expected, dtype)


def test_is_the_true_gradient_of_group_norm():
    """Central finite differences of sum(dy * group_norm(x)) in float64."""
    rng = np.random.default_rng(3)
    n, c, hxw, group, eps = 2, 6, 4, 3, 1e-5
    x = rng.standard_normal((n, c, hxw))
    dy = rng.standard_normal((n, c, hxw))
    gamma, beta = rng.standard_normal(c), rng.standard_normal(c)

    def stats(x):
        xr = x.reshape(n, group, -1)
        return xr.mean(-1), 1 / np.sqrt(xr.var(-1) + eps)

    def loss(x, gamma, beta):
        mean, rstd = stats(x)
        xhat = ((x.reshape(n, group, -1) - mean[..., None]) * rstd[..., None]).reshape(x.shape)
        return float(np.sum(dy * (gamma[None, :, None] * xhat + beta[None, :, None])))

    h = 1e-6
    fd_x = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[idx] = h
        fd_x[idx] = (loss(x + e, gamma, beta) - loss(x - e, gamma, beta)) / (2 * h)
    eye = np.eye(c) * h
    fd_g = np.array([loss(x, gamma + e, beta) - loss(x, gamma - e, beta) for e in eye]) / (2 * h)
    fd_b = np.array([loss(x, gamma, beta + e) - loss(x, gamma, beta - e) for e in eye]) / (2 * h)
    mean, rstd = stats(x)
    args = (*(a.astype(F32) for a in (dy, x, mean, rstd, gamma)), n, c, hxw, group)
    dx, dgamma, dbeta = solo(args)
    np.testing.assert_allclose(dx, fd_x, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(dgamma, fd_g, rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(dbeta, fd_b, rtol=1e-3, atol=1e-3)


def test_matches_torch_native_group_norm_backward():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    args = case(rng, 3, 8, 5, 4, stats_from_x=True)
    dy, x, mean, rstd, gamma, n, c, hxw, group = args
    expected = torch.ops.aten.native_group_norm_backward(
        *(torch.from_numpy(a) for a in (dy, x, mean, rstd, gamma)), n, c, hxw, group, [True] * 3
    )
    for result, e in zip(solo(args), expected, strict=True):
        np.testing.assert_allclose(result, e.numpy(), rtol=1e-4, atol=1e-4)


def test_without_gamma_is_gamma_of_ones():
    rng = np.random.default_rng(5)
    args = case(rng, 2, 4, 6, 2, gamma=False)
    with_ones = (*args[:4], np.ones(4, F32), *args[5:])
    for a, b in zip(solo(args), solo(with_ones), strict=True):
        assert_same_bits(a, b)


@pytest.mark.parametrize(("n", "hxw"), [(0, 5), (3, 0)])
def test_empty_inputs_write_zero_dgamma_and_dbeta(n, hxw):
    rng = np.random.default_rng(6)
    args = case(rng, n, 4, hxw, 2)
    dx, dgamma, dbeta = solo(args)
    assert dx.size == 0
    assert_same_bits(dgamma, np.zeros(4, F32))
    assert_same_bits(dbeta, np.zeros(4, F32))


def test_layouts_do_not_change_a_bit():
    rng = np.random.default_rng(7)
    n, c, hxw, group = 3, 6, 40, 3
    args = case(rng, n, c, hxw, group)
    base = solo(args)
    # an (N, C, H, W) input, transposed copies of the same values: staged
    t = tuple(np.ascontiguousarray(a.swapaxes(0, -1)).swapaxes(0, -1) for a in args[:2])
    for a, b in zip(solo((*t, *args[2:])), base, strict=True):
        assert_same_bits(a, b)
    # rows cut from wider buffers at odd offsets (unit-stride rows: read in place), and a dx
    # with the same layout
    for offset in (1, 5, 33):
        wide = [np.zeros((n, c, hxw + 50), F32) for _ in range(3)]
        views = [w[:, :, offset : offset + hxw] for w in wide]
        np.copyto(views[0], args[0])
        np.copyto(views[1], args[1])
        plan = plan_group_norm_backward(views[0], views[1], views[2], n, c, hxw, group, ALL, True)
        assert not (plan.stage_x or plan.stage_dy or plan.stage_dx)
        outs = (views[2], np.empty_like(base[1]), np.empty_like(base[2]))
        ws = np.empty(plan.workspace_bytes, np.uint8)
        prepare_group_norm_backward(plan, views[0], views[1], *args[2:5], *outs)(ws)
        for a, b in zip(outs, base, strict=True):
            assert_same_bits(a, b)
        assert not wide[2][:, :, :offset].any() and not wide[2][:, :, offset + hxw :].any()


def test_the_workspace_may_start_at_any_byte():
    """The usual launch keeps its sums at the workspace's start when that is float-aligned,
    else where the planner carved them: results the same bits wherever the caller's
    workspace begins, and within docs/operators.md's of the float64 derivation."""
    rng = np.random.default_rng(17)
    args = case(rng, 3, 8, 37, 4)
    base = solo(args)
    for got, want in zip(base, golden(args), strict=True):
        close(got, want, F32)
    outs = np.empty_like(base[0]), np.empty_like(base[1]), np.empty_like(base[2])
    size, _ = aclnn.group_norm_backward_get_workspace_size(*args, ALL, *outs)
    for offset in range(8):
        _, ex = aclnn.group_norm_backward_get_workspace_size(*args, ALL, *outs)
        workspace = np.zeros(size + offset, np.uint8)[offset:]
        aclnn.group_norm_backward(workspace, size, ex)
        for got, want in zip(outs, base, strict=True):
            assert_same_bits(got, want)


def test_output_overlapping_an_input_is_computed_from_the_inputs():
    rng = np.random.default_rng(8)
    args = case(rng, 2, 4, 3, 2)
    expected = solo(args)
    dy = args[0].copy()
    size, ex = aclnn.group_norm_backward_get_workspace_size(
        dy, *args[1:], ALL, dy, np.empty(4, F32), np.empty(4, F32)
    )
    aclnn.group_norm_backward(np.empty(size, np.uint8), size, ex)
    assert_same_bits(dy, expected[0])


def test_fast_kernel_memory_is_its_workspace_plus_a_constant():
    """Nothing proportional to the data outside the workspace: numpy's iterator may take
    one transient buffer (8192 elements) for a broadcast operand, whatever the size."""
    rng = np.random.default_rng(9)
    for dtype in (F32, BF16):
        peaks = []
        for n in (4, 64):
            c, hxw, group = 8, 4096, 4
            args = case(rng, n, c, hxw, group, dtype=dtype)
            outs = (np.empty(args[1].shape, dtype), np.empty(c, dtype), np.empty(c, dtype))
            plan = plan_group_norm_backward(args[0], args[1], outs[0], n, c, hxw, group, ALL, True)
            ws = np.empty(plan.workspace_bytes, np.uint8)
            prepare_group_norm_backward(plan, *args[:5], *outs)(ws)  # warm up
            tracemalloc.start()
            try:
                prepare_group_norm_backward(plan, *args[:5], *outs)(ws)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            peaks.append(peak)
        # 64 KiB at most, for 512 KiB and 8 MiB of input alike
        assert max(peaks) < 64 * 1024, peaks


# --------------------------------------------------------------------------- scheduler


def _mixed(rng, count, dtype=F32):
    """Requests that fuse (same C/group and HxW), with different N, C, group and gamma."""
    geometries = [(2, 8, 5, 4), (3, 8, 5, 4), (1, 4, 5, 2), (5, 6, 5, 3), (2, 2, 5, 1)]
    return [case(rng, *geometries[i % len(geometries)], dtype=dtype) for i in range(count)]


@pytest.mark.usefixtures("fused_batches")
@pytest.mark.parametrize("dtype", GN_DTYPES, ids=str)
def test_fused_results_are_bit_identical_to_solo_launches(dtype):
    rng = np.random.default_rng(10)
    requests = _mixed(rng, 40, dtype)
    masks = [ALL, (True, False, True), (False, True, True), (True, False, False)]

    async def main():
        async with opsched.open_scheduler(streams=2) as sched:
            outs = await asyncio.gather(
                *(sched.group_norm_backward(*r, masks[i % 4]) for i, r in enumerate(requests))
            )
            return outs, sched.statistics()

    outs, stats = asyncio.run(main())
    assert stats.requests_per_launch_max > 1  # they did fuse
    for i, (r, out) in enumerate(zip(requests, outs, strict=True)):
        for got, want in zip(out, solo(r, masks[i % 4]), strict=True):
            if want is None:
                assert got is None
            else:
                assert_same_bits(got, want)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
def test_launches_of_large_groups_match_the_reference_bit_for_bit(dtype):
    # 560 KB (FLOAT) or 280 KB (BFLOAT16) of each input per group, 10 groups (N * group):
    # more than the core's cache holds, with a tail of 70_000 % LANES elements per row
    args = case(np.random.default_rng(12), 5, 4, 70_000, 2, dtype=dtype)
    ref = launcher_of("GroupNormBackward").reference(
        dict(zip(("grad_out", "input", "mean", "rstd", "gamma"), args[:5], strict=True)),
        dict(zip(("N", "C", "HxW", "group"), args[5:], strict=True)),
    )
    for got, want in zip(solo(args), ref, strict=True):
        assert_same_bits(got, want.reshape(got.shape))


@pytest.mark.parametrize("dtype", GN_DTYPES, ids=str)
@pytest.mark.parametrize("hxw", [1, 5, 31, 32, 45, 97])
@pytest.mark.parametrize("layout", ["back to back", "cut from wider rows"])
def test_rows_of_every_length_match_the_reference_bit_for_bit(dtype, hxw, layout):
    """Rows shorter than the lanes (added in order), rows of whole lanes, rows of lanes
    and a tail; their rows back to back or cut from wider ones (the compiled loop's two
    copies); dgamma / dbeta added over five samples: the reference kernel's bits."""
    args = case(np.random.default_rng(hxw), 5, 6, hxw, 3, dtype=dtype)
    if layout == "cut from wider rows":  # unit-stride rows, hxw + 3 apart
        wide = [np.zeros((5, 6, hxw + 3), dtype) for _ in range(2)]
        for buffer, array in zip(wide, args[:2], strict=True):
            buffer[..., 1 : hxw + 1] = array
        args = (wide[0][..., 1 : hxw + 1], wide[1][..., 1 : hxw + 1], *args[2:])
    ref = launcher_of("GroupNormBackward").reference(
        dict(zip(("grad_out", "input", "mean", "rstd", "gamma"), args[:5], strict=True)),
        dict(zip(("N", "C", "HxW", "group"), args[5:], strict=True)),
    )
    for got, want in zip(solo(args), ref, strict=True):
        assert_same_bits(got, want.reshape(got.shape))


@pytest.mark.usefixtures("fused_batches")
def test_reference_device_fuses_to_the_reference_kernel_bit_for_bit():
    rng = np.random.default_rng(11)
    requests = _mixed(rng, 12)

    async def main():
        async with opsched.open_scheduler(device="reference", inline_max_bytes=0) as sched:
            return await asyncio.gather(*(sched.group_norm_backward(*r) for r in requests))

    names = ("grad_out", "input", "mean", "rstd", "gamma")
    for r, out in zip(requests, asyncio.run(main()), strict=True):
        ref = launcher_of("GroupNormBackward").reference(
            dict(zip(names, r[:5], strict=True)),
            dict(zip(("N", "C", "HxW", "group"), r[5:], strict=True)),
        )
        for got, want in zip(out, ref, strict=True):
            assert_same_bits(got, want.reshape(got.shape))


def test_out_arrays_are_written_in_place_and_errors_reach_the_caller():
    rng = np.random.default_rng(12)
    args = case(rng, 2, 4, 3, 2)
    dx, dg, db = np.empty_like(args[1]), np.empty(4, F32), np.empty(4, F32)

    async def main():
        async with opsched.open_scheduler() as sched:
            result = await sched.group_norm_backward(*args, out=(dx, dg, db))
            with pytest.raises(ParamInvalidError, match="group=3"):
                await sched.group_norm_backward(*args[:8], 3)
            return result

    result = asyncio.run(main())
    assert result[0] is dx and result[1] is dg and result[2] is db
    for a, b in zip(result, solo(args), strict=True):
        assert_same_bits(a, b)


@pytest.mark.usefixtures("fused_batches")
def test_module_function_sync_facade_and_graph():
    rng = np.random.default_rng(13)
    args = case(rng, 2, 4, 8, 2)
    expected = solo(args)
    gate = rand(rng, (2, 4, 16), F32)

    async def main():
        module = await opsched.group_norm_backward(*args)
        graph = opsched.Graph()
        node = graph.group_norm_backward(*args, name="gnb")
        glu = graph.glu_backward(node, gate, name="glu")  # consumes dx
        both = await opsched.run(graph, [node, glu])
        return module, both

    module, (node_out, glu_out) = asyncio.run(main())
    for outs in (module, node_out):
        for a, b in zip(outs, expected, strict=True):
            assert_same_bits(a, b)
    glu_expected = np.empty_like(gate)
    size, ex = aclnn.glu_backward_get_workspace_size(expected[0], gate, -1, glu_expected)
    aclnn.glu_backward(np.empty(size, np.uint8) if size else None, size, ex)
    assert_same_bits(glu_out, glu_expected)
    with opsched.sync.open_scheduler(streams=1) as sched:
        futures = [sched.submit_group_norm_backward(*args) for _ in range(5)]
        for f in futures:
            for a, b in zip(f.result(), expected, strict=True):
                assert_same_bits(a, b)
        for a, b in zip(sched.group_norm_backward(*args), expected, strict=True):
            assert_same_bits(a, b)


def test_graph_refuses_to_consume_a_node_without_dx():
    rng = np.random.default_rng(14)
    args = case(rng, 2, 4, 8, 2)
    graph = opsched.Graph()
    node = graph.group_norm_backward(*args, (False, True, True), name="stats")
    assert node.shape == (4,)  # it stands for dgamma
    with pytest.raises(ValueError, match="whose dx its output_mask leaves out"):
        graph.glu_backward(node, rand(np.random.default_rng(0), (4,), F32))
    with pytest.raises(ParamInvalidError, match="node 'bad'.*group=3"):
        graph.group_norm_backward(*args[:8], 3, name="bad")


def test_graph_node_with_dx_only_feeds_its_consumer():
    rng = np.random.default_rng(15)
    args = case(rng, 2, 4, 8, 2)
    gate = rand(rng, (2, 4, 16), F32)
    graph = opsched.Graph()
    node = graph.group_norm_backward(*args, (True, False, False))
    glu = graph.glu_backward(node, gate)

    async def main():
        return await opsched.run(graph, [node, glu])

    (dx, dgamma, dbeta), out = asyncio.run(main())
    assert dgamma is None and dbeta is None
    assert_same_bits(dx, solo(args, (True, False, False))[0])
    assert out.shape == gate.shape


@pytest.mark.parametrize("device", ["cpu", "reference", "torch:cpu"])
@pytest.mark.parametrize("mask", [(True, False, True), (False, True, False), (True, True, False)])
def test_out_with_a_false_mask_entry_gives_none_and_leaves_that_array_alone(mask, device):
    if device.startswith("torch"):
        pytest.importorskip("torch")
    args = case(np.random.default_rng(41), 2, 8, 6, 4)
    with opsched.sync.open_scheduler(device=device) as sched:  # the request without out=
        want = sched.group_norm_backward(*args, output_mask=mask)

    def outs():
        x, c = args[1], args[6]
        return (np.full(x.shape, 7.0, F32), np.full((c,), 7.0, F32), np.full((c,), 7.0, F32))

    def check(result, given):
        for got, expected, array, wanted in zip(result, want, given, mask, strict=True):
            if wanted:
                assert got is array  # written in place, returned
                assert_same_bits(got, expected)
            else:
                assert got is None
                assert (array == 7.0).all()  # never written

    with opsched.sync.open_scheduler(device=device) as sched:
        given = outs()
        check(sched.group_norm_backward(*args, output_mask=mask, out=given), given)
        given = outs()
        future = sched.submit_group_norm_backward(*args, output_mask=mask, out=given)
        check(future.result(), given)

    async def main():
        async with opsched.open_scheduler(device=device) as sched:
            given = outs()
            check(await sched.group_norm_backward(*args, output_mask=mask, out=given), given)

    asyncio.run(main())
