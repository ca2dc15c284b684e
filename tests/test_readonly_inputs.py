"""Read-only inputs (``np.load(mmap_mode="r")``, ``np.frombuffer``, ``flags.writeable =
False``) are valid on every surface: a kernel only reads its inputs. Outputs must be
writeable."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import opsched
import opsched.sync
from opsched import ParamInvalidError, aclnn
from tests.helpers import BF16, assert_same_bits, gn_inputs, rand

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]


def _inputs(op: str, dtype: np.dtype, seed: int = 0) -> tuple:
    """Writeable positional arguments of one small request of ``op``."""
    rng = np.random.default_rng(seed)
    if op == "glu":
        return rand(rng, (4, 16), dtype), rand(rng, (4, 32), dtype), -1
    if op == "gn":
        return gn_inputs(rng, (2, 4, 3, 5), dtype)
    x = rand(rng, (2, 8, 6), dtype)
    dy = rand(rng, (2, 8, 6), dtype)
    mean = rand(rng, (2, 4), dtype, 0.5)
    rstd = (rng.random((2, 4)) + 0.5).astype(dtype)
    gamma = rand(rng, (8,), dtype)
    return dy, x, mean, rstd, gamma, 2, 8, 6, 4


def _frozen(array: np.ndarray, how: str, tmp_path) -> np.ndarray:
    """A read-only array with ``array``'s values, made as a user's script would."""
    if how == "flag":
        frozen = array.copy()
        frozen.flags.writeable = False
    elif how == "frombuffer":
        frozen = np.frombuffer(array.tobytes(), array.dtype).reshape(array.shape)
    else:  # a memory-mapped .npy file opened read-only
        path = tmp_path / f"a{id(array)}.npy"
        np.save(path, array.view(np.uint16) if array.dtype == BF16 else array)
        frozen = np.load(path, mmap_mode="r")
        if array.dtype == BF16:
            frozen = frozen.view(BF16)
    assert not frozen.flags.writeable
    return frozen


def _read_only(args: tuple, how: str, tmp_path) -> tuple:
    return tuple(_frozen(a, how, tmp_path) if isinstance(a, np.ndarray) else a for a in args)


_NAMES = {"glu": "glu_backward", "gn": "group_norm_grad", "gnb": "group_norm_backward"}


def _two_phase(op: str, args: tuple):
    if op == "glu":
        out = np.empty(args[1].shape, args[1].dtype)
        size, ex = aclnn.glu_backward_get_workspace_size(*args, out)
        aclnn.glu_backward(np.empty(size, np.uint8) if size else None, size, ex)
        return out
    if op == "gn":
        out = np.empty(args[0].shape, args[0].dtype)
        size, ex = aclnn.group_norm_grad_get_workspace_size(*args, out)
        aclnn.group_norm_grad(np.empty(size, np.uint8) if size else None, size, ex)
        return out
    x, gamma, c = args[1], args[4], args[6]
    outs = (np.empty(x.shape, x.dtype), np.empty(gamma.shape, x.dtype), np.empty((c,), x.dtype))
    size, ex = aclnn.group_norm_backward_get_workspace_size(*args, (True, True, True), *outs)
    aclnn.group_norm_backward(np.empty(size, np.uint8) if size else None, size, ex)
    return outs


@pytest.mark.parametrize("how", ["flag", "frombuffer", "mmap"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["glu", "gn", "gnb"])
def test_read_only_inputs_compute_on_every_surface(op, dtype, how, tmp_path):
    args = _inputs(op, dtype)
    want = _two_phase(op, args)  # the same request on writeable copies
    frozen = _read_only(args, how, tmp_path)
    name = _NAMES[op]

    assert_same_bits(_two_phase(op, frozen), want)
    assert_same_bits(getattr(opsched.sync, name)(*frozen), want)
    with opsched.sync.open_scheduler() as sched:
        futures = [getattr(sched, f"submit_{name}")(*frozen) for _ in range(3)]
        for future in futures:
            assert_same_bits(future.result(), want)

    async def main():
        alone = await getattr(opsched, name)(*frozen)
        async with opsched.open_scheduler() as sched:
            fused = await asyncio.gather(*(getattr(sched, name)(*frozen) for _ in range(8)))
        return alone, fused

    alone, fused = asyncio.run(main())
    assert_same_bits(alone, want)
    for result in fused:
        assert_same_bits(result, want)


@pytest.mark.parametrize(("op", "name"), [("glu", "out"), ("gn", "dx")])
def test_a_read_only_output_is_refused_at_the_call(op, name):
    args = _inputs(op, np.dtype(np.float32))
    out = np.empty(args[1].shape if op == "glu" else args[0].shape, np.float32)
    out.flags.writeable = False
    call = getattr(opsched.sync, _NAMES[op])
    with pytest.raises(ParamInvalidError, match=f"{name} is read-only"):
        call(*args, out=out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["glu", "gn", "gnb"])
def test_read_only_numpy_inputs_on_torch_cpu(op, dtype, tmp_path):
    pytest.importorskip("torch")
    args = _inputs(op, dtype)
    frozen = _read_only(args, "flag", tmp_path)
    name = _NAMES[op]
    with opsched.sync.open_scheduler(device="torch:cpu") as sched:
        call = getattr(sched, name)
        want = call(*args)  # the same request on writeable arrays, on this device
        assert_same_bits(call(*frozen), want)
        futures = [getattr(sched, f"submit_{name}")(*frozen) for _ in range(4)]
        for future in futures:
            assert_same_bits(future.result(), want)
