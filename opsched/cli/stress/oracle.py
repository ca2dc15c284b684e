"""The stress harness's independent oracle: each operator's SPEC formula in float64.

Written from ``SPEC.md`` alone, in plain numpy on float64 copies of the inputs: it shares no
code with the product's kernels (``opsched.kernels``), its plans or its reference kernels,
so a wrong kernel cannot also make the oracle wrong. Every verified result must be within
SPEC's tolerance of it (and bit-identical to the solo two-phase call, a separate check).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

__all__ = ["TOLERANCE", "expected", "within_tolerance"]

F64 = np.float64
_F16, _BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)

#: SPEC's (rtol, atol) per dtype; FLOAT16 GluBackward has its own (one fp16 rounding).
TOLERANCE = {
    np.dtype(np.float64): (1e-10, 1e-10),
    np.dtype(np.float32): (1e-4, 1e-4),
    _F16: (1e-2, 1e-3),
    _BF16: (2e-2, 2e-3),
}
_GLU_F16 = (1e-3, 1e-3)


def glu_backward(g: np.ndarray, x: np.ndarray, dim: int) -> np.ndarray:
    """SPEC: s = sigmoid(b); grad_a = g * s; grad_b = grad_a * (a - a * s)."""
    x64, g64 = x.astype(F64), g.astype(F64)
    a, b = np.split(x64, 2, axis=dim)
    s = 0.5 * (1.0 + np.tanh(0.5 * b))  # sigmoid, written another way than the kernels
    grad_a = g64 * s
    return np.concatenate([grad_a, grad_a * (a - a * s)], axis=dim)


def group_norm_grad(
    x: np.ndarray, dy: np.ndarray, gamma: np.ndarray, mean: np.ndarray, rstd: np.ndarray
) -> np.ndarray:
    """SPEC's GroupNormalizationGrad: per group (n, g) of M elements,
    dx = (rstd / M) * gamma * (M * dy - sum(dy * gamma) - xhat * sum(dy * gamma * xhat))."""
    n, g = x.shape[:2]
    m = int(np.prod(x.shape[2:]))
    xs, dys, gs = (a.astype(F64).reshape(n, g, m) for a in (x, dy, gamma))
    mu = mean.astype(F64).reshape(n, g, 1)
    r = rstd.astype(F64).reshape(n, g, 1)
    xhat = (xs - mu) * r
    s1 = (dys * gs).sum(axis=-1, keepdims=True)
    s2 = (dys * gs * xhat).sum(axis=-1, keepdims=True)
    return ((r / m) * gs * (m * dys - s1 - xhat * s2)).reshape(x.shape)


def group_norm_backward(
    grad_out: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    gamma: np.ndarray | None,
    n: int,
    c: int,
    hxw: int,
    group: int,
    mask: Any,
) -> tuple[np.ndarray | None, ...]:
    """The true gradient of y = gamma * xhat + beta over (N, C, HxW) in `group` groups."""
    d = c // group
    dy = grad_out.astype(F64).reshape(n, group, d, hxw)
    xs = x.astype(F64).reshape(n, group, d, hxw)
    mu = mean.astype(F64).reshape(n, group, 1, 1)
    r = rstd.astype(F64).reshape(n, group, 1, 1)
    w = np.ones(c) if gamma is None else gamma.astype(F64).reshape(c)
    w4 = w.reshape(1, group, d, 1)
    xhat = (xs - mu) * r
    dxhat = dy * w4
    m = d * hxw
    mean_dxhat = dxhat.sum(axis=(2, 3), keepdims=True) / m
    mean_dxhat_xhat = (dxhat * xhat).sum(axis=(2, 3), keepdims=True) / m
    dx = r * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat)
    stat_shape = gamma.shape if gamma is not None else (c,)
    dgamma = (dy * xhat).sum(axis=(0, 3)).reshape(stat_shape)
    dbeta = dy.sum(axis=(0, 3)).reshape(stat_shape)
    outs = (dx.reshape(x.shape), dgamma, dbeta)
    return tuple(o if wanted else None for o, wanted in zip(outs, mask, strict=True))


def expected(kind: str, args: tuple[Any, ...], dtype: np.dtype) -> Any:
    """The oracle's float64 result of a template's call (a graph follows its chain, each
    intermediate rounded to ``dtype`` as the product stores it)."""
    if kind == "glu":
        return glu_backward(*args)
    if kind == "gn":
        return group_norm_grad(*args)
    if kind == "gnb":
        return group_norm_backward(*args)
    x, dy, gamma, mean, rstd, gate = args
    intermediate = group_norm_grad(x, dy, gamma, mean, rstd).astype(dtype)
    return glu_backward(intermediate, gate, -1)


def _tolerance(kind: str, dtype: np.dtype) -> tuple[float, float]:
    if kind == "glu" and dtype == _F16:
        return _GLU_F16
    return TOLERANCE[dtype]


def within_tolerance(kind: str, got: Any, want: Any) -> bool:
    """Whether ``got`` (an array, or a tuple with Nones) is within SPEC's tolerance of the
    oracle's ``want``; absolute tolerance scaled by the largest magnitude of ``want`` (the
    vendor's tests compare outputs of unit scale), NaNs matching NaNs."""
    if isinstance(want, tuple):
        if not isinstance(got, tuple) or len(got) != len(want):
            return False
        return all(
            (g is None and w is None)
            or (g is not None and w is not None and within_tolerance(kind, g, w))
            for g, w in zip(got, want, strict=True)
        )
    if not isinstance(got, np.ndarray) or got.shape != want.shape:
        return False
    if not got.size:
        return True
    rtol, atol = _tolerance(kind, got.dtype)
    finite = np.abs(want[np.isfinite(want)])
    scale = max(1.0, float(finite.max(initial=0.0)))
    return bool(np.allclose(got.astype(F64), want, rtol, atol * scale, equal_nan=True))
