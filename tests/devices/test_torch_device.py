"""The torch devices: data in and out, the framework's operators, errors, streams.

The scheduler's behaviour tests (test_scheduler, test_graph, test_sync) also run on the
torch device; this module covers what only a torch device does. Both run on the device
``OPSCHED_TEST_DEVICE`` names (torch:cpu by default); tests of what only torch:cpu does
(numpy requests kept as numpy, blocking calls in the caller's thread) skip elsewhere.
"""

from __future__ import annotations

import asyncio
import functools
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest

import opsched
from opsched import InnerError, ParamInvalidError
from tests.helpers import gn_inputs, rand
from tests.sched_helpers import (
    ON_TORCH_CPU,
    TORCH_DEVICE,
    assert_result,
    beside_a_ready_task,
    host,
    on_device,
    solo_glu,
    torch_device,
)

torch = pytest.importorskip("torch")

F32 = np.dtype(np.float32)
DEVICE = TORCH_DEVICE
#: What only torch:cpu does (its numpy host path, calls in the caller's thread).
cpu_only = pytest.mark.skipif(not ON_TORCH_CPU, reason="what only torch:cpu does")


def test_results_come_back_as_the_kind_of_the_inputs():
    rng = np.random.default_rng(0)
    g, x = rand(rng, (4, 8), F32), rand(rng, (4, 16), F32)

    async def main():
        async with opsched.open_scheduler(device=DEVICE) as sched:
            as_numpy = await sched.glu_backward(g, x)
            as_torch = await sched.glu_backward(on_device(g), on_device(x))
            mixed = await sched.glu_backward(on_device(g), x)  # a tensor: torch out
            return as_numpy, as_torch, mixed

    as_numpy, as_torch, mixed = asyncio.run(main())
    assert isinstance(as_numpy, np.ndarray)
    assert isinstance(as_torch, torch.Tensor) and isinstance(mixed, torch.Tensor)
    expected = torch.ops.aten.glu_backward(on_device(g), on_device(x), -1)
    assert torch.equal(as_torch, expected) and torch.equal(mixed, expected)
    assert torch.equal(on_device(as_numpy), expected)
    assert_result(DEVICE, as_numpy, solo_glu(g, x, -1))


@pytest.mark.parametrize("tensors", [False, True], ids=["numpy inputs", "tensor inputs"])
def test_numpy_out_is_written_and_returned(tensors):
    # the caller's numpy out= is what comes back, written, whatever kind the inputs are
    rng = np.random.default_rng(1)
    g, x = rand(rng, (4, 8), F32), rand(rng, (4, 16), F32)
    args = (on_device(g), on_device(x)) if tensors else (g, x)
    out = np.zeros((4, 16), F32)

    async def main():
        async with opsched.open_scheduler(device=DEVICE) as sched:
            return await sched.glu_backward(*args, out=out)

    assert asyncio.run(main()) is out
    expected = torch.ops.aten.glu_backward(on_device(g), on_device(x), -1)
    assert torch.equal(on_device(out), expected)
    assert_result(DEVICE, out, solo_glu(g, x, -1))


def test_numpy_calls_fuse_as_numpy_and_give_the_tensor_calls_bits():
    # calls of numpy arrays stay numpy until their launch (one copy per operand, numpy
    # views back): the same bits as the same calls made with tensors, written into the
    # numpy out= given (contiguous or strided), never into the caller's inputs
    rng = np.random.default_rng(2)
    pool = [(rand(rng, (3, 8), F32), rand(rng, (3, 16), F32)) for _ in range(4)]
    picks = [int(j) for j in rng.integers(0, 4, size=40)]
    big = np.full((3, 32), np.nan, F32)
    outs = [np.full((3, 16), np.nan, F32), big[:, ::2]]  # contiguous, strided
    before = [(g.copy(), x.copy()) for g, x in pool]

    async def main():
        async with opsched.open_scheduler(device=DEVICE, streams=1) as sched:
            tensors = [await sched.glu_backward(on_device(g), on_device(x)) for g, x in pool]
            launches = sched.statistics().launches
            calls = [sched.glu_backward(*pool[j]) for j in picks]
            calls += [sched.glu_backward(*pool[j], out=o) for j, o in enumerate(outs)]
            got = await asyncio.gather(*calls)
            return tensors, got, sched.statistics().launches - launches

    tensors, got, launches = asyncio.run(main())
    assert launches < len(got) // 4
    for j, result in zip([*picks, 0, 1], got, strict=True):
        assert type(result) is np.ndarray
        assert result.tobytes() == host(tensors[j]).tobytes()
    assert got[-2] is outs[0] and got[-1] is outs[1]
    assert np.isnan(big[:, 1::2]).all()  # the strided out's gaps untouched
    for (g, x), (g0, x0) in zip(pool, before, strict=True):
        assert np.array_equal(g, g0) and np.array_equal(x, x0)
        assert not any(np.shares_memory(r, a) for r in got for a in (g, x))


@cpu_only
@pytest.mark.parametrize("shape", [(3, 16), (64, 128)], ids=["stacked", "alone"])
def test_a_lone_numpy_call_writes_its_out_in_place_or_by_copy(shape):
    # one blocking call at a time: each launch holds one request, run through the lone
    # path (a small one stacked by itself, a large one as aten's own call); a contiguous
    # out= is written by the launch itself, a strided one copied into
    rng = np.random.default_rng(4)
    g, x = rand(rng, (shape[0], shape[1] // 2), F32), rand(rng, shape, F32)
    want = host(torch.ops.aten.glu_backward(on_device(g), on_device(x), -1))
    flat = np.full(shape, np.nan, F32)
    wide = np.full((shape[0], 2 * shape[1]), np.nan, F32)
    with opsched.sync.open_scheduler(device=DEVICE, streams=1) as sched:
        plain = sched.glu_backward(g, x)
        into_flat = sched.glu_backward(g, x, out=flat)
        into_strided = sched.glu_backward(g, x, out=wide[:, 1::2])
    assert type(plain) is np.ndarray and plain.tobytes() == want.tobytes()
    assert into_flat is flat and flat.tobytes() == want.tobytes()
    assert np.array_equal(into_strided, want) and np.isnan(wide[:, ::2]).all()
    assert into_strided.base is wide


@cpu_only
@pytest.mark.parametrize("shape", [(2, 4, 6), (4, 8, 300)], ids=["small", "large"])
def test_a_lone_numpy_group_norm_call_writes_its_out_in_place_or_by_copy(shape):
    # the lone numpy paths of both group-norm operators: each output as the tensor call's
    # bits (the stacked layout either way), allocated, written in place, or copied into
    # a strided out=
    rng = np.random.default_rng(5)
    n, c, hxw = shape
    x, dy, gamma, mean, rstd = gn_inputs(rng, shape, F32)
    calls = {
        "group_norm_grad": (x, dy, gamma, mean, rstd),
        "group_norm_backward": (dy, x, mean, rstd, rand(rng, (c,), F32), n, c, hxw, c),
    }
    for name, args in calls.items():
        tensors = tuple(on_device(a) if isinstance(a, np.ndarray) else a for a in args)
        with opsched.sync.open_scheduler(device=DEVICE, streams=1) as sched:
            call = getattr(sched, name)
            want = call(*tensors)
            want = tuple(host(w) for w in (want if isinstance(want, tuple) else (want,)))
            plain = call(*args)
            flat = tuple(np.full(w.shape, np.nan, F32) for w in want)
            wide = tuple(np.full((*w.shape[:-1], 2 * w.shape[-1]), np.nan, F32) for w in want)
            strided = tuple(w[..., 1::2] for w in wide)
            into_flat = call(*args, out=flat if len(flat) > 1 else flat[0])
            into_strided = call(*args, out=strided if len(strided) > 1 else strided[0])
        got = [plain, into_flat, into_strided]
        got = [g if isinstance(g, tuple) else (g,) for g in got]
        assert all(type(v) is np.ndarray for g in got for v in g)
        for g in got:
            assert [v.tobytes() for v in g] == [w.tobytes() for w in want], name
        assert all(v is f for v, f in zip(got[1], flat, strict=True))
        assert all(v.base is w for v, w in zip(got[2], wide, strict=True))
        assert all(np.isnan(w[..., ::2]).all() for w in wide)


@cpu_only
def test_only_all_numpy_calls_under_the_split_size_stay_numpy():
    from opsched.devices import make_device
    from opsched.devices.torch.layout import HostOperands
    from opsched.ops import GLU_BACKWARD

    device = make_device(DEVICE, 2)
    g, x = np.ones((2, 4), F32), np.ones((2, 8), F32)
    spec = {"out": ((2, 8), F32)}

    def bound(**tensors):
        data, _ = device.bind(GLU_BACKWARD, tensors, {"dim": -1}, spec, 96)
        return data

    host = bound(grad_out=g, self=x, out=None)
    assert type(host) is HostOperands and host["self"] is x
    mixed = bound(grad_out=on_device(g), self=x, out=None)
    assert type(mixed) is dict and isinstance(mixed["self"], torch.Tensor)
    data, _ = device.bind(
        GLU_BACKWARD,
        {"grad_out": g, "self": x, "out": None},
        {"dim": -1},
        spec,
        device.split_min_bytes,
    )
    assert type(data) is dict and isinstance(data["self"], torch.Tensor)
    device.close()


@cpu_only
def test_a_tensor_on_another_device_is_param_invalid():
    g = torch.empty((4, 8), device="meta")
    x = torch.empty((4, 16))

    async def main():
        async with opsched.open_scheduler(device=DEVICE) as sched:
            await sched.glu_backward(g, x)

    with pytest.raises(ParamInvalidError, match=r"grad_out is on meta; the scheduler's device"):
        asyncio.run(main())


def test_product_checks_apply_on_torch_devices():
    zeros = functools.partial(torch.zeros, device=torch_device())

    async def main():
        async with opsched.open_scheduler(device=DEVICE, product="atlas-training") as s:
            with pytest.raises(ParamInvalidError, match="on atlas-training GluBackward takes"):
                await s.glu_backward(zeros(2, 2, dtype=torch.bfloat16), zeros(2, 4))
            x = zeros(2, 2, 4)
            with pytest.raises(InnerError, match="GroupNormalizationGrad is not available"):
                await s.group_norm_grad(x, x, x, zeros(2, 2), zeros(2, 2) + 1)

    asyncio.run(main())


@cpu_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("gamma", "mask"),
    [(True, (True, True, True)), (False, (True, False, True)), (True, (False, True, False))],
    ids=["all", "no gamma", "sums only"],
)
def test_a_lone_tensor_group_norm_backward_call_gets_tensors_with_its_batched_bits(
    dtype, gamma, mask
):
    # a blocking call of CPU tensors runs alone, in the stacked layout of one request: it
    # gets tensors back, into its out= tensors where given, with the bits the same request
    # gets in a fused batch (its results do not depend on the batch)
    rng = np.random.default_rng(9)
    kind = getattr(torch, dtype)
    bits = torch.int16 if kind == torch.bfloat16 else torch.int32

    def request():
        dy, x = (on_device(rand(rng, (2, 4, 6), F32)).to(kind) for _ in range(2))
        mean = on_device(rand(rng, (2, 2), F32)).to(kind)
        rstd = on_device((rng.random((2, 2)) + 0.5).astype(F32)).to(kind)
        g = on_device(rand(rng, (4,), F32)).to(kind) if gamma else None
        return dy, x, mean, rstd, g, 2, 4, 6, 2, mask

    mine, others = request(), [request() for _ in range(5)]
    outs = tuple(
        torch.full(shape, float("nan"), dtype=kind) if want else None
        for shape, want in zip(((2, 4, 6), (4,), (4,)), mask, strict=True)
    )
    with opsched.sync.open_scheduler(device=DEVICE, streams=1) as sched:
        alone = sched.group_norm_backward(*mine)
        into = sched.group_norm_backward(*mine, out=outs)
    assert [v is None for v in alone] == [not m for m in mask]
    assert all(type(v) is torch.Tensor for v in alone if v is not None)
    assert all(v is o for v, o in zip(into, outs, strict=True) if o is not None)

    async def batched():
        async def all_of(sched):
            calls = [sched.group_norm_backward(*r) for r in (*others[:2], mine, *others[2:])]
            return await asyncio.gather(*calls)

        async with opsched.open_scheduler(device=DEVICE, streams=1) as sched:
            return (await beside_a_ready_task(all_of(sched)))[2]

    together = asyncio.run(batched())
    for a, b, c in zip(alone, into, together, strict=True):
        if a is not None:  # bit for bit, not only equal values
            assert a.view(bits).equal(b.view(bits)) and a.view(bits).equal(c.view(bits))


def _gnb_request(rng, n, c, hxw, group):
    """A GroupNormBackward call of that geometry, on the device, FLOAT."""
    dy, x = (on_device(rand(rng, (n, c, hxw), F32)) for _ in range(2))
    mean = on_device(rand(rng, (n, group), F32))
    rstd = on_device((rng.random((n, group)) + 0.5).astype(F32))
    return dy, x, mean, rstd, on_device(rand(rng, (c,), F32)), n, c, hxw, group


def _queued_together(requests):
    """``requests`` (GroupNormBackward calls) queued together on one stream: their
    results, and the scheduler's statistics."""

    async def main():
        async def all_of(sched):
            return await asyncio.gather(*(sched.group_norm_backward(*r) for r in requests))

        async with opsched.open_scheduler(device=DEVICE, streams=1) as sched:
            outs = await beside_a_ready_task(all_of(sched))  # (queued: none runs at submit)
            return outs, sched.statistics()

    return asyncio.run(main())


def test_group_norm_backward_fuses_into_one_aten_launch():
    rng = np.random.default_rng(2)
    requests = [_gnb_request(rng, n, 4, 5, 2) for n in (1, 2, 3, 2)]
    outs, stats = _queued_together(requests)
    assert stats.launches < len(requests)  # one stream task served several requests
    for r, got in zip(requests, outs, strict=True):
        want = torch.ops.aten.native_group_norm_backward(*r, [True] * 3)
        assert torch.equal(got[0], want[0])  # dx: the framework's own call, bit for bit
        for a, b in zip(got[1:], want[1:], strict=True):  # summed per sample: within tolerance
            torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("stacked", [False, True], ids=["own calls", "stacked"])
def test_requests_of_one_operator_and_dtype_share_launches_whatever_their_shapes(
    stacked, monkeypatch
):
    # GroupNormBackward of five geometries (HxW, C, groups, N all differing: five fusion
    # keys on the host devices) queued together: on a torch device one launch key, so
    # fewer launches than requests; each result aten's own call's (on the CPU bit for bit).
    # ``stacked``: the accelerators' stacked launch, forced on the CPU, takes the mix too
    # (one stack per row shape), its dgamma / dbeta within tolerance.
    if stacked:
        from opsched.devices.torch import group_norm_backward

        monkeypatch.setattr(group_norm_backward, "_own_call", lambda r: False)
    rng = np.random.default_rng(3)
    geometries = ((1, 4, 5, 2), (2, 8, 7, 4), (3, 4, 9, 1), (2, 16, 3, 4), (1, 8, 11, 2))
    requests = [_gnb_request(rng, *geometry) for geometry in geometries]
    outs, stats = _queued_together(requests)
    assert stats.launches < len(requests)
    for r, got in zip(requests, outs, strict=True):
        want = torch.ops.aten.native_group_norm_backward(*r, [True] * 3)
        assert torch.equal(got[0], want[0])  # dx: the framework's own call, bit for bit
        for a, b in zip(got[1:], want[1:], strict=True):
            if ON_TORCH_CPU and not stacked:
                assert torch.equal(a, b)
            else:  # a stacked launch sums dgamma / dbeta per sample itself
                torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-4)


def test_large_requests_split_across_streams_where_their_operator_allows():
    """GluBackward of at least ``split_min_bytes`` runs in parts on both idle streams;
    GroupNormBackward (its dgamma / dbeta reduce over every sample) runs whole, as aten's
    own call on its own tensors: the same bits."""
    rng = np.random.default_rng(5)
    g, x = (on_device(rand(rng, shape, F32)) for shape in ((64, 256), (64, 512)))
    dy, xn = (on_device(rand(rng, (4, 8, 1024), F32)) for _ in range(2))
    mean = on_device(rand(rng, (4, 4), F32))
    rstd = on_device((rng.random((4, 4)) + 0.5).astype(F32))
    gnb = (dy, xn, mean, rstd, on_device(rand(rng, (8,), F32)), 4, 8, 1024, 4)
    config = {"fuse_max_bytes": 1 << 12, "split_min_bytes": 1 << 16}

    async def main():
        async with opsched.open_scheduler(device=DEVICE, streams=2, **config) as sched:
            glu = await sched.glu_backward(g, x)
            glu_launches = sched.statistics().launches
            norm = await sched.group_norm_backward(*gnb)
            return glu, glu_launches, norm, sched.statistics().launches - glu_launches

    glu, glu_launches, norm, norm_launches = asyncio.run(main())
    assert glu_launches == 2  # one part on each stream
    assert torch.equal(glu, torch.ops.aten.glu_backward(g, x, -1))
    assert norm_launches == 1
    want = torch.ops.aten.native_group_norm_backward(*gnb, [True] * 3)
    for got, expected in zip(norm, want, strict=True):
        assert torch.equal(got, expected)


def test_graph_with_tensor_constants_returns_tensors():
    rng = np.random.default_rng(3)
    x, dy, gamma, mean, rstd = (on_device(a) for a in gn_inputs(rng, (2, 3, 8), F32))
    gate = on_device(rand(rng, (2, 3, 16), F32))
    graph = opsched.Graph()
    out = graph.glu_backward(graph.group_norm_grad(x, dy, gamma, mean, rstd), gate)

    async def main():
        async with opsched.open_scheduler(device=DEVICE) as sched:
            return await sched.run(graph, [out])

    (result,) = asyncio.run(main())
    assert isinstance(result, torch.Tensor) and result.shape == (2, 3, 16)
    # the chain's value: the framework's own calls, one after the other
    from opsched.devices.torch import aten as torch_ops

    expected = torch.ops.aten.glu_backward(
        torch_ops.group_norm_grad(x, dy, gamma, mean, rstd), gate, -1
    )
    assert torch.equal(result, expected)


def test_a_graph_node_shares_a_launch_with_callers_requests_of_its_operator():
    # a graph's GluBackward node and callers' GluBackward requests of another shape, queued
    # together: one launch key on a torch device, so they share launches (and each gets
    # the framework's own call's bits)
    rng = np.random.default_rng(9)
    gate = on_device(rand(rng, (4, 16), F32))
    graph = opsched.Graph()
    node = graph.glu_backward(on_device(rand(rng, (4, 8), F32)), gate)
    calls = [
        (on_device(rand(rng, (2, 32), F32)), on_device(rand(rng, (2, 64), F32))) for _ in range(4)
    ]

    async def main():
        async def all_of(sched):
            return await asyncio.gather(
                sched.run(graph, [node]), *(sched.glu_backward(g, x) for g, x in calls)
            )

        async with opsched.open_scheduler(device=DEVICE, streams=1) as sched:
            outs = await beside_a_ready_task(all_of(sched))  # (queued: none runs at submit)
            return outs, sched.statistics()

    outs, stats = asyncio.run(main())
    assert stats.launches == 1  # the node among the requests
    for (g, x), got in zip(calls, outs[1:], strict=True):
        assert torch.equal(got, torch.ops.aten.glu_backward(g, x, -1))


def test_one_thread_per_stream_whatever_the_launches():
    rng = np.random.default_rng(4)
    work = [(rand(rng, (4, 8), F32), rand(rng, (4, 16), F32)) for _ in range(300)]

    before = set(threading.enumerate())  # (another test's default scheduler may live on)

    async def main():
        async with opsched.open_scheduler(device=DEVICE, streams=2) as sched:
            await asyncio.gather(*(sched.glu_backward(g, x) for g, x in work))
            new = [t for t in threading.enumerate() if t not in before]
            return [t.name for t in new], sched.statistics()

    threads, stats = asyncio.run(main())
    assert sorted(threads) == ["opsched-stream-0", "opsched-stream-1"]
    assert stats.completed == 300 and stats.pool.current == 0  # torch's memory, not a pool


@pytest.mark.parametrize(
    ("name", "error", "message"),
    [
        ("torch:gpu", ValueError, "expected torch:cpu, torch:cuda"),
        ("torch:cpu:1", ValueError, "torch:cpu takes no index"),
        ("torch:cuda:x", ValueError, "expected torch:cpu, torch:cuda"),
    ],
)
def test_bad_torch_device_names(name, error, message):
    async def main():
        async with opsched.open_scheduler(device=name):
            pass

    with pytest.raises(error, match=message):
        asyncio.run(main())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_cuda_device_is_a_clear_error():
    async def main():
        async with opsched.open_scheduler(device="torch:cuda"):
            pass

    with pytest.raises(ValueError, match=r"'torch:cuda': this machine has 0 cuda device\(s\)"):
        asyncio.run(main())


def test_without_torch_a_torch_device_says_how_to_install_it(tmp_path):
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import asyncio, opsched\n"
        "async def main():\n"
        "    async with opsched.open_scheduler(device='torch:cpu'):\n"
        "        pass\n"
        "try:\n"
        "    asyncio.run(main())\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
        "import numpy as np\n"  # and nothing else needed torch
        "print(opsched.sync.glu_backward(np.ones((2, 2), 'f4'), np.ones((2, 4), 'f4')).shape)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", "import opsched.sync\n" + code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "needs PyTorch, which is not installed; install it with pip install 'opsched[torch]'"
        in (proc.stdout)
    )
    assert "(2, 4)" in proc.stdout


STRESS = {"requests": 1500, "clients": 8, "sync_clients": 1, "templates": 64, "watchdog": 5.0}


def _stress(**options):
    import io

    from opsched.cli.stress import StressOptions, run_stress

    out = io.StringIO()
    return run_stress(StressOptions(device=DEVICE, **options), out), out.getvalue()


def test_stress_on_torch_cpu_checks_every_result_against_the_request_alone():
    # Each result must be bit-identical to its request launched alone on the device (batch
    # invariance) and within the tolerance (docs/operators.md) of the float64 oracle; faults,
    # deadlines, cancellation and bad input as on the numpy devices.
    status, text = _stress(**STRESS)
    assert status == 0, text
    assert "0 wrong" in text and "faulted" in text


@cpu_only
def test_stress_on_torch_cpu_fails_a_launch_whose_batches_change_bits(monkeypatch):
    from opsched.devices.torch import launchers

    real = launchers.LAUNCHERS["GluBackward"]

    def drifting(requests):
        real.launch(requests)
        if len(requests) > 1:  # batched requests move one ulp-ish away from their solo bits
            for r in requests:  # a tensor, or numpy for a request of numpy arrays
                out = r.tensors["out"]
                out *= 1 + 2**-20

    monkeypatch.setitem(launchers.LAUNCHERS, "GluBackward", real._replace(launch=drifting))
    status, text = _stress(**STRESS)
    assert status == 1, text
    assert "not bit-identical to the solo call" in text


@cpu_only
def test_a_launch_that_fails_only_fused_completes_every_request_and_says_so(monkeypatch):
    # every request runs fine alone: each gets its result from its own launch, and the
    # failed fused launch is a warning, not silence
    import structlog

    from opsched.devices.torch import launchers

    real = launchers.LAUNCHERS["GluBackward"]

    def fails_together(requests):
        if len(requests) > 1:
            raise RuntimeError("stacking went wrong")
        real.launch(requests)

    monkeypatch.setitem(launchers.LAUNCHERS, "GluBackward", real._replace(launch=fails_together))
    rng = np.random.default_rng(3)
    args = [(rand(rng, (3, 8), F32), rand(rng, (3, 16), F32)) for _ in range(12)]

    async def main():
        async with opsched.open_scheduler(device=DEVICE, streams=1) as sched:
            return await asyncio.gather(*(sched.glu_backward(g, x) for g, x in args))

    with structlog.testing.capture_logs() as logs:
        results = asyncio.run(main())
    for (g, x), r in zip(args, results, strict=True):
        assert_result(DEVICE, r, solo_glu(g, x, -1))
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert warnings
    for w in warnings:
        assert w["event"] == "a fused launch failed, then its requests ran alone"
        assert w["requests"] > 1 and "stacking went wrong" in w["error"]


def test_graph_placeholders_take_tensors_on_a_torch_device():
    rng = np.random.default_rng(5)
    gate = rand(rng, (2, 8), F32)
    graph = opsched.Graph()
    grad = graph.input((2, 4), F32, name="grad")
    out = graph.glu_backward(grad, gate)
    g = rand(rng, (2, 4), F32)

    async def main():
        async with opsched.open_scheduler(device=DEVICE) as sched:
            (as_tensor,) = await sched.run(graph, [out], inputs={grad: on_device(g)})
            (as_array,) = await sched.run(graph, [out], inputs={grad: g})
            with pytest.raises(ParamInvalidError, match="has shape"):
                await sched.run(graph, [out], inputs={grad: on_device(np.zeros((3, 4), F32))})
            return as_tensor, as_array

    as_tensor, as_array = asyncio.run(main())
    assert isinstance(as_tensor, torch.Tensor) and isinstance(as_array, np.ndarray)
    assert torch.equal(as_tensor, on_device(as_array))
    expected = torch.ops.aten.glu_backward(on_device(g), on_device(gate), -1)
    assert torch.equal(as_tensor, expected)


def test_demo_runs_on_the_torch_device(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "opsched", "demo", "--device", DEVICE],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("results bit-identical to solo launches: True") == 2


def test_the_accelerator_check_script_passes_on_the_torch_device(tmp_path):
    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "check_torch_device.py"
    proc = subprocess.run(
        [sys.executable, "-O", str(script), DEVICE, "--quick"],  # its checks survive -O
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("PASS  ") for line in lines) == 16
    assert not any(line.startswith("FAIL") for line in lines)
    assert proc.stdout.splitlines()[-1] == f"{DEVICE}: 16 passed, 0 failed"
    assert "the framework's call once per request" in proc.stdout  # the throughput ratio


def test_the_accelerator_check_script_reports_a_missing_device_without_a_traceback(tmp_path):
    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "check_torch_device.py"
    run = functools.partial(
        subprocess.run, capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path
    )
    absent = run([sys.executable, str(script), "torch:cuda:99"])  # no 100 GPUs here
    assert absent.returncode == 1 and "Traceback" not in absent.stderr, absent.stderr
    assert absent.stdout.startswith("FAIL  open torch:cuda:99: ValueError: "), absent.stdout
    wrong = run([sys.executable, str(script), "cpu"])  # not a torch device: a usage error
    assert wrong.returncode == 2 and "is not a torch device" in wrong.stderr, wrong.stderr
    usage = run([sys.executable, str(script), "--help"])
    assert usage.returncode == 0 and "torch:npu[:N]" in usage.stdout


def test_the_accelerator_check_script_fails_a_wrong_device_by_name(monkeypatch, capsys):
    import importlib.util

    from opsched.devices.torch import aten as torch_ops

    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "check_torch_device.py"
    spec = importlib.util.spec_from_file_location("check_torch_device", path)
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    real = torch_ops.glu_backward
    # the framework's own call, as the check sees it, now disagrees with the scheduler's
    monkeypatch.setattr(script.t, "glu_backward", lambda g, x, dim: real(g, x, dim) + 1)
    assert script.main(DEVICE, quick=True) == 1
    out = capsys.readouterr().out
    assert (
        "FAIL  three operators, fused, each = its own framework call: CheckFailed: "
        "GluBackward differs" in out
    )


class _FakeAllocator:
    """A stand-in for ``torch.cuda``'s allocator functions, recording each call."""

    def __init__(self):
        self.calls = []

    def memory_stats(self, device):
        self.calls.append("memory_stats")
        return {
            "reserved_bytes.all.current": 4096,
            "allocated_bytes.all.current": 1024,
            "segment.all.allocated": 2,
            "allocation.all.allocated": 7,
        }

    def reset_peak_memory_stats(self, device):
        self.calls.append("reset_peak_memory_stats")

    def empty_cache(self):
        self.calls.append("empty_cache")


def test_memory_statistics_come_from_the_framework_allocator(monkeypatch):
    from opsched.devices.torch.device import TorchDevice

    fake = _FakeAllocator()
    monkeypatch.setattr(TorchDevice, "_allocator", lambda self: fake)

    async def main():
        async with opsched.open_scheduler(device=DEVICE, streams=1) as sched:
            stats = sched.memory_stats()
            sched.reset_peak_stats()
            sched.empty_cache()
            return stats, sched.statistics().pool

    stats, pool = asyncio.run(main())
    assert stats["reserved_bytes.all.current"] == 4096
    assert (pool.current, pool.in_use, pool.misses, pool.hits) == (4096, 1024, 2, 5)
    assert fake.calls[:3] == ["memory_stats", "reset_peak_memory_stats", "empty_cache"]


@cpu_only
def test_on_the_cpu_torch_has_no_allocator_to_report():
    async def main():
        async with opsched.open_scheduler(device=DEVICE, streams=1) as sched:
            await sched.glu_backward(torch.ones(2, 4), torch.ones(2, 8))
            sched.reset_peak_stats()
            sched.empty_cache()
            return sched.memory_stats(), sched.statistics().pool

    stats, pool = asyncio.run(main())
    assert stats == {}
    assert (pool.current, pool.peak, pool.allocated, pool.misses) == (0, 0, 0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["FLOAT", "BFLOAT16"])
def test_the_aten_peers_write_into_given_outputs_the_bits_they_return_new(dtype):
    """The framework calls the kernel benchmark writes into outputs made once (``out=``:
    GluBackward's, GroupNormalizationGrad's) give there the bits they return in new
    tensors, and return those outputs."""
    from opsched.devices.torch import aten

    gen = torch.Generator().manual_seed(3)

    def t(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    g, x = t(4, 16), t(4, 32)
    out = torch.empty_like(x)
    assert aten.glu_backward(g, x, -1, out=out) is out
    assert torch.equal(out, aten.glu_backward(g, x, -1))

    gx, gdy, ggamma = t(2, 4, 8), t(2, 4, 8), t(2, 4, 8)
    gmean, grstd = t(2, 4), t(2, 4).abs() + 0.5
    dx = torch.empty_like(gx)
    assert aten.group_norm_grad(gx, gdy, ggamma, gmean, grstd, out=dx) is dx
    assert torch.equal(dx, aten.group_norm_grad(gx, gdy, ggamma, gmean, grstd))
