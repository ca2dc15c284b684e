"""torch devices keep the operators' contract where the framework's own calls would not:
an output that overlaps an input, sparse tensors, GroupNormBackward's masked outputs."""

from __future__ import annotations

import asyncio
import functools

import numpy as np
import pytest

import opsched
import opsched.sync
from tests.helpers import assert_same_bits, rand
from tests.sched_helpers import TORCH_DEVICE, host, on_device, torch_device

torch = pytest.importorskip("torch")

DEVICE = TORCH_DEVICE


def _aliased(shape, dtype, kind, overlap):
    """``(grad_out, self, out)`` with ``out`` overlapping ``self``: the very array, or a
    view of the same buffer shifted by half a row."""
    rng = np.random.default_rng(sum(shape))
    rows, cols = shape
    buffer = rand(rng, (rows + 1, cols), dtype)
    x = buffer[:rows]
    if overlap == "same":
        out = x
    else:  # another view of the buffer, shifted by half a row
        out = buffer.reshape(-1)[cols // 2 : cols // 2 + rows * cols].reshape(shape)
    g = rand(rng, (rows, cols // 2), dtype)
    if kind == "tensor":
        base = on_device(buffer)
        x = base[:rows]
        out = x if overlap == "same" else base.view(-1)[cols // 2 : cols // 2 + rows * cols]
        out = out.view(shape)
        g = on_device(g)
    return g, x, out


def _bits(value):
    return host(value) if hasattr(value, "numpy") else np.asarray(value)


@pytest.mark.parametrize("overlap", ["same", "shifted"])
@pytest.mark.parametrize("kind", ["numpy", "tensor"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["FLOAT", "DOUBLE"])
@pytest.mark.parametrize("shape", [(4, 16), (64, 128)], ids=["small", "4096+"])
def test_an_out_that_overlaps_an_input_gets_the_inputs_values_before_the_call(
    shape, dtype, kind, overlap
):
    def fresh():
        return _aliased(shape, np.dtype(dtype), kind, overlap)

    g, x, _ = fresh()
    with opsched.sync.open_scheduler(device=DEVICE) as sched:  # the request, no overlap
        want = _bits(sched.glu_backward(g, x.clone() if kind == "tensor" else x.copy()))
    # a lone blocking call
    with opsched.sync.open_scheduler(device=DEVICE) as sched:
        g, x, out = fresh()
        assert_same_bits(_bits(sched.glu_backward(g, x, out=out)), want)

    async def main():
        async with opsched.open_scheduler(device=DEVICE) as sched:
            g, x, out = fresh()
            alone = _bits(await sched.glu_backward(g, x, out=out))
            calls = [fresh() for _ in range(6)]  # fused with each other
            fused = await asyncio.gather(*(sched.glu_backward(g, x, out=o) for g, x, o in calls))
        return alone, [_bits(r) for r in fused]

    alone, fused = asyncio.run(main())
    assert_same_bits(alone, want)
    for result in fused:
        assert_same_bits(result, want)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_tensor_is_refused_at_the_call_naming_its_argument(layout):
    def sparse(t):
        return t.to_sparse() if layout == "coo" else t.to_sparse_csr()

    ones = functools.partial(torch.ones, device=torch_device())
    g, x = ones(4, 8), ones(4, 16)
    dense = [ones(2, 4, 6) for _ in range(3)]
    stats = [ones(2, 4), ones(2, 4)]

    async def main():
        async with opsched.open_scheduler(device=DEVICE) as sched:
            for known in (False, True):  # a new call, then one of a geometry seen before
                if known:
                    await sched.glu_backward(g, x)
                    await sched.group_norm_grad(*dense, *stats)
                with pytest.raises(
                    TypeError,
                    match=rf"GluBackward: self is a tensor of layout "
                    rf"torch\.sparse_{layout}.*self\.to_dense\(\)",
                ):
                    await sched.glu_backward(g, sparse(x))
                with pytest.raises(TypeError, match=r"dy is a tensor of layout torch\.sparse_"):
                    await sched.group_norm_grad(dense[0], sparse(dense[1]), dense[2], *stats)
        return sched.statistics()

    stats_after = asyncio.run(main())
    assert stats_after.submitted == 2 and stats_after.rejected == 4
    with opsched.sync.open_scheduler(device=DEVICE) as sched:
        with pytest.raises(TypeError, match=r"grad_out is a tensor of layout torch\.sparse_"):
            sched.glu_backward(sparse(g), x)
        with pytest.raises(TypeError, match=r"grad_out is a tensor of layout torch\.sparse_"):
            sched.submit_glu_backward(sparse(g), x)
        assert sched.statistics().submitted == 0
