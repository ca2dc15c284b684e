"""Fused launches on torch:cpu: batch invariance bit for bit, and the tolerance of
docs/operators.md against the framework's own call on each request.

These hold the CPU kernels' own rules (intra-op threads, serial calls, numpy requests kept
numpy), so they run on torch:cpu whatever ``OPSCHED_TEST_DEVICE`` says; batch invariance on
an accelerator is checked by ``scripts/check_torch_device.py``, which the suite runs there.

A request's bits must not depend on the requests it was launched with, or on its position:
each pooled request is first launched alone through the device, then in random batches
(shapes mixed, positions shuffled, repeats allowed) with two intra-op threads, and must come
back with the same bits every time. The framework's own per-request call is the independent
expectation for the values.
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import types
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import opsched
from opsched.devices import make_device
from opsched.devices.base import meta_of
from opsched.devices.torch import aten as torch_ops
from opsched.devices.torch import group_norm_backward as torch_group_norm_backward
from opsched.devices.torch import launchers
from opsched.devices.torch.layout import HostOperands
from opsched.ops import GLU_BACKWARD, GROUP_NORM_BACKWARD, GROUP_NORM_GRAD, Operator
from tests.helpers import BF16, gn_golden, rand

torch = pytest.importorskip("torch")

F64, F32, F16 = np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16)
#: The (rtol, atol) of docs/operators.md per dtype, doubled: both sides are within it of
#: the exact value.
TOL = {F64: (2e-10, 2e-10), F32: (2e-4, 2e-4), F16: (2e-2, 2e-3), BF16: (4e-2, 4e-3)}


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    """Two intra-op threads, so a launch that let aten split a loop would show it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def t(array: np.ndarray) -> Any:
    return torch_ops.to_torch(array)


def glu_args(rng: np.random.Generator, dtype: np.dtype, large: bool = False) -> tuple[Any, ...]:
    """A random GluBackward call: 1-3 dims, any split dim, odd half lengths included;
    ``large``: 9,000 elements or more (it runs alone, from 4,096)."""
    shape = [int(v) for v in rng.integers(1, 9, size=int(rng.integers(1, 4)))]
    dim = int(rng.integers(0, len(shape)))
    shape[dim] = 2 * int(rng.choice([1, 7, 37, 150, 299]))  # shared row lengths stack
    if large:
        shape[dim] = 2 * 4500
    grad_shape = list(shape)
    grad_shape[dim] //= 2
    x, g = rand(rng, tuple(shape), dtype, 3.0), rand(rng, tuple(grad_shape), dtype)
    return t(g), t(x), dim - len(shape) if rng.random() < 0.5 else dim


def gnb_args(rng: np.random.Generator, dtype: np.dtype, large: bool = False) -> tuple[Any, ...]:
    """A random GroupNormBackward call (gamma present or not); ``large``: 9,000 elements
    or more (it runs alone, from 8,192)."""
    n, group = int(rng.integers(1, 5)), int(rng.choice([1, 2, 4]))
    c = group * int(rng.integers(1, 4))
    hxw = int(rng.choice([1, 5, 37, 64, 200, 900]))  # alone from 8,192 elements
    if large:
        hxw = -(-9000 // (n * c))
    dy, x = rand(rng, (n, c, hxw), dtype), rand(rng, (n, c, hxw), dtype)
    mean = rand(rng, (n, group), dtype, 0.5)
    rstd = (rng.random((n, group)) + 0.5).astype(dtype)
    gamma = t(rand(rng, (c,), dtype)) if rng.random() < 0.8 else None
    return t(dy), t(x), t(mean), t(rstd), gamma, n, c, hxw, group


def gn_args(rng: np.random.Generator, dtype: np.dtype, large: bool = False) -> tuple[Any, ...]:
    """A random GroupNormalizationGrad call; ``large``: 9,000 elements or more (it runs
    alone, from 8,192)."""
    n, g = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    m = int(rng.choice([3, 16, 100, 1500]))  # alone from 8,192 elements
    if large:
        m = -(-9000 // (n * g))
    x, dy, gamma = (rand(rng, (n, g, m), dtype) for _ in range(3))
    mean = rand(rng, (n, g), dtype, 0.5)
    rstd = (rng.random((n, g)) + 0.5).astype(dtype)
    return t(x), t(dy), t(gamma), t(mean), t(rstd)


def framework(op: Operator, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The framework's own call on one request (the independent expectation;
    GroupNormalizationGrad, which has none, the formula of docs/operators.md in float64). GLU in
    FLOAT16 / BFLOAT16: aten's call in float64, rounded once (aten's CPU kernel in those
    dtypes rounds sigmoid(b) first and misses the tolerance of docs/operators.md where 1 - s
    cancels; the device computes them in float32, as docs/operators.md says)."""
    if op is GLU_BACKWARD:
        g, x = args[:2]
        if x.dtype in (torch.float16, torch.bfloat16):
            exact = torch_ops.glu_backward(g.double(), x.double(), *args[2:])
            return (exact.to(x.dtype),)
        return (torch_ops.glu_backward(*args),)
    if op is GROUP_NORM_GRAD:  # no aten operator: the contract's formula in float64 (helpers)
        arrays = [torch_ops.from_torch(a) for a in args]
        return (torch.from_numpy(gn_golden(*arrays)).to(args[0].dtype),)
    if args[4] is None:  # aten cannot give dgamma without gamma: ones, as an absent gamma
        args = (*args[:4], torch.ones(args[6], dtype=args[2].dtype), *args[5:])
    return tuple(torch_ops.group_norm_backward(*args, [True] * 3))


def sibling(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A call of ``args``' shapes with other values (scaled and shifted: a positive rstd
    stays positive)."""
    return tuple(
        (v.double() * 1.25 + 0.125).to(v.dtype) if isinstance(v, torch.Tensor) else v for v in args
    )


CASES: list[tuple[Operator, Callable[..., tuple[Any, ...]]]] = [
    (GLU_BACKWARD, glu_args),
    (GROUP_NORM_BACKWARD, gnb_args),
    (GROUP_NORM_GRAD, gn_args),
]


def request(op: Operator, args: tuple[Any, ...], rid: int, host: bool = False) -> Any:
    """A checked request as the scheduler hands it to the device (outputs left to it);
    ``host``: as the device binds a call of numpy arrays, its arrays kept as numpy."""
    tensors, scalars = op.arguments(args, None)
    meta = {name: None if v is None else meta_of(v) for name, v in tensors.items()}
    scalars = op.check(meta, scalars, allocate=True)
    if host:  # numpy copies, so that nothing the launch does can reach the pooled tensors;
        # those of some shapes in Fortran order (the same values, other strides), so whole
        # groups of a launch are
        order = "F" if sum(tensors[op.inputs[0]].shape) % 2 else "C"
        arrays = {
            k: None if v is None else torch_ops.from_torch(v).copy(order=order)
            for k, v in tensors.items()
        }
        return types.SimpleNamespace(id=rid, op=op, tensors=HostOperands(arrays), scalars=scalars)
    return types.SimpleNamespace(id=rid, op=op, tensors=dict(tensors), scalars=scalars)


def outputs(op: Operator, r: Any) -> list[Any]:
    return [r.tensors[name] for name in op.outputs]


def bits(tensor: Any) -> bytes:
    if isinstance(tensor, np.ndarray):
        return np.ascontiguousarray(tensor).view(np.uint8).tobytes()
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def all_bits(op: Operator, r: Any) -> list[bytes]:
    """The bits of each output of a request that ran."""
    return [bits(v) for v in outputs(op, r)]


def run(
    op: Operator,
    calls: list[tuple[Any, ...]],
    execute: Any = None,
    framework_module: Any = None,
    host: list[bool] | None = None,
) -> list[Any]:
    """``calls`` as requests launched together: through a device's ``execute`` (asserting
    none failed), else straight through the operator with ``framework_module`` (torch, or a
    stand-in that counts calls); ``host``: which are requests of numpy arrays."""
    host = host or [False] * len(calls)
    batch = [request(op, args, i, h) for i, (args, h) in enumerate(zip(calls, host, strict=True))]
    if execute is not None:
        assert execute(op, batch, 0) == {}
    else:
        launcher = launchers.LAUNCHERS[op.name]
        module = sys.modules[launcher.launch.__module__]  # (its ``torch``: the stand-in's)
        real, module.torch = module.torch, framework_module or torch
        try:
            launcher.launch(batch)
        finally:
            module.torch = real
    return batch


def alone(op: Operator, pool: list[tuple[Any, ...]], execute: Any = None) -> list[Any]:
    """Each call of ``pool`` launched by itself (see :func:`run`): the requests."""
    return [run(op, [args], execute)[0] for args in pool]


@pytest.mark.parametrize(("op", "make"), CASES, ids=[op.name for op, _ in CASES])
@pytest.mark.parametrize("dtype", [F64, F32, F16, BF16], ids=str)
def test_a_request_has_the_same_bits_in_any_batch_at_any_position(op, make, dtype):
    if dtype not in op.dtypes:
        pytest.skip(f"{op.name} takes no {dtype}")
    rng = np.random.default_rng(zlib.crc32(f"{op.name} {dtype}".encode()))  # fixed per case
    # the large request first: alone on one thread, then in batches on two; each small
    # call has a sibling of its shapes with other values, so a launch's groups of one
    # shape hold different requests (a gather or scatter that mixed them up would show)
    small = [make(rng, dtype) for _ in range(6)]
    pool = [make(rng, dtype, large=True)] + small + [sibling(args) for args in small[:5]]
    device = make_device("torch:cpu", 1)
    solo = []
    for i, args in enumerate(pool):
        torch.set_num_threads(1 + i % 2)  # alone on one thread or two: the same bits
        (r,) = run(op, [args], device.execute)
        solo.append(all_bits(op, r))
        for got, want in zip(outputs(op, r), framework(op, args), strict=True):
            rtol, atol = TOL[dtype]
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol, equal_nan=True)
    torch.set_num_threads(2)
    for k in range(12):  # random compositions, repeats allowed, shuffled positions
        picks = rng.integers(0, len(pool), size=int(rng.integers(2, 120)))
        # requests of tensors and of numpy arrays (kept numpy until the launch), mixed;
        # some batches all of one kind, and some of each kind alone
        host = [bool(h) for h in rng.random(len(picks)) < (0.5, 0.0, 1.0)[k % 3]]
        # straight through the operator: no per-request retry could hide a failed launch
        batch = run(op, [pool[j] for j in picks], framework_module=torch, host=host)
        for r, j, h in zip(batch, picks, host, strict=True):
            assert all_bits(op, r) == solo[j]
            assert all(isinstance(v, np.ndarray if h else torch.Tensor) for v in outputs(op, r))
    for j, args in enumerate(pool):  # each alone again, kept numpy: the same bits
        (r,) = run(op, [args], device.execute, host=[True])
        assert all_bits(op, r) == solo[j]
    device.close()


@pytest.mark.parametrize("dtype", [F16, BF16], ids=str)
def test_half_precision_glu_is_within_spec_where_atens_cpu_kernel_is_not(dtype):
    # 131,072 elements of [-3, 3], as the stress harness draws them: aten's own BFLOAT16
    # call on the CPU misses the tolerance of docs/operators.md here; the
    # device's result, computed in float32 and rounded once, must be within it, alone and
    # in a batch.
    rng = np.random.default_rng(21)
    pool = [
        (
            t((rng.random((64, 1024)) * 6 - 3).astype(dtype)),
            t((rng.random((64, 2048)) * 6 - 3).astype(dtype)),
        )
        for _ in range(2)
    ]
    device = make_device("torch:cpu", 1)
    # the GLU tolerances of docs/operators.md
    rtol, atol = (1e-3, 1e-3) if dtype == F16 else (2e-2, 2e-3)
    for got, (g, x) in zip(
        [*alone(GLU_BACKWARD, pool, device.execute), *run(GLU_BACKWARD, pool, device.execute)],
        pool + pool,
        strict=True,
    ):
        want = torch_ops.glu_backward(g.double(), x.double(), -1)
        scale = max(1.0, want.abs().max().item())
        out = outputs(GLU_BACKWARD, got)[0].double()
        torch.testing.assert_close(out, want, rtol=rtol, atol=atol * scale)
    device.close()


def test_a_launch_never_lets_intra_op_threads_split_a_row():
    # 5 rows of 301 per request (self: 3,010 elements, under 4,096, so they stack): a batch
    # of k requests is 1,505 * k elements, over aten's 32,768-element grain from k = 22, and
    # its halfway point falls inside a row for odd k. Run as one framework call, two threads
    # would split a row and change its tail's bits.
    rng = np.random.default_rng(7)
    pool = [(t(rand(rng, (5, 301), F32)), t(rand(rng, (5, 602), F32, 3.0))) for _ in range(64)]
    device = make_device("torch:cpu", 1)
    solo = [all_bits(GLU_BACKWARD, r) for r in alone(GLU_BACKWARD, pool, device.execute)]
    for args, got in zip(pool, solo, strict=True):  # serial: aten's own bits
        assert got == [bits(torch_ops.glu_backward(*args, -1))]
    for k in range(23, 64, 2):  # two threads, as the fixture set
        batch = run(GLU_BACKWARD, pool[:k], device.execute)
        assert [all_bits(GLU_BACKWARD, r) for r in batch] == solo[:k]
    device.close()


def test_rows_longer_than_a_serial_call_are_cut_alike_in_every_batch():
    rng = np.random.default_rng(8)
    pool = [(t(rand(rng, (2, 40_001), F32)), t(rand(rng, (2, 80_002), F32, 3.0))) for _ in range(3)]
    device = make_device("torch:cpu", 1)
    lone = alone(GLU_BACKWARD, pool, device.execute)
    for args, r in zip(pool, lone, strict=True):
        want = torch_ops.glu_backward(*args, -1)
        torch.testing.assert_close(r.tensors["out"], want, rtol=2e-4, atol=2e-4)
    batch = run(GLU_BACKWARD, [pool[j] for j in (2, 0, 1, 0)], device.execute)
    solo = [all_bits(GLU_BACKWARD, r) for r in lone]
    assert [all_bits(GLU_BACKWARD, r) for r in batch] == [solo[j] for j in (2, 0, 1, 0)]
    device.close()


def test_a_lone_request_over_a_serial_call_has_the_same_bits_on_one_thread_or_two():
    # Alone, a request of 32,768 grid elements or more is cut into serial calls on two
    # threads and is one call on one thread (both whole rows); rows longer than that are
    # cut into the same columns on any number of threads. Either way, the same bits.
    rng = np.random.default_rng(9)
    pool = [
        (t(rand(rng, (rows, half), F32)), t(rand(rng, (rows, 2 * half), F32, 3.0)))
        for rows, half in ((7, 4_999), (13, 3_001), (1, 40_001), (3, 33_333))
    ]
    device = make_device("torch:cpu", 1)

    def numpy_alone() -> list[list[bytes]]:  # C-contiguous numpy: the lone numpy path
        done = []
        for i, args in enumerate(pool):
            r = request(GLU_BACKWARD, args, i)
            r.tensors = HostOperands(
                {
                    k: None if v is None else np.ascontiguousarray(torch_ops.from_torch(v))
                    for k, v in r.tensors.items()
                }
            )
            assert device.execute(GLU_BACKWARD, [r], 0) == {}
            done.append(all_bits(GLU_BACKWARD, r))
        return done

    torch.set_num_threads(1)
    one = [all_bits(GLU_BACKWARD, r) for r in alone(GLU_BACKWARD, pool, device.execute)]
    assert numpy_alone() == one
    torch.set_num_threads(2)
    two = [all_bits(GLU_BACKWARD, r) for r in alone(GLU_BACKWARD, pool, device.execute)]
    assert numpy_alone() == two
    device.close()
    assert one == two


def test_a_large_group_norm_backward_reads_strided_operands_by_their_strides():
    """A large request runs as aten's own call on its tensors; aten reads every operand as
    if contiguous, so strided ones must come out as the call on contiguous copies."""
    rng = np.random.default_rng(11)
    n, c, hxw, group = 2, 8, 1024, 4

    def strided(shape: tuple[int, ...]) -> Any:  # every other element of the last dim
        return t(rand(rng, (*shape[:-1], 2 * shape[-1]), F32))[..., ::2]

    dy, x = strided((n, c, hxw)), strided((n, c, hxw))
    mean = strided((n, group))
    rstd = t((rng.random((n, 2 * group)) + 0.5).astype(F32))[:, ::2]
    args = (dy, x, mean, rstd, strided((c,)), n, c, hxw, group)
    (r,) = alone(GROUP_NORM_BACKWARD, [args], make_device("torch:cpu", 1).execute)
    contiguous = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
    want = framework(GROUP_NORM_BACKWARD, contiguous)
    for got, expected in zip(outputs(GROUP_NORM_BACKWARD, r), want, strict=True):
        assert torch.equal(got, expected)


def test_a_failing_request_fails_alone_and_the_others_keep_their_bits():
    rng = np.random.default_rng(9)
    pool = [glu_args(rng, F32) for _ in range(6)]
    device = make_device("torch:cpu", 1)
    solo = [all_bits(GLU_BACKWARD, r) for r in alone(GLU_BACKWARD, pool, device.execute)]
    batch = [request(GLU_BACKWARD, args, i) for i, args in enumerate(pool)]
    batch[3].tensors["self"] = torch.zeros(batch[3].tensors["self"].shape, device="meta")
    errors = device.execute(GLU_BACKWARD, batch, 0)
    assert list(errors) == [3]
    for i, r in enumerate(batch):
        if i != 3:
            assert all_bits(GLU_BACKWARD, r) == solo[i]
    device.close()


def test_results_given_out_are_written_there_and_others_own_no_caller_memory():
    rng = np.random.default_rng(10)
    g, x = t(rand(rng, (4, 8), F32)), t(rand(rng, (4, 16), F32))
    out = torch.full((4, 16), float("nan"))

    async def main():
        async with opsched.open_scheduler(device="torch:cpu", streams=1) as sched:
            a, b = await asyncio.gather(sched.glu_backward(g, x, out=out), sched.glu_backward(g, x))
            return a, b

    a, b = asyncio.run(main())
    assert a is out and torch.equal(out, b)
    assert b.data_ptr() not in (g.data_ptr(), x.data_ptr(), out.data_ptr())


def test_inputs_that_require_grad_are_computed_without_recording_a_graph():
    rng = np.random.default_rng(11)
    g = t(rand(rng, (4, 8), F32)).requires_grad_()
    x = t(rand(rng, (4, 16), F32)).requires_grad_()

    async def main():
        async with opsched.open_scheduler(device="torch:cpu", streams=1) as sched:
            got = await asyncio.gather(*(sched.glu_backward(g, x) for _ in range(4)))
            # the launches ran inline, on this thread: its grad mode is back as it was
            assert torch.is_grad_enabled()
            return got

    for got in asyncio.run(main()):
        assert got.grad_fn is None and not got.requires_grad
        assert torch.equal(got, torch_ops.glu_backward(g.detach(), x.detach(), -1))


@pytest.mark.parametrize(("op", "make"), CASES, ids=[op.name for op, _ in CASES])
def test_the_scheduler_fuses_and_each_result_is_the_request_alone(op, make):
    rng = np.random.default_rng(12)
    pool = [make(rng, F32) for _ in range(4)]
    picks = [int(j) for j in rng.integers(0, len(pool), size=48)]
    calls = [pool[j] for j in picks]
    method = getattr(opsched.Scheduler, op.method)

    async def main():
        async with opsched.open_scheduler(device="torch:cpu", streams=1) as sched:
            alone = [await method(sched, *args) for args in pool]
            before = sched.statistics().launches
            together = await asyncio.gather(*(method(sched, *args) for args in calls))
            return alone, together, sched.statistics().launches - before

    alone, together, launches = asyncio.run(main())
    assert launches < len(calls)
    for j, got in zip(picks, together, strict=True):
        want = alone[j]
        got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
        assert [bits(v) for v in got] == [bits(v) for v in want]


class _CountingTorch:
    """torch, with the calls of one aten operator (and its overloads) counted."""

    def __init__(self, name: str) -> None:
        self.calls = 0
        real = getattr(torch.ops.aten, name)
        counter = self

        class Counted:
            def __call__(self, *args, **kwargs):
                counter.calls += 1
                return real(*args, **kwargs)

            def __getattr__(self, overload: str):  # grad_input, out, ...
                target = getattr(real, overload)

                def call(*args, **kwargs):
                    counter.calls += 1
                    return target(*args, **kwargs)

                return call

        self.ops = types.SimpleNamespace(aten=types.SimpleNamespace(**{name: Counted()}))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def test_requests_of_different_shapes_with_rows_alike_share_one_call():
    rng = np.random.default_rng(13)
    shapes = [(2, 74), (5, 74), (3, 2, 74), (1, 74), (4, 2, 6)]  # rows of 37, but the last
    pool = [(t(rand(rng, (*s[:-1], s[-1] // 2), F32)), t(rand(rng, s, F32, 3.0))) for s in shapes]
    solo = [all_bits(GLU_BACKWARD, r) for r in alone(GLU_BACKWARD, pool)]
    counting = _CountingTorch("glu_backward")
    batch = run(GLU_BACKWARD, pool * 3, framework_module=counting)
    # one call for the twelve rows of 37; the three requests of rows of 3, too few to
    # stack (glu_backward._ALONE_MAX), one call each
    assert counting.calls == 1 + 3
    assert [all_bits(GLU_BACKWARD, r) for r in batch] == solo * 3


@pytest.fixture(params=[False, True], ids=["cpu calls", "stacked"])
def stacked(request, monkeypatch):
    """Whether GroupNormBackward's requests on the CPU take the accelerators' stacked
    layout (forced here, where no accelerator is: its batch invariance is checked on the
    CPU's aten) or, as the CPU runs them, each its own call."""
    if request.param:
        monkeypatch.setattr(torch_group_norm_backward, "_own_call", lambda r: False)
    return request.param


def test_a_request_the_device_says_runs_alone_is_past_every_launchers_stacking():
    # The device tells the scheduler that requests of ALONE_BYTES run on their own
    # tensors in any launch (so one may run at submit without waiting for company): at 4
    # bytes an element, the largest operand of such a request (about a third of its
    # bytes, or more) must be past the stacking limit of every operator's launcher.
    from opsched.devices.torch import glu_backward, group_norm_grad

    modules = (glu_backward, group_norm_grad, torch_group_norm_backward)
    alone = make_device("torch:cpu", 1).runs_alone_from
    assert alone == dict.fromkeys(launchers.LAUNCHERS, launchers.ALONE_BYTES)
    assert max(m._STACK_MAX for m in modules) <= launchers.ALONE_BYTES // 3 // 4


def test_on_the_cpu_each_group_norm_backward_is_its_own_aten_call():
    # tiny requests of every geometry: each launched as aten's own call on its own
    # tensors, in any batch, so bit for bit what aten gives a caller who calls it alone
    rng = np.random.default_rng(15)
    pool = []
    for n, c, group in ((1, 4, 2), (2, 4, 4), (3, 8, 2), (2, 8, 1)):
        dy, x = rand(rng, (n, c, 7), F32), rand(rng, (n, c, 7), F32)
        mean, rstd = rand(rng, (n, group), F32), (rng.random((n, group)) + 0.5).astype(F32)
        pool.append((t(dy), t(x), t(mean), t(rstd), t(rand(rng, (c,), F32)), n, c, 7, group))
    counting = _CountingTorch("native_group_norm_backward")
    batch = run(GROUP_NORM_BACKWARD, pool * 2, framework_module=counting)
    assert counting.calls == len(pool) * 2
    for args, r in zip(pool * 2, batch, strict=True):
        want = torch.ops.aten.native_group_norm_backward(*args, [True] * 3)
        assert [bits(o) for o in outputs(GROUP_NORM_BACKWARD, r)] == [bits(w) for w in want]


def test_stacked_group_norm_backward_requests_of_different_n_and_c_share_one_call(monkeypatch):
    # the accelerators' layout, forced on the CPU (see the ``stacked`` fixture)
    monkeypatch.setattr(torch_group_norm_backward, "_own_call", lambda r: False)
    rng = np.random.default_rng(14)
    pool = []
    for n, c in ((1, 4), (2, 4), (3, 8), (2, 8)):  # 2 channels per group, HxW 5: one stack
        dy, x = rand(rng, (n, c, 5), F32), rand(rng, (n, c, 5), F32)
        mean, rstd = rand(rng, (n, c // 2), F32), (rng.random((n, c // 2)) + 0.5).astype(F32)
        gamma = t(rand(rng, (c,), F32)) if c == 8 else None
        pool.append((t(dy), t(x), t(mean), t(rstd), gamma, n, c, 5, c // 2))
    solo = [all_bits(GROUP_NORM_BACKWARD, r) for r in alone(GROUP_NORM_BACKWARD, pool)]
    counting = _CountingTorch("native_group_norm_backward")
    batch = run(GROUP_NORM_BACKWARD, pool * 2, framework_module=counting)
    assert counting.calls == 1
    assert [all_bits(GROUP_NORM_BACKWARD, r) for r in batch] == solo * 2


@pytest.mark.parametrize("mask", list(itertools.product([True, False], repeat=3)), ids=str)
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.usefixtures("stacked")
def test_group_norm_backward_output_masks_alone_and_in_a_batch(mask, dtype):
    # a request alone (its own launch) and the same request among others of its mask: the
    # same bits; outputs not asked for stay None; those asked for within the tolerance of
    # docs/operators.md of aten's call
    rng = np.random.default_rng(zlib.crc32(f"{mask} {dtype}".encode()))
    pool = []
    for i in range(4):
        n, c, group = 3, 4, 2
        dy, x = rand(rng, (n, c, 5), dtype), rand(rng, (n, c, 5), dtype)
        mean = rand(rng, (n, group), dtype, 0.5)
        rstd = (rng.random((n, group)) + 0.5).astype(dtype)
        gamma = t(rand(rng, (c,), dtype)) if i % 2 else None
        pool.append((t(dy), t(x), t(mean), t(rstd), gamma, n, c, 5, group, mask))
    device = make_device("torch:cpu", 1)
    solo = [
        outputs(GROUP_NORM_BACKWARD, r) for r in alone(GROUP_NORM_BACKWARD, pool, device.execute)
    ]
    batch = run(GROUP_NORM_BACKWARD, pool, device.execute)
    device.close()
    for args, lone, r in zip(pool, solo, batch, strict=True):
        want = framework(GROUP_NORM_BACKWARD, args[:9])
        for asked, got, together, expected in zip(
            mask, lone, outputs(GROUP_NORM_BACKWARD, r), want, strict=True
        ):
            if not asked:
                assert got is None and together is None
                continue
            assert bits(got) == bits(together)
            rtol, atol = TOL[dtype]
            torch.testing.assert_close(got, expected.reshape(got.shape), rtol=rtol, atol=atol)
