"""The signature caches: a call seen before skips its checks, and never lets a bad one in."""

from __future__ import annotations

import numpy as np
import pytest

import opsched
from opsched import ParamInvalidError
from opsched.cli.bench_paths import gnb_inputs
from opsched.ops import GLU_BACKWARD, GROUP_NORM_BACKWARD, GROUP_NORM_GRAD
from tests.helpers import assert_same_bits, rand
from tests.sched_helpers import solo_glu

pytestmark = pytest.mark.anyio
F32 = np.dtype(np.float32)


async def test_a_repeated_call_is_served_by_the_call_cache_and_stays_exact():
    rng = np.random.default_rng(1)
    g, x = rand(rng, (8, 32), F32), rand(rng, (8, 64), F32)
    async with opsched.open_scheduler(streams=1) as sched:
        first = await sched.glu_backward(g, x)
        assert sched._engine.checks.known(GLU_BACKWARD, (g, x, -1), 0) is not None
        g2, x2 = rand(rng, (8, 32), F32), rand(rng, (8, 64), F32)
        second = await sched.glu_backward(g2, x2)
    assert_same_bits(first.view(np.uint32), solo_glu(g, x, -1).view(np.uint32))
    assert_same_bits(second.view(np.uint32), solo_glu(g2, x2, -1).view(np.uint32))


async def test_a_known_shape_with_another_value_or_kind_is_checked_again():
    rng = np.random.default_rng(2)
    g, x = rand(rng, (8, 32), F32), rand(rng, (8, 64), F32)
    async with opsched.open_scheduler(streams=1) as sched:
        await sched.glu_backward(g, x, -1)
        with pytest.raises(ParamInvalidError, match="self.shape"):
            await sched.glu_backward(g, x, 0)  # dim 0: 8 rows split in 4 + 4, grad_out wrong
        with pytest.raises(TypeError, match="dim must be an integer"):
            await sched.glu_backward(g, x, True)
        with pytest.raises(ParamInvalidError, match="dtype"):
            await sched.glu_backward(g.astype(np.float16), x)
        assert sched._engine.checks.known(GLU_BACKWARD, (g, x, 0), 0) is None
        assert sched.statistics().rejected == 3


async def test_calls_with_arrays_of_other_kinds_are_not_cached():
    rng = np.random.default_rng(3)
    g, x = rand(rng, (8, 32), F32), rand(rng, (8, 64), F32)
    masked = np.ma.masked_array(x)
    assert GLU_BACKWARD.call_signature((g, masked, -1)) is None
    assert GLU_BACKWARD.call_signature((g, [1.0], -1)) is None
    out = np.empty_like(x)
    async with opsched.open_scheduler(streams=1) as sched:
        assert await sched.glu_backward(g, x, out=out) is out
        assert sched._engine.checks.known(GLU_BACKWARD, (g, x), 0, np.ma.masked_array(out)) is None
        with pytest.raises(TypeError, match="masked"):  # checked in full: refused
            await sched.glu_backward(g, x, out=np.ma.masked_array(out))
    sig = GROUP_NORM_BACKWARD.call_signature((g, x, g, g, None, 1, 2, 3, 1, (True, False, True)))
    assert sig is not None and sig[-1] == (True, False, True)  # the mask is part of the key


async def test_a_repeated_call_with_outputs_is_served_by_one_lookup_each_checked_writeable():
    # Outputs of the shapes and dtypes seen before: one lookup, and each output is still
    # checked writeable; outputs of another dtype, or one entry too few, are checked in
    # full and refused as before.
    rng = np.random.default_rng(4)
    g, x = rand(rng, (8, 32), F32), rand(rng, (8, 64), F32)
    g2, x2 = rand(rng, (8, 32), F32), rand(rng, (8, 64), F32)
    out, other = np.empty_like(x), np.empty_like(x)
    gnb = gnb_inputs(rng, 1)[0]
    dx, dx2 = np.empty_like(gnb[1]), np.empty_like(gnb[1])
    async with opsched.open_scheduler(streams=1) as sched:
        checks = sched._engine.checks
        assert checks.known(GLU_BACKWARD, (g, x), 0, out) is None
        assert await sched.glu_backward(g, x, out=out) is out
        assert checks.known(GLU_BACKWARD, (g2, x2), 0, other) is not None
        assert await sched.glu_backward(g2, x2, out=other) is other
        read_only = np.empty_like(x)
        read_only.flags.writeable = False
        with pytest.raises(ParamInvalidError, match="read-only"):
            await sched.glu_backward(g, x, out=read_only)
        with pytest.raises(ParamInvalidError, match="dtype"):
            await sched.glu_backward(g, x, out=np.empty(x.shape, np.float16))
        first = await sched.group_norm_backward(*gnb, out=(dx, None, None))
        assert checks.known(GROUP_NORM_BACKWARD, gnb, 0, (dx2, None, None)) is not None
        again = await sched.group_norm_backward(*gnb, out=(dx2, None, None))
        with pytest.raises(TypeError, match="out"):
            await sched.group_norm_backward(*gnb, out=(dx2, None))
        assert sched.statistics().rejected == 3
    assert_same_bits(out, solo_glu(g, x, -1))
    assert_same_bits(other, solo_glu(g2, x2, -1))
    assert first[0] is dx and again[0] is dx2
    for a, b in zip(first, again, strict=True):
        assert_same_bits(a, b)


def test_each_hot_path_s_tensors_are_the_generic_arguments_with_the_same_key():
    # call_tensors (generated per operator) is the call cache's key and the request's
    # tensors in one step: the generic path's tensors (the same arrays, the same order,
    # the outputs bound) under the key the generic call_signature gives
    from opsched.ops._base import Operator

    rng = np.random.default_rng(7)
    g, x = rand(rng, (8, 32), F32), rand(rng, (8, 64), F32)
    gx, gdy, ggamma = (rand(rng, (2, 4, 8), F32) for _ in range(3))
    stats = rand(rng, (2, 2), F32)
    calls = [
        (GLU_BACKWARD, (g, x), np.empty_like(x)),
        (GLU_BACKWARD, (g, x, -1), None),
        (GROUP_NORM_GRAD, (gx, gdy, ggamma, stats, stats), np.empty_like(gx)),
        (GROUP_NORM_BACKWARD, (gdy, gx, stats, stats, None, 2, 4, 8, 2), None),
        (
            GROUP_NORM_BACKWARD,
            (gdy, gx, stats, stats, ggamma[0, 0, :4], 2, 4, 8, 2, (True, False, True)),
            (np.empty_like(gx), None, None),
        ),
    ]
    for op, args, out in calls:
        key, tensors = op.call_tensors(args, out)
        generic = Operator.arguments(op, args, out)[0]
        assert key is not None and key == op.call_signature(args), op.name
        assert list(tensors) == list(generic), op.name
        assert all(tensors[k] is generic[k] for k in generic), op.name
    assert GLU_BACKWARD.call_tensors((g, x, -1, 0), None) == (None, None)  # a wrong count


def test_group_norm_backward_hot_path_agrees_with_the_generic_one():
    from opsched.ops._base import Operator

    rng = np.random.default_rng(4)
    x, dy = rand(rng, (2, 4, 3), F32), rand(rng, (2, 4, 3), F32)
    stats = rand(rng, (2, 2), F32)
    op = GROUP_NORM_BACKWARD
    for gamma in (rand(rng, (4,), F32), None):
        for args in (
            (dy, x, stats, stats, gamma, 2, 4, 3, 2),
            (dy, x, stats, stats, gamma, 2, 4, 3, 2, (True, False, True)),
        ):
            fast, generic = op.arguments(args, None), Operator.arguments(op, args, None)
            assert list(fast[0]) == list(generic[0]) and fast[1] == generic[1]
            assert all(fast[0][k] is generic[0][k] for k in generic[0])
            assert op.call_signature(args) is not None
    default = (dy, x, stats, stats, None, 2, 4, 3, 2)
    assert op.call_signature(default) == op.call_signature((*default, (True, True, True)))
    assert op.call_signature(default) != op.call_signature((*default, (True, False, True)))
    with_gamma = op.call_signature((dy, x, stats, stats, stats[0], 2, 4, 3, 2))
    keys = {
        with_gamma,
        op.call_signature((dy, x, stats, stats, None, 2, 4, 3, 2)),  # no gamma
        op.call_signature((dy, x, stats, stats, stats[0], 2, 4, 3, 1)),  # another group
        op.call_signature((dy, x, stats.astype(np.float16), stats, stats[0], 2, 4, 3, 2)),
    }
    assert len(keys) == 4 and None not in keys
    # numpy integers take the generic path, which does not cache them
    assert op.call_signature((dy, x, stats, stats, stats[0], np.int64(2), 4, 3, 2)) is None
    assert op.call_signature((dy, x, stats, [1.0], stats[0], 2, 4, 3, 2)) is None


async def test_group_norm_grad_hot_path_agrees_with_the_generic_one():
    """The five-array fast path: the generic path's arguments (same arrays, same order),
    a key per geometry and dtype, none for what the generic path does not cache; a call
    repeated through a scheduler is then served by the call cache."""
    from opsched.ops._base import Operator

    rng = np.random.default_rng(6)
    x, dy, gamma = (rand(rng, (2, 4, 8), F32) for _ in range(3))
    mean, rstd = rand(rng, (2, 4), F32), rand(rng, (2, 4), F32)
    op, args = GROUP_NORM_GRAD, (x, dy, gamma, mean, rstd)
    fast, generic = op.arguments(args, None), Operator.arguments(op, args, None)
    assert list(fast[0]) == list(generic[0]) and fast[1] == generic[1] == {}
    assert all(fast[0][k] is generic[0][k] for k in generic[0])
    out = np.empty_like(x)
    assert op.arguments(args, out)[0]["dx"] is out
    # each argument's dtype and shape is part of the key: a call that differs in any one
    # is checked again (and, mixing dtypes, refused)
    halves = [
        tuple(a.astype(np.float16) if j == i else a for j, a in enumerate(args)) for i in range(5)
    ]
    keys = {op.call_signature(a) for a in (args, *halves)}
    keys.add(op.call_signature((x[:1], dy[:1], gamma[:1], mean[:1], rstd[:1])))
    assert len(keys) == 7 and None not in keys
    assert op.call_signature((x, dy, [1.0], mean, rstd)) is None  # a list: not cached
    four = (x, dy, gamma, mean)  # a wrong count: no key (the checks then refuse it)
    assert op.call_signature(four) is None
    async with opsched.open_scheduler(streams=1) as sched:
        first = await sched.group_norm_grad(*args)
        assert sched._engine.checks.known(op, args, 0) is not None
        assert_same_bits(await sched.group_norm_grad(*args), first)
        for mixed in halves:
            with pytest.raises(ParamInvalidError, match="dtype"):
                await sched.group_norm_grad(*mixed)


async def test_requests_of_one_geometry_share_one_signature_object():
    """A fused launch groups requests by signature and skips hashing a run of the same
    object: requests checked in full (with ``out=``), from the call cache, and graph nodes
    of the same geometry in different graphs each share one signature object."""
    rng = np.random.default_rng(4)
    calls = [(rand(rng, (8, 32), F32), rand(rng, (8, 64), F32)) for _ in range(3)]
    async with opsched.open_scheduler(streams=1) as sched:
        full = [
            sched._engine.checks.check(
                GLU_BACKWARD,
                {"grad_out": g, "self": x, "out": np.empty_like(x)},
                {"dim": -1},
                0,
                None,
            )
            for g, x in calls
        ]
        await sched.glu_backward(*calls[0])  # remembered by the call
        hot = [sched._engine.checks.known(GLU_BACKWARD, (g, x, -1), 0) for g, x in calls]
    g, x = calls[1]
    fresh = GLU_BACKWARD.signature({"grad_out": g, "self": x, "out": x}, {"dim": -1})
    assert fresh == full[0].signature and fresh is not full[0].signature  # equal, not same
    assert full[1].signature is full[0].signature and full[2].signature is full[0].signature
    assert all(h is not None for h in hot)
    assert hot[1].signature is hot[0].signature and hot[2].signature is hot[0].signature
    nodes = []
    for _ in range(2):
        graph = opsched.Graph()
        g, x = rand(rng, (8, 32), F32), rand(rng, (8, 64), F32)
        nodes.append(graph.glu_backward(g, x))
    assert nodes[0].geometry.signature is nodes[1].geometry.signature
