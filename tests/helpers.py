"""Helpers shared by the tests: random operands, float64 goldens, the tolerances of
docs/operators.md."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from opsched.ops import GLU_BACKWARD, GROUP_NORM_BACKWARD, GROUP_NORM_GRAD

BF16 = np.dtype(ml_dtypes.bfloat16)
GLU_DTYPES = [np.dtype(np.float64), np.dtype(np.float32), np.dtype(np.float16), BF16]
GN_DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]

#: The operators by the short names the tests use, and by their methods' names.
_OPS = {
    "glu": GLU_BACKWARD,
    "gn": GROUP_NORM_GRAD,
    "gnb": GROUP_NORM_BACKWARD,
    **{op.method: op for op in (GLU_BACKWARD, GROUP_NORM_GRAD, GROUP_NORM_BACKWARD)},
}


def tolerance(dtype: np.dtype, op: str) -> tuple[float, float]:
    """(rtol, atol) of docs/operators.md for ``dtype`` (the operator's description's)."""
    return _OPS[op].tolerance(dtype)


def rand(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype, scale: float = 1.0):
    """Standard-normal values rounded into ``dtype``."""
    return (rng.standard_normal(shape) * scale).astype(dtype)


def glu_golden(grad_out: np.ndarray, x: np.ndarray, dim: int) -> np.ndarray:
    """GluBackward in float64 from the inputs' exact values: the description's oracle
    (written independently of the kernels)."""
    return GLU_BACKWARD.oracle(grad_out, x, dim)


def gn_golden(x, dy, gamma, mean, rstd) -> np.ndarray:
    """GroupNormalizationGrad in float64, one explicit group at a time, sums by
    ``math.fsum``: a second oracle, apart from the description's vectorised one (a test
    holds the two to each other)."""
    n, g = x.shape[:2]
    m = math.prod(x.shape[2:])
    out = np.empty(x.shape, np.float64)
    for i in range(n):
        for j in range(g):
            xs = x[i, j].astype(np.float64).ravel()
            d = dy[i, j].astype(np.float64).ravel()
            gm = gamma[i, j].astype(np.float64).ravel()
            mu, r = float(mean[i, j]), float(rstd[i, j])
            xhat = (xs - mu) * r
            s1 = math.fsum(d * gm)
            s2 = math.fsum(d * gm * xhat)
            out[i, j] = ((r / m) * gm * (m * d - s1 - xhat * s2)).reshape(x.shape[2:])
    return out


def assert_close(result: np.ndarray, golden: np.ndarray, dtype: np.dtype, op: str) -> None:
    """Assert ``result`` matches the float64 ``golden`` within docs/operators.md's tolerance."""
    rtol, atol = tolerance(dtype, op)
    np.testing.assert_allclose(result.astype(np.float64), golden, rtol=rtol, atol=atol)


def gn_inputs(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype):
    """Random ``(x, dy, gamma, mean, rstd)`` with statistics of the right shape."""
    x = rand(rng, shape, dtype)
    dy = rand(rng, shape, dtype)
    gamma = rand(rng, shape, dtype)
    mean = rand(rng, shape[:2], dtype, 0.5)
    rstd = (rng.random(shape[:2]) + 0.5).astype(dtype)
    return x, dy, gamma, mean, rstd


def assert_same_bits(got, want) -> None:
    """Bit-identical: one dtype and shape, every element's bits equal (unsigned views: -0.0
    and +0.0 differ, NaN payloads count); tuples of arrays and Nones element by element."""
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), (type(got), got)
        for g, w in zip(got, want, strict=True):
            assert (g is None) == (w is None), (g, w)
            if w is not None:
                assert_same_bits(g, w)
        return
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, f"dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"shape {got.shape} != {want.shape}"
    bits = np.dtype(f"u{got.dtype.itemsize}")
    g, w = np.ascontiguousarray(got).view(bits), np.ascontiguousarray(want).view(bits)
    differ = np.flatnonzero(g != w)
    assert not differ.size, (
        f"{differ.size} of {got.size} elements differ in their bits; first at flat index "
        f"{differ[0]}: {got.reshape(-1)[differ[0]]!r} vs {want.reshape(-1)[differ[0]]!r}"
    )
