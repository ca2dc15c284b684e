"""The compiled pieces of the kernels: exact conversions, sigmoid's error, position invariance.

The expectations are independent of the code under test: numpy's and ml_dtypes' own casts for
the conversions, float64 ``1 / (1 + numpy.exp(-b))`` for ``sigmoid``, and, for invariance, the
same request computed alone.
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
def _sigmoid_all(src, dst):  # type: ignore[no-untyped-def]
    for i in range(src.size):
        dst[i] = _jit.sigmoid(src[i])


def _every_float32_kind(rng: np.random.Generator) -> np.ndarray:
    """Random bit patterns (every exponent: subnormals, inf, NaN) and the rounding edges."""
    edges = np.array(
        [
            0.0,
            -0.0,
            np.inf,
            -np.inf,
            np.nan,
            65504,
            65519.99,
            65520,
            1e-8,
            2.98e-8,
            2.9802322e-08,
            5.9604645e-08,
            6.1035156e-05,
            6.1e-05,
            3.4e38,
            1e-45,
            1.1754942e-38,
        ],
        F32,
    )
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


def _sigmoid64(b: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-b.astype(np.float64)))


def test_sigmoid_within_four_ulp_where_it_is_normal():
    rng = np.random.default_rng(2)
    b = np.concatenate(
        [rng.uniform(-87, 30, 1 << 20), rng.uniform(-1, 1, 1 << 16), rng.uniform(-20, 20, 1 << 16)]
    ).astype(F32)
    got = np.empty_like(b)
    _sigmoid_all(b, got)
    want = _sigmoid64(b)
    ulp = np.spacing(want.astype(F32)).astype(np.float64)
    err = np.abs(got.astype(np.float64) - want) / ulp
    assert err.max() <= 4.0, (err.max(), b[err.argmax()])  # exp 2 ulp, the add, the division


def test_sigmoid_far_out_and_special_values():
    """Past about -88.4 the result is +0.0 (the true one is below 6e-39: inside FLOAT's atol);
    large b gives exactly 1; NaN stays NaN."""
    b = np.array(
        [np.nan, np.inf, -np.inf, 0.0, -0.0, 17.0, 20.0, 1e30, -88.3, -88.4, -88.8, -1e30], F32
    )
    got = np.empty_like(b)
    _sigmoid_all(b, got)
    assert np.isnan(got[0])
    assert list(got[1:8]) == [1.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.0]
    assert 0 < got[8] < 6.1e-39  # subnormal, as the true value
    assert list(got[9:]) == [0.0, 0.0, 0.0]
    assert np.all(np.abs(got[8:] - _sigmoid64(b[8:])) <= 6e-39)


def test_sigmoid32_is_the_compiled_sigmoid():
    b = _every_float32_kind(np.random.default_rng(4))
    got = np.empty_like(b)
    _sigmoid_all(b, got)
    n = b.size - b.size % 16
    assert_same_bits(_jit.sigmoid32(b[:n].reshape(-1, 16)).reshape(-1), got[:n])


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


@numba.njit
def _fma_all(a, b, c, out):  # type: ignore[no-untyped-def]
    for i in range(out.size):
        out[i] = _jit.fma(a[i], b[i], c[i])


def test_fma_rounds_once_in_every_lane():
    # (1 + 2**-12)**2 = 1 + 2**-11 + 2**-24: rounded alone, the product loses its 2**-24
    # (a tie, to even), and adding -(1 + 2**-11) gives 0; fused, 2**-24 remains. 37
    # elements: the vector body and the scalar tail both compute some.
    a = np.full(37, 1 + 2.0**-12, F32)
    c = np.full(37, -(1 + 2.0**-11), F32)
    out = np.empty(37, F32)
    _fma_all(a, a, c, out)
    assert (out == F32(2.0**-24)).all()
    assert (a * a + c == 0).all()  # numpy's two roundings: what fma must not do


def test_a_fork_while_a_kernel_compiles_leaves_the_child_a_free_lock():
    import os
    import threading
    import warnings

    from opsched.kernels import _jit

    held, release = threading.Event(), threading.Event()

    def compiling():  # another thread holds the lock across the fork
        with _jit._COMPILING:
            held.set()
            release.wait(10)

    thread = threading.Thread(target=compiling)
    thread.start()
    held.wait(10)
    try:
        with warnings.catch_warnings():  # (3.12 warns of a fork with threads running)
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: that thread is gone; its lock must not be
            os._exit(0 if _jit._COMPILING.acquire(timeout=2) else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        thread.join()
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("dtype", [F32, np.float16, ml_dtypes.bfloat16])
def test_addresses_are_each_array_s_own_data_address(dtype: type) -> None:
    """A table launch finds each request's operands by these addresses: each must be its
    array's own (numpy's ``__array_interface__``), in order, read-only arrays included."""
    kind = _jit.kind_of(np.dtype(dtype))
    assert kind is not None
    rng = np.random.default_rng(0)
    base = rand(rng, (6, 8), dtype)
    arrays = [base[1:3], np.frombuffer(base.tobytes(), dtype).reshape(6, 8), base[4:]]
    assert not arrays[1].flags.writeable

    def expected(found: list[np.ndarray]) -> tuple[int, ...]:
        return tuple(a.__array_interface__["data"][0] for a in found)

    assert _jit.addresses(kind, *arrays) == expected(arrays)
    floats = rand(rng, (6, 8), F32)
    five = [floats[1:3], rand(rng, (3,), F32), floats[5:], floats[:1], floats[3:4]]
    eight = [*arrays, *five]
    assert _jit.addresses_with_float32(kind, *eight) == expected(eight)
