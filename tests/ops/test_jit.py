"""The compiled pieces of the kernels: exact conversions, expf's error, position invariance.

The expectations are independent of the code under test: numpy's and ml_dtypes' own casts for
the conversions, float64 ``numpy.exp`` for ``expf``, and, for invariance, the same request
computed alone.
"""

from __future__ import annotations

import ml_dtypes
import numba
import numpy as np
import pytest

from opsched.kernels import _jit
from tests.helpers import GLU_DTYPES, assert_same_bits, rand
from tests.ops.test_kernels import run_glu

F32, U16, U32 = np.float32, np.uint16, np.uint32


@numba.njit
def _load_all(kind_id, src, dst):  # type: ignore[no-untyped-def]
    for i in range(src.size):
        dst[i] = _jit.half_to_f32(src[i]) if kind_id == 0 else _jit.bf16_to_f32(src[i])


@numba.njit
def _store_half(src, dst):  # type: ignore[no-untyped-def]
    for i in range(src.size):
        dst[i] = _jit.f32_to_half(src[i])


@numba.njit
def _store_bf16(src, dst):  # type: ignore[no-untyped-def]
    for i in range(src.size):
        dst[i] = _jit.f32_to_bf16(src[i])


@numba.njit
def _exp_all(src, dst):  # type: ignore[no-untyped-def]
    for i in range(src.size):
        dst[i] = _jit.expf(src[i])


def _every_float32_kind(rng: np.random.Generator) -> np.ndarray:
    """Random bit patterns (every exponent: subnormals, inf, NaN) and the rounding edges."""
    edges = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 1e-8, 2.98e-8, 2.9802322e-08,
         5.9604645e-08, 6.1035156e-05, 6.1e-05, 3.4e38, 1e-45, 1.1754942e-38],
        F32,
    )  # fmt: skip
    bits = rng.integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(U32).view(F32)
    return np.concatenate([edges, -edges, bits, rand(rng, (1 << 16,), np.dtype(F32), 1e-4)])


@pytest.mark.parametrize(
    ("kind_id", "dtype"), [(0, np.float16), (1, ml_dtypes.bfloat16)], ids=["float16", "bfloat16"]
)
def test_every_half_pattern_loads_exactly(kind_id, dtype):
    h = np.arange(1 << 16, dtype=U16)
    got = np.empty(h.size, F32)
    _load_all(kind_id, h, got)
    want = h.view(dtype).astype(F32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert_same_bits(got[~nan], want[~nan])


def test_float32_stores_to_float16_round_to_nearest_even():
    x = _every_float32_kind(np.random.default_rng(0))
    got = np.empty(x.size, U16)
    _store_half(x, got)
    with np.errstate(all="ignore"):
        want = x.astype(np.float16).view(U16)
    nan = np.isnan(x)
    assert_same_bits(got[~nan], want[~nan])
    assert np.isnan(got[nan].view(np.float16)).all()


def test_float32_stores_to_bfloat16_as_ml_dtypes():
    x = _every_float32_kind(np.random.default_rng(1))
    got = np.empty(x.size, U16)
    _store_bf16(x, got)
    with np.errstate(all="ignore"):
        want = x.astype(ml_dtypes.bfloat16).view(U16)
    assert_same_bits(got, want)  # NaN too: ml_dtypes' quiet NaN with the sign kept


def test_expf_within_two_ulp_everywhere():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.uniform(-104, 89, 1 << 20), rng.uniform(-1, 1, 1 << 16)]).astype(F32)
    got = np.empty_like(x)
    _exp_all(x, got)
    want = np.exp(x.astype(np.float64))
    ok = (want > 1e-45) & (want < 3.4e38)  # representable results
    ulp = np.spacing(want[ok].astype(F32)).astype(np.float64)
    err = np.abs(got[ok].astype(np.float64) - want[ok]) / ulp
    assert err.max() <= 2.0, (err.max(), x[ok][err.argmax()])


def test_expf_special_values():
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 88.8, -104.0, 88.72, -103.9], F32)
    got = np.empty_like(x)
    _exp_all(x, got)
    assert np.isnan(got[0])
    assert list(got[1:6]) == [np.inf, 0.0, 1.0, 1.0, np.inf]
    assert got[6] == 0.0 and np.isfinite(got[7]) and 0 < got[8] < 1.2e-38


@pytest.mark.parametrize("dtype", [d for d in GLU_DTYPES if _jit.kind_of(d) is not None], ids=str)
def test_compiled_glu_bits_do_not_depend_on_position_or_length(dtype):
    """Vector body and scalar remainder of the loop compute the same bits: every element of a
    long launch equals the same element launched alone at any offset and length."""
    rng = np.random.default_rng(3)
    x = rand(rng, (2, 97), dtype, 6.0)
    g = rand(rng, (1, 97), dtype)
    whole = run_glu(g, x, 0)
    for start in range(0, 20):
        for length in (1, 3, 7, 8, 15, 16, 17, 33, 97 - start):
            stop = start + length
            part = run_glu(g[:, start:stop].copy(), x[:, start:stop].copy(), 0)
            assert_same_bits(part, whole[:, start:stop])
