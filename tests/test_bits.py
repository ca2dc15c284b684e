"""Bit-identical means bits: -0.0 is not +0.0, and two NaN payloads differ."""

import numpy as np
import pytest

from opsched.cli.solo import same_bits
from tests.helpers import assert_same_bits


def _nan(payload: int) -> np.ndarray:
    return np.array([0x7FC00000 | payload], np.uint32).view(np.float32)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (np.array([0.0], np.float32), np.array([-0.0], np.float32)),
        (_nan(1), _nan(2)),
        (np.array([1.0], np.float32), np.array([1.0], np.float64)),
        (np.ones((2, 3), np.float16), np.ones((3, 2), np.float16)),
    ],
)
def test_values_that_compare_equal_or_close_are_not_the_same_bits(a, b):
    assert not same_bits(a, b)
    with pytest.raises(AssertionError):
        assert_same_bits(a, b)


def test_the_same_bits_and_tuples_with_none():
    a = np.array([0.5, -0.0, np.nan], np.float32)
    assert same_bits(a, a.copy()) and same_bits((a, None), (a.copy(), None))
    assert not same_bits((a, None), (a, a))
    assert_same_bits((a, None), (a.copy(), None))
    assert_same_bits(np.asfortranarray(np.eye(3)), np.eye(3))  # layout is not bits
