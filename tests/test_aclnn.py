"""The two-phase API's executor contract: single use, repeatable, bind, destroy, workspace."""

from __future__ import annotations

import numpy as np
import pytest

import opsched
from opsched import (
    ExecutorState,
    InnerError,
    ParamInvalidError,
    ParamNullptrError,
    RuntimeLaunchError,
    Status,
    aclnn,
)
from opsched._lru import LRU
from opsched.devices.host.executor import PLANS, PlanCache
from opsched.devices.host.launchers import launcher_of
from opsched.ops import GLU_BACKWARD
from tests.helpers import assert_close, assert_same_bits, glu_golden, gn_inputs, rand

F32 = np.dtype(np.float32)


def glu_call(rng, shape=(4, 6), dtype=F32):
    x = rand(rng, shape, dtype)
    g = rand(rng, (shape[0], shape[1] // 2), dtype)
    out = np.empty_like(x)
    size, ex = aclnn.glu_backward_get_workspace_size(g, x, -1, out)
    return g, x, out, size, ex


def ws(size):
    return np.empty(size, np.uint8) if size else None


def test_single_use_executor_cannot_launch_twice():
    g, x, out, size, ex = glu_call(np.random.default_rng(0))
    aclnn.glu_backward(ws(size), size, ex)
    assert ex.state is ExecutorState.SPENT and ex.launches == 1
    with pytest.raises(ParamInvalidError, match="already launched.*set_repeatable"):
        aclnn.glu_backward(ws(size), size, ex)


def test_repeatable_executor_launches_with_rebound_arrays():
    rng = np.random.default_rng(1)
    g, x, out, size, ex = glu_call(rng)
    ex.set_repeatable()
    workspace = ws(size)
    for _ in range(3):
        g2, x2 = rand(rng, g.shape, F32), rand(rng, x.shape, F32)
        out2 = np.empty_like(x2)
        ex.bind(grad_out=g2, self=x2, out=out2)
        aclnn.glu_backward(workspace, size, ex)
        fresh = np.empty_like(x2)
        s, e = aclnn.glu_backward_get_workspace_size(g2, x2, -1, fresh)
        aclnn.glu_backward(ws(s), s, e)
        assert_same_bits(out2, fresh)
    assert ex.launches == 3 and ex.state is ExecutorState.READY


def test_set_repeatable_after_launch_is_invalid():
    g, x, out, size, ex = glu_call(np.random.default_rng(0))
    aclnn.glu_backward(ws(size), size, ex)
    with pytest.raises(ParamInvalidError, match="before the first launch"):
        ex.set_repeatable()


def test_bind_needs_repeatable():
    g, x, out, size, ex = glu_call(np.random.default_rng(0))
    with pytest.raises(ParamInvalidError, match="repeatable"):
        ex.bind(out=out.copy())


@pytest.mark.parametrize(
    ("name", "array", "word"),
    [
        ("self", np.zeros((4, 8), F32), "shape (4, 8)"),
        ("self", np.zeros((4, 6), np.float16), "dtype FLOAT16"),
        ("out", np.zeros((4, 12), F32)[:, ::2], "strides (48, 8)"),
    ],
)
def test_bind_other_geometry_is_invalid(name, array, word):
    g, x, out, size, ex = glu_call(np.random.default_rng(0))
    ex.set_repeatable()
    with pytest.raises(ParamInvalidError, match="planned for") as info:
        ex.bind(**{name: array})
    assert word in str(info.value)


def test_bind_rejects_unknown_names_none_and_non_arrays():
    g, x, out, size, ex = glu_call(np.random.default_rng(0))
    ex.set_repeatable()
    with pytest.raises(TypeError, match="unknown argument 'dx'"):
        ex.bind(dx=out)
    with pytest.raises(ParamNullptrError, match="out is None"):
        ex.bind(out=None)
    with pytest.raises(TypeError, match="must be a numpy.ndarray"):
        ex.bind(out=[1.0])


def test_launch_after_destroy_is_invalid():
    g, x, out, size, ex = glu_call(np.random.default_rng(0))
    ex.set_repeatable()
    ex.destroy()
    ex.destroy()  # idempotent
    assert ex.state is ExecutorState.DESTROYED
    with pytest.raises(ParamInvalidError, match="launch after destroy"):
        aclnn.glu_backward(ws(size), size, ex)
    with pytest.raises(ParamInvalidError, match="bind after destroy"):
        ex.bind(out=out)


def test_executor_as_context_manager_destroys():
    g, x, out, size, ex = glu_call(np.random.default_rng(0))
    with ex as e:
        e.set_repeatable()
        aclnn.glu_backward(ws(size), size, e)
    assert ex.state is ExecutorState.DESTROYED


def test_too_small_workspace_is_invalid():
    # DOUBLE: the numpy kernel carves block buffers (FLOAT's compiled loop needs none here)
    g, x, out, size, ex = glu_call(np.random.default_rng(0), dtype=np.dtype(np.float64))
    assert size > 0
    with pytest.raises(ParamInvalidError, match=f"smaller than the {size} bytes"):
        aclnn.glu_backward(ws(size), size - 1, ex)
    with pytest.raises(ParamInvalidError, match=f"at least {size} bytes"):
        aclnn.glu_backward(np.empty(size - 1, np.uint8), size, ex)
    with pytest.raises(ParamInvalidError, match="workspace is None"):
        aclnn.glu_backward(None, size, ex)
    with pytest.raises(TypeError, match="uint8"):
        aclnn.glu_backward(np.empty(size, np.float32), size, ex)
    with pytest.raises(TypeError, match="workspace_size must be an integer"):
        aclnn.glu_backward(ws(size), float(size), ex)
    aclnn.glu_backward(ws(size), size, ex)  # failed checks consumed nothing


def test_none_executor_is_inner_nullptr():
    with pytest.raises(InnerError) as info:
        aclnn.group_norm_grad(None, 0, None)
    assert info.value.status == Status.ERR_INNER_NULLPTR == 561103


def test_executor_of_another_operator_is_invalid():
    g, x, out, size, ex = glu_call(np.random.default_rng(0))
    with pytest.raises(ParamInvalidError, match="prepared for GluBackward, not GroupNorm"):
        aclnn.group_norm_grad(ws(size), size, ex)


def test_rebinding_overlapping_arrays_on_unstaged_plan_is_invalid():
    g, x, out, size, ex = glu_call(np.random.default_rng(0))
    ex.set_repeatable()
    ex.bind(out=x)  # same geometry, but out now overlaps self
    with pytest.raises(ParamInvalidError, match="overlaps an input"):
        aclnn.glu_backward(ws(size), size, ex)


def test_kernel_failure_is_runtime_launch_error_with_cause(monkeypatch):
    def boom(*a, **k):
        raise FloatingPointError("injected")

    # the kernel's usual launch (the runner's) and its general one both fail; an empty
    # plan cache for the test (the process's may hold a runner of this geometry already)
    monkeypatch.setattr(PLANS, "_plans", LRU(PLANS.limit))
    host = "opsched.devices.host.group_norm_grad"
    monkeypatch.setattr(f"{host}.group_norm_grad_runner", lambda *a: boom)
    monkeypatch.setattr(f"{host}.group_norm_grad_fast", boom)
    args = gn_inputs(np.random.default_rng(0), (2, 2, 4), F32)
    dx = np.empty(args[0].shape, F32)
    size, ex = aclnn.group_norm_grad_get_workspace_size(*args, dx)
    with pytest.raises(RuntimeLaunchError, match="injected") as info:
        aclnn.group_norm_grad(ws(size), size, ex)
    assert info.value.status == 361001
    assert isinstance(info.value.__cause__, FloatingPointError)


def test_stream_argument_other_than_none_is_rejected_clearly():
    g, x, out, size, ex = glu_call(np.random.default_rng(0))
    with pytest.raises(TypeError, match="stream"):
        aclnn.glu_backward(ws(size), size, ex, stream="s0")


def test_a_wrong_number_of_arguments_names_the_function_and_its_parameters():
    g, x, out, _, _ = glu_call(np.random.default_rng(0))
    takes = r"it takes \(grad_out, self, dim, out, \*, product='generic'\)"
    with pytest.raises(TypeError, match=r"^glu_backward_get_workspace_size: too many .*" + takes):
        aclnn.glu_backward_get_workspace_size(g, x, -1, out, 5)
    with pytest.raises(TypeError, match=r"missing a required argument: 'out'; " + takes):
        aclnn.glu_backward_get_workspace_size(g, x, -1)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'outs'.*and \['outs'\]"):
        aclnn.glu_backward_get_workspace_size(g, x, -1, out, outs=out)


def test_rebinding_does_not_touch_an_earlier_result():
    rng = np.random.default_rng(3)
    g, x, out, size, ex = glu_call(rng)
    ex.set_repeatable()
    aclnn.glu_backward(ws(size), size, ex)
    first = out.copy()
    ex.bind(out=np.empty_like(out), self=rand(rng, x.shape, F32))
    aclnn.glu_backward(ws(size), size, ex)
    assert_same_bits(out, first)


def test_error_status_in_str():
    with pytest.raises(ParamNullptrError) as info:
        aclnn.glu_backward_get_workspace_size(None, None, 0, None)
    assert "161001" in str(info.value) and "ERR_PARAM_NULLPTR" in str(info.value)


def gnb_call(rng, dtype=F32, strided=False, n=2, c=4, hxw=40, group=2, repeatable=True):
    """A GroupNormBackward executor, repeatable unless asked otherwise (its ds / db sums
    live in the workspace; non-float32 statistics and ``strided`` operands are copied into
    it on every launch)."""
    dy, x = rand(rng, (n, c, 2 * hxw if strided else hxw), dtype), rand(rng, (n, c, hxw), dtype)
    if strided:
        dy = dy[..., ::2]
    mean = rand(rng, (n, group), dtype)
    rstd = (rng.random((n, group)) + 0.5).astype(dtype)
    gamma = rand(rng, (c,), dtype)
    outs = np.empty_like(x), np.empty(c, dtype), np.empty(c, dtype)
    args = (dy, x, mean, rstd, gamma, n, c, hxw, group, (True, True, True))
    size, ex = aclnn.group_norm_backward_get_workspace_size(*args, *outs)
    if repeatable:
        ex.set_repeatable()
    return args, outs, size, ex


def fresh_gnb(args):
    """The same call planned and launched once, on new outputs."""
    dtype = args[1].dtype
    outs = np.empty_like(args[1]), np.empty(args[6], dtype), np.empty(args[6], dtype)
    size, ex = aclnn.group_norm_backward_get_workspace_size(*args, *outs)
    aclnn.group_norm_backward(ws(size), size, ex)
    return outs


@pytest.mark.parametrize(("dtype", "strided"), [(F32, False), (np.dtype(np.float16), True)])
def test_repeat_launches_read_the_arrays_as_they_are_at_launch(dtype, strided):
    # The executor prepares its kernel once per binding; what it keeps are the arrays,
    # never their contents.
    rng = np.random.default_rng(5)
    args, outs, size, ex = gnb_call(rng, dtype, strided)
    workspace = ws(size)
    g, x, out, glu_size, glu_ex = glu_call(rng)
    glu_ex.set_repeatable()
    for _ in range(3):
        aclnn.group_norm_backward(workspace, size, ex)
        assert_same_bits(outs, fresh_gnb(args))
        aclnn.glu_backward(ws(glu_size), glu_size, glu_ex)
        want = np.empty_like(x)
        s, e = aclnn.glu_backward_get_workspace_size(g, x, -1, want)
        aclnn.glu_backward(ws(s), s, e)
        assert_same_bits(out, want)
        for array in (*args[:5], g, x):  # new values, same arrays
            array[...] = rand(rng, array.shape, array.dtype)
        args[3][...] = np.abs(args[3]) + 0.5  # rstd > 0


def test_a_cached_group_norm_backward_launch_needs_no_preparing(monkeypatch):
    # The plan cache keeps the launch prepared for each layout it caches (C-contiguous
    # arrays): its executors, single-use or repeatable, a miss's as a hit's, launch
    # without Operator.prepare, their sums in the workspace given, with the reference
    # kernel's bits; an uncached call (a strided operand) prepares its own.

    def boom(*args, **kwargs):
        raise AssertionError("prepared per call")

    rng = np.random.default_rng(16)
    calls = [gnb_call(rng, hxw=23, repeatable=False) for _ in range(2)]  # a miss, a hit
    calls.append(gnb_call(rng, hxw=23))  # repeatable: the same cached launch
    monkeypatch.setattr(launcher_of("GroupNormBackward"), "prepare", boom)
    names = ("grad_out", "input", "mean", "rstd", "gamma")
    for args, outs, size, ex in calls:
        workspace = np.zeros(size, np.uint8)
        aclnn.group_norm_backward(workspace, size, ex)
        assert workspace.any()  # the sums were carved from it
        ref = launcher_of("GroupNormBackward").reference(
            dict(zip(names, args[:5], strict=True)),
            dict(zip(("N", "C", "HxW", "group"), args[5:9], strict=True)),
        )
        for got, want in zip(outs, ref, strict=True):
            assert_same_bits(got, want.reshape(got.shape))
    _, _, size, ex = gnb_call(rng, strided=True, hxw=23, repeatable=False)
    with pytest.raises(AssertionError, match="prepared per call"):
        aclnn.group_norm_backward(ws(size), size, ex)


def test_a_cached_glu_backward_launch_needs_no_preparing(monkeypatch):
    # As GroupNormBackward's: a cached plan's launch runs C-contiguous FLOAT calls, with
    # the reference kernel's bits; a call of a layout not seen before prepares.
    def boom(*args, **kwargs):
        raise AssertionError("prepared per call")

    rng = np.random.default_rng(17)
    calls = []
    for _ in range(2):  # a miss, then a hit
        g, x = rand(rng, (6, 23), F32), rand(rng, (6, 46), F32)
        out = np.empty_like(x)
        calls.append((g, x, out, aclnn.glu_backward_get_workspace_size(g, x, -1, out)))
    monkeypatch.setattr(launcher_of("GluBackward"), "prepare", boom)
    for g, x, out, (size, ex) in calls:
        aclnn.glu_backward(ws(size), size, ex)
        want = launcher_of("GluBackward").reference(
            {"grad_out": g, "self": x, "out": None}, {"dim": -1}
        )
        assert_same_bits(out, want)
    g, x = (rand(rng, shape, np.dtype(np.float64)) for shape in ((6, 23), (6, 46)))
    with pytest.raises(AssertionError, match="prepared per call"):  # (when it is planned)
        size, ex = aclnn.glu_backward_get_workspace_size(g, x, -1, np.empty_like(x))
        aclnn.glu_backward(ws(size), size, ex)


def test_repeat_launch_uses_the_workspace_it_is_given():
    rng = np.random.default_rng(6)
    args, outs, size, ex = gnb_call(rng)
    first, second = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
    aclnn.group_norm_backward(first, size, ex)
    first[...] = 0
    aclnn.group_norm_backward(second, size, ex)
    assert second.any() and not first.any()  # the sums were carved from the second
    assert_same_bits(outs, fresh_gnb(args))


def test_a_repeated_geometry_reuses_its_plan():
    rng = np.random.default_rng(7)
    first = glu_call(rng, (6, 10))[4]
    g, x, out, size, ex = glu_call(rng, (6, 10))
    assert ex.plan is first.plan and ex is not first  # a new executor, the cached plan
    aclnn.glu_backward(ws(size), size, ex)
    other = np.empty_like(x)
    s, e = aclnn.glu_backward_get_workspace_size(g, np.asfortranarray(x), -1, other)
    assert e.plan is not ex.plan  # not C-contiguous: checked and planned afresh
    aclnn.glu_backward(ws(s), s, e)
    assert_same_bits(out, other)


def test_a_cached_geometry_still_stages_an_overlapping_out():
    rng = np.random.default_rng(8)
    g, x, out, size, ex = glu_call(rng, (6, 10))  # cached: separate arrays
    buf = rand(rng, (2 * x.size,), F32)
    x2, out2 = buf[: x.size].reshape(x.shape), buf[3 : 3 + x.size].reshape(x.shape)
    want = np.empty_like(x2)
    s, e = aclnn.glu_backward_get_workspace_size(g, x2.copy(), -1, want)
    aclnn.glu_backward(ws(s), s, e)
    size2, ex2 = aclnn.glu_backward_get_workspace_size(g, x2, -1, out2)  # out shifted over x
    assert ex2.plan.stage_out and size2 > 0
    aclnn.glu_backward(ws(size2), size2, ex2)
    assert_same_bits(out2, want)


def test_a_cached_geometry_still_refuses_a_read_only_out():
    rng = np.random.default_rng(9)
    g, x, out, size, ex = glu_call(rng, (6, 10))
    out.setflags(write=False)
    with pytest.raises(ParamInvalidError, match="read-only"):
        aclnn.glu_backward_get_workspace_size(g, x, -1, out)


def test_an_unhashable_scalar_is_checked_not_looked_up():
    # The plan cache keys on the scalars: a list inside output_mask must reach the check
    # (and its clear message), not fail the cache lookup.
    args, outs, size, ex = gnb_call(np.random.default_rng(10))
    with pytest.raises(TypeError, match="output_mask entries must be bools, got list"):
        aclnn.group_norm_backward_get_workspace_size(*args[:9], (True, [1], True), *outs)


def glu_tensors(rng, x):
    g = rand(rng, (x.shape[0], x.shape[1] // 2), F32)
    return {"grad_out": g, "self": x, "out": np.empty(x.shape, F32)}


def test_plan_cache_counts_hits_misses_and_uncached_calls():
    cache = PlanCache()
    rng = np.random.default_rng(11)
    for x in (rand(rng, (6, 22), F32), rand(rng, (6, 22), F32), rand(rng, (22, 6), F32).T):
        cache.plan(GLU_BACKWARD, glu_tensors(rng, x), {"dim": -1}, "generic")
    stats = cache.statistics()  # the transposed self is not C-contiguous: never cached
    assert (stats.hits, stats.misses, stats.uncached, stats.size) == (1, 1, 1, 1)


def test_the_two_phase_api_reports_its_plan_cache():
    rng = np.random.default_rng(13)
    glu_call(rng, (6, 26))
    before = aclnn.plan_cache_statistics()
    glu_call(rng, (6, 26))
    after = aclnn.plan_cache_statistics()
    assert isinstance(after, opsched.PlanCacheStatistics) and after.limit == 256
    assert after.hits > before.hits


def test_the_plan_cache_keys_on_whether_each_output_is_writeable():
    # A read-only output of a geometry planned before must still be refused: the cached
    # plan was made for writeable outputs, and only the outputs' own flags tell them apart.
    rng = np.random.default_rng(14)
    args, outs, _, _ = gnb_call(rng)
    for k in range(3):
        fresh = [np.empty_like(o) for o in outs]
        aclnn.group_norm_backward_get_workspace_size(*args, *fresh)  # planned, then cached
        fresh[k].flags.writeable = False
        with pytest.raises(ParamInvalidError, match=f"{('dx', 'dgamma', 'dbeta')[k]} is read-only"):
            aclnn.group_norm_backward_get_workspace_size(*args, *fresh)


def test_a_workspace_size_of_any_integer_type_is_taken():
    g, x, out, size, ex = glu_call(np.random.default_rng(15), dtype=np.dtype(np.float64))
    aclnn.glu_backward(ws(size), np.int64(size), ex)  # numpy's integers index like int
    assert_close(out, glu_golden(g, x, -1), out.dtype, "glu")
    _, _, _, size, ex = glu_call(np.random.default_rng(15), dtype=np.dtype(np.float64))
    with pytest.raises(TypeError, match="workspace_size must be an integer, got True"):
        aclnn.glu_backward(ws(size), True, ex)


def test_a_full_plan_cache_evicts_its_oldest_plan():
    cache = PlanCache(limit=2)
    rng = np.random.default_rng(12)
    for cols in (2, 4, 6, 2):
        cache.plan(
            GLU_BACKWARD, glu_tensors(rng, rand(rng, (3, cols), F32)), {"dim": -1}, "generic"
        )
    stats = cache.statistics()
    assert (stats.misses, stats.hits, stats.evictions, stats.size) == (4, 0, 2, 2)
