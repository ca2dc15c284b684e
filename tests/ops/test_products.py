"""Product profiles: every cell of the vendor's table, both statuses, and every surface."""

from __future__ import annotations

import asyncio
import io
import itertools
import subprocess
import sys

import numpy as np
import pytest

import opsched
import opsched.sync
from opsched import InnerError, ParamInvalidError, SchedulerConfig, aclnn
from opsched.cli.stress import StressOptions, run_stress
from opsched.core.engine import FEW_READY
from tests.helpers import BF16, assert_same_bits

# The vendor's table, written out again here (independent of opsched/ops/products.py).
ALL4 = {"DOUBLE", "FLOAT", "FLOAT16", "BFLOAT16"}
HALF3 = {"FLOAT", "FLOAT16", "BFLOAT16"}
TABLE = {
    "generic": (ALL4, HALF3, HALF3),
    "ascend-950": (ALL4, None, HALF3),
    "atlas-a3": (ALL4, None, HALF3),
    "atlas-a2": (ALL4, HALF3, HALF3),
    "atlas-200i-500-a2": (None, None, None),
    "atlas-inference": ({"DOUBLE", "FLOAT", "FLOAT16"}, None, None),
    "atlas-training": ({"DOUBLE", "FLOAT", "FLOAT16"}, None, {"FLOAT", "FLOAT16"}),
}
OPS = ("GluBackward", "GroupNormalizationGrad", "GroupNormBackward")
DTYPES = {"DOUBLE": np.float64, "FLOAT": np.float32, "FLOAT16": np.float16, "BFLOAT16": BF16}


def call(op, dtype, product):
    """One small call of ``op`` in ``dtype`` through the two-phase API on ``product``."""
    rng = np.random.default_rng(0)
    a = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    if op == "GluBackward":
        x = a(2, 4)
        return aclnn.glu_backward_get_workspace_size(
            a(2, 2), x, -1, np.empty_like(x), product=product
        )
    if op == "GroupNormalizationGrad":
        x = a(2, 2, 3)
        return aclnn.group_norm_grad_get_workspace_size(
            x, a(2, 2, 3), a(2, 2, 3), a(2, 2), a(2, 2) + 2, np.empty_like(x), product=product
        )
    x = a(2, 4, 3)
    return aclnn.group_norm_backward_get_workspace_size(
        a(2, 4, 3),
        x,
        a(2, 2),
        a(2, 2) + 2,
        a(4),
        2,
        4,
        3,
        2,
        [True] * 3,
        np.empty_like(x),
        np.empty(4, dtype),
        np.empty(4, dtype),
        product=product,
    )


@pytest.mark.parametrize("product", list(TABLE))
@pytest.mark.parametrize("column", range(3), ids=OPS)
def test_every_cell_of_the_table(product, column):
    op, supported = OPS[column], TABLE[product][column]
    having = [p for p, row in TABLE.items() if row[column] is not None and p != "generic"]
    for name, dtype in DTYPES.items():
        if supported is None:
            with pytest.raises(InnerError) as info:
                call(op, dtype, product)
            assert info.value.status == 561003
            message = str(info.value)
            assert f"{op} is not available on {product}" in message
            assert all(p in message for p in having)
        elif name not in supported:
            with pytest.raises(ParamInvalidError) as info:
                call(op, dtype, product)
            assert info.value.status == 161002
            message = str(info.value)
            if product == "generic":  # the default profile's messages are the operators' own
                assert "expected one of" in message
            else:
                listed = message.split(" takes ")[1].split(" [")[0].split(", ")
                assert f"on {product} {op} takes" in message and set(listed) == supported
        else:
            size, executor = call(op, dtype, product)
            assert size >= 0
            executor.destroy()


def test_a_missing_operator_is_561003_before_any_argument_check():
    with pytest.raises(InnerError) as info:
        aclnn.group_norm_grad_get_workspace_size(
            None, None, None, None, None, None, product="atlas-training"
        )
    assert info.value.status == 561003


def test_unknown_product_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown product 'atlas-z9'; expected one of \["):
        call("GluBackward", np.float32, "atlas-z9")
    with pytest.raises(ValueError, match="SchedulerConfig.product: unknown product 'x'"):
        SchedulerConfig(product="x")


def _float_stats_call(product, stat_dtype=np.float32, dtype=np.float16):
    rng = np.random.default_rng(1)
    dy, x = (rng.standard_normal((3, 4, 5)).astype(dtype) for _ in range(2))
    mean = rng.standard_normal((3, 2)).astype(stat_dtype)
    rstd = (rng.random((3, 2)) + 0.5).astype(stat_dtype)
    gamma = rng.standard_normal(4).astype(stat_dtype)
    outs = (np.empty_like(x), np.empty(4, stat_dtype), np.empty(4, stat_dtype))
    args = (dy, x, mean, rstd, gamma, 3, 4, 5, 2, [True] * 3)
    size, ex = aclnn.group_norm_backward_get_workspace_size(*args, *outs, product=product)
    aclnn.group_norm_backward(np.empty(size, np.uint8) if size else None, size, ex)
    return args, outs


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=str)
def test_ascend_950_takes_float_statistics_with_half_inputs(dtype):
    args, (dx, dgamma, dbeta) = _float_stats_call("ascend-950", dtype=dtype)
    assert dx.dtype == dtype and dgamma.dtype == np.float32 and dbeta.dtype == np.float32
    # the same values through the all-FLOAT path: the statistics agree to float precision
    f32 = [a.astype(np.float32) if isinstance(a, np.ndarray) else a for a in args]
    ref = (np.empty((3, 4, 5), np.float32), np.empty(4, np.float32), np.empty(4, np.float32))
    size, ex = aclnn.group_norm_backward_get_workspace_size(*f32, *ref)
    aclnn.group_norm_backward(np.empty(size, np.uint8), size, ex)
    np.testing.assert_allclose(dgamma, ref[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx.astype(np.float32), ref[0], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("product", ["generic", "atlas-a2", "atlas-a3", "atlas-training"])
def test_other_products_require_one_dtype_throughout(product):
    with pytest.raises(ParamInvalidError, match="mean.dtype is FLOAT but grad_out.dtype is"):
        _float_stats_call(product)


def test_ascend_950_mixed_statistics_must_agree():
    with pytest.raises(ParamInvalidError, match="mean.dtype is DOUBLE; on ascend-950"):
        _float_stats_call("ascend-950", stat_dtype=np.float64)


def test_scheduler_checks_every_surface_against_its_product():
    rng = np.random.default_rng(2)
    g, x = rng.standard_normal((2, 2)).astype(BF16), rng.standard_normal((2, 4)).astype(BF16)
    gn = [rng.standard_normal((2, 2, 3)).astype(np.float32) for _ in range(3)]
    stats = [rng.standard_normal((2, 2)).astype(np.float32) + 2 for _ in range(2)]

    async def main():
        async with opsched.open_scheduler(product="atlas-inference") as sched:
            with pytest.raises(ParamInvalidError, match="on atlas-inference GluBackward takes"):
                await sched.glu_backward(g, x)
            with pytest.raises(InnerError, match="not available on atlas-inference"):
                await sched.group_norm_grad(*gn, *stats)
            graph = opsched.Graph()  # built generic: the run checks it for the product
            node = graph.group_norm_grad(*gn, *stats, name="gn")
            with pytest.raises(InnerError, match="node 'gn': GroupNormalizationGrad is not"):
                await sched.run(graph, [node])
            ok = await sched.glu_backward(g.astype(np.float32), x.astype(np.float32))
            return ok, sched.statistics()

    ok, stats_ = asyncio.run(main())
    assert ok.shape == (2, 4) and stats_.rejected == 2 and stats_.completed == 1
    with (
        opsched.sync.open_scheduler(product="atlas-training") as sched,
        pytest.raises(ParamInvalidError, match="atlas-training"),
    ):
        sched.submit_glu_backward(g, x)


@pytest.mark.usefixtures("fused_batches")
def test_scheduler_fuses_float_statistics_bit_identically():
    rng = np.random.default_rng(3)
    requests = []
    # more concurrent requests than run at submit on their own (FEW_READY): one fused launch
    for n in itertools.islice(itertools.cycle((1, 2, 3, 2, 1, 4)), FEW_READY + 2):
        dy, x = (rng.standard_normal((n, 4, 5)).astype(np.float16) for _ in range(2))
        mean = rng.standard_normal((n, 2)).astype(np.float32)
        rstd = (rng.random((n, 2)) + 0.5).astype(np.float32)
        requests.append((dy, x, mean, rstd, rng.standard_normal(4).astype(np.float32), n, 4, 5, 2))

    async def main():
        async with opsched.open_scheduler(product="ascend-950") as sched:
            outs = await asyncio.gather(*(sched.group_norm_backward(*r) for r in requests))
            return outs, sched.statistics()

    outs, stats = asyncio.run(main())
    assert stats.requests_per_launch_max > 1
    for r, got in zip(requests, outs, strict=True):
        want = (np.empty_like(r[1]), np.empty(4, np.float32), np.empty(4, np.float32))
        size, ex = aclnn.group_norm_backward_get_workspace_size(
            *r, [True] * 3, *want, product="ascend-950"
        )
        aclnn.group_norm_backward(np.empty(size, np.uint8), size, ex)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype
            assert_same_bits(a, b)


def test_stress_on_atlas_training_rejects_exactly_what_the_table_says():
    out = io.StringIO()
    status = run_stress(
        StressOptions(requests=3000, clients=16, sync_clients=1, product="atlas-training"), out
    )
    text = out.getvalue()
    assert status == 0, text
    assert "product atlas-training" in text
    assert "unsupported 161002" in text  # the BFLOAT16 requests
    assert "unsupported 561003" in text  # GroupNormalizationGrad, missing there


def test_stress_catches_a_scheduler_that_ignores_the_product(monkeypatch):
    from opsched.core import engine as _engine
    from opsched.ops import products

    monkeypatch.setattr(_engine, "resolve_product", lambda *a: products.GENERIC)
    out = io.StringIO()
    status = run_stress(
        StressOptions(requests=1500, clients=8, sync_clients=1, product="atlas-training"), out
    )
    assert status == 1 and "wrong" in out.getvalue()


def test_products_command_lists_the_table(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "opsched", "products"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for product in TABLE:
        assert any(line.startswith(product + " ") for line in lines), product
    row = next(line for line in lines if line.startswith("atlas-training "))
    assert "DOUBLE, FLOAT, FLOAT16" in row and "not available" in row
    assert "(FLOAT statistics allowed)" in next(x for x in lines if x.startswith("ascend-950 "))


@pytest.mark.parametrize(
    ("product", "code", "text"),
    [
        ("atlas-training", 0, "results bit-identical to solo launches: True"),
        ("atlas-200i-500-a2", 2, "lacks the operators the demo runs"),
    ],
)
def test_demo_takes_a_product(tmp_path, product, code, text):
    proc = subprocess.run(
        [sys.executable, "-m", "opsched", "demo", "--product", product],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert text in proc.stdout


@pytest.mark.parametrize(
    ("soc", "product"),
    [
        ("Ascend910B2", "atlas-a2"),
        ("Ascend910_9391", "atlas-a3"),
        ("Ascend910A", "atlas-training"),
        ("Ascend310P3", "atlas-inference"),
        ("Ascend310B1", "atlas-200i-500-a2"),
        ("Ascend950PR", "ascend-950"),
        ("NVIDIA H200", None),
    ],
)
def test_the_product_is_read_from_the_framework_device_name(soc, product):
    from opsched.ops.products import product_of_device

    assert product_of_device(soc) == product


def test_a_reporting_device_sets_the_product_and_a_contradiction_is_an_error():
    from opsched._api import _new_engine
    from opsched.devices.host import CpuDevice

    def fake_npu(name, streams, split_min_bytes, **limits):  # the torch devices' own
        device = CpuDevice.create(streams, **limits)
        device.reported_product = "atlas-training"  # as torch_npu would report it
        return device

    async def main():
        import opsched._api as api

        real = api.make_device
        api.make_device = fake_npu
        try:
            engine = _new_engine(SchedulerConfig(streams=1), "cpu")
            assert engine.product.name == "atlas-training"  # generic: the device decides
            engine.close_now()
            with pytest.raises(ValueError, match="product='atlas-a2' contradicts the device"):
                _new_engine(SchedulerConfig(streams=1, product="atlas-a2"), "cpu")
        finally:
            api.make_device = real

    asyncio.run(main())


def test_a_refused_scheduler_leaves_no_thread_behind():
    import threading

    async def main():
        async with opsched.open_scheduler(trace="/nonexistent-dir/t.json", streams=2):
            pass

    before = set(threading.enumerate())  # other tests' default schedulers live on
    with pytest.raises(FileNotFoundError):
        asyncio.run(main())
    left = set(threading.enumerate()) - before
    assert not [t for t in left if t.name.startswith("opsched-stream")]
