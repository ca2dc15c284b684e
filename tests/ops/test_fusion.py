"""The fused launches' shared helpers: gathering a group's operands into a launch's rows."""

from __future__ import annotations

import numpy as np
import pytest

from opsched.ops._base import may_overlap
from opsched.ops._fusion import gather_into
from tests.helpers import BF16, rand

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)


def _rows(parts, dtype):
    """A launch's rows for ``parts``: a slice of a larger block, filled with a marker."""
    block = np.full((len(parts) * parts[0].shape[0] + 3, *parts[0].shape[1:]), 9, dtype)
    return block[1 : 1 + len(parts) * parts[0].shape[0]], block


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
@pytest.mark.parametrize("shape", [(4, 4), (8, 64), (2, 1024 + 8)], ids=str)
def test_gathered_parts_land_in_order_in_their_rows_only(dtype, shape):
    # small parts (joined as bytes) and parts over GATHER_JOIN_BYTES (numpy's concatenate)
    rng = np.random.default_rng(0)
    parts = [rand(rng, shape, dtype) for _ in range(37)]
    target, block = _rows(parts, dtype)
    gather_into(parts, target)
    np.testing.assert_array_equal(target, np.concatenate(parts))
    assert np.all(block[0] == 9) and np.all(block[-2:] == 9)  # nothing written around


def test_a_part_that_is_not_contiguous_is_gathered_by_value():
    rng = np.random.default_rng(1)
    parts = [rand(rng, (4, 4), F32) for _ in range(5)]
    parts[2] = rand(rng, (4, 8), F32)[:, ::2]  # a strided view among contiguous arrays
    parts[3] = np.asfortranarray(parts[3])
    target, _ = _rows(parts, F32)
    gather_into(parts, target)
    np.testing.assert_array_equal(target, np.concatenate(parts))


@pytest.mark.parametrize("part_dtype", [F16, np.dtype(np.int32)], ids=str)
def test_parts_of_another_dtype_are_converted_not_reinterpreted(part_dtype):
    # into float32 rows: their values, not their bytes read as float32 (int32: same size)
    rng = np.random.default_rng(2)
    parts = [(rand(rng, (4, 4), F32) * 100).astype(part_dtype) for _ in range(6)]
    target, _ = _rows(parts, F32)
    gather_into(parts, target)
    np.testing.assert_array_equal(target, np.concatenate(parts).astype(F32))


def test_read_only_parts_are_gathered():
    rng = np.random.default_rng(3)
    parts = [rand(rng, (2, 8), F32) for _ in range(4)]
    for p in parts:
        p.flags.writeable = False
    target, _ = _rows(parts, F32)
    gather_into(parts, target)
    np.testing.assert_array_equal(target, np.concatenate(parts))


def test_may_overlap_answers_as_numpy_bounds_check_without_it_for_owners():
    base = np.zeros(64, np.float32)
    other = np.zeros(64, np.float32)
    assert not may_overlap(base, other)  # two owners: apart
    assert may_overlap(base, base)  # the same array
    assert may_overlap(base[8:], base)  # a view of it (not an owner)
    assert may_overlap(base, base[:8])
    assert not may_overlap(base[:8], base[8:])  # views whose bounds do not meet
    assert not may_overlap(base, None)
    shared = np.frombuffer(base, np.float32)  # the same memory, owned by neither view
    assert may_overlap(shared, base)
