"""The stress harness's verdicts: how far a correct result may lie from each operator's
float64 oracle.

The oracle is the operator description's (:meth:`Operator.oracle`): the contract's formula
in plain numpy on float64 copies of the inputs, sharing no code with the product's kernels
(``opsched.kernels``), its plans or its reference kernels, so a wrong kernel cannot also
make the oracle wrong. So are the vendor's tolerances (:meth:`Operator.tolerance`).

Two verdicts. :func:`within_tolerance` is the vendor's: its (rtol, atol) per dtype
(docs/operators.md), for devices whose kernels are not ours (torch's). :func:`within_bound` holds
opsched's own kernels (the ``cpu`` and ``reference`` devices) to what they promise: FLOAT, FLOAT16
and
BFLOAT16 computed in float32 and DOUBLE in float64, each output rounded once. Per element,

    |result - oracle| <= K * u * magnitude + (one rounding into the output dtype)

where ``u`` is the compute dtype's unit roundoff (2**-24, or 2**-53 for DOUBLE),
``magnitude`` is the formula evaluated on absolute values (every term the computation adds
or subtracts, so cancellation is accounted for), and ``K`` counts the roundings on the
longest chain of the operator, written down per operator below. The half types add the
final rounding, half a unit in the last place of the result (``eps / 2`` relative, or half
the smallest subnormal). A kernel off by 1e-4 relative (about 1,700 ``u``) fails it;
the vendor's FLOAT tolerance (1e-4) would pass it.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

__all__ = [
    "GLU_ROUNDINGS",
    "error_bound",
    "expected",
    "within_bound",
    "within_tolerance",
]

from opsched.ops import GLU_BACKWARD, GROUP_NORM_BACKWARD, GROUP_NORM_GRAD

F64 = np.float64
_F16, _BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)


def expected(kind: str, args: tuple[Any, ...], dtype: np.dtype) -> Any:
    """The oracle's float64 result of a template's call (a graph follows its chain, each
    intermediate rounded to ``dtype`` as the product stores it)."""
    if kind in _OPERATORS:
        return _OPERATORS[kind].oracle(*args)
    x, dy, gamma, mean, rstd, gate = args
    intermediate = GROUP_NORM_GRAD.oracle(x, dy, gamma, mean, rstd).astype(dtype)
    return GLU_BACKWARD.oracle(intermediate, gate, -1)


#: The operator of each kind of template (a graph chain's last is GluBackward).
_OPERATORS = {"glu": GLU_BACKWARD, "gn": GROUP_NORM_GRAD, "gnb": GROUP_NORM_BACKWARD}


def _tolerance(kind: str, dtype: np.dtype) -> tuple[float, float]:
    return _OPERATORS.get(kind, GLU_BACKWARD).tolerance(dtype)


def within_tolerance(kind: str, got: Any, want: Any) -> bool:
    """Whether ``got`` (an array, or a tuple with Nones) is within the vendor's tolerance
    (docs/operators.md) of the oracle's ``want``; absolute tolerance scaled by the largest
    magnitude of ``want`` (the vendor's tests compare outputs of unit scale), NaNs matching
    NaNs."""
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


# ------------------------------------------------------------------- our kernels' bound

#: GluBackward's roundings (K): sigmoid within 4 ulp (a tested property of the kernels'
#: float32 sigmoid; numpy's float64 exp within 1), then grad_a = g * s (one more) and
#: grad_b = grad_a * (a - a * s) (three more on a chain that reaches 7 in all). Bounded
#: by ``K * u * |g * s|`` for grad_a and ``K * u * |g * a * s|`` for grad_b; K = 16 keeps
#: the derivation's 7 with room for its second-order terms.
GLU_ROUNDINGS = 16
#: Sums are added in 32 lanes, folded in 5 levels, and the tail of under 32 elements added
#: in order: a chain of at most ceil(n / 32) + 36 roundings for n terms.
_LANES = 32


def _sum_chain(n: int) -> int:
    return -(-n // _LANES) + 36


def _unit(dtype: np.dtype) -> float:
    """The unit roundoff of the dtype a kernel computes ``dtype`` in."""
    return 2.0**-53 if dtype == np.float64 else 2.0**-24


def _sigmoid(b: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * b))


def _glu_bound(
    g: np.ndarray, x: np.ndarray, dim: int, u: float, dg: np.ndarray | None = None
) -> np.ndarray:
    """GluBackward's bound before the output's rounding; ``dg``: how far the product's
    ``grad_out`` may lie from ``g`` (a graph's intermediate), propagated to first order."""
    a, b = np.split(x.astype(F64), 2, axis=dim)
    g64 = np.abs(g.astype(F64))
    s = _sigmoid(b)
    bound_a = GLU_ROUNDINGS * u * g64 * s
    bound_b = GLU_ROUNDINGS * u * g64 * np.abs(a) * s
    if dg is not None:
        bound_a = bound_a + dg * s
        bound_b = bound_b + dg * np.abs(a) * s * (1.0 - s)
    return np.concatenate([bound_a, bound_b], axis=dim)


def _gn_bound(
    x: np.ndarray, dy: np.ndarray, gamma: np.ndarray, mean: np.ndarray, rstd: np.ndarray
) -> np.ndarray:
    """GroupNormalizationGrad's bound before the output's rounding: ``(rstd / M) * |gamma|
    * (M |dy| + S1 + |xhat| S2)`` with ``S1 = sum |dy gamma|``, ``S2 = sum |dy gamma xhat|``
    over the group, times K = (the sums' chain) + 8: each term of S1 / S2 is one or four
    roundings, the bracket three more, the outer factor three."""
    n, g = x.shape[:2]
    m = int(np.prod(x.shape[2:]))
    dys, gs = (np.abs(a.astype(F64).reshape(n, g, m)) for a in (dy, gamma))
    mu = mean.astype(F64).reshape(n, g, 1)
    r = np.abs(rstd.astype(F64).reshape(n, g, 1))
    xhat = np.abs((x.astype(F64).reshape(n, g, m) - mu) * r)
    s1 = (dys * gs).sum(axis=-1, keepdims=True)
    s2 = (dys * gs * xhat).sum(axis=-1, keepdims=True)
    magnitude = (r / max(m, 1)) * gs * (m * dys + s1 + xhat * s2)
    return ((_sum_chain(m) + 8) * _unit(x.dtype) * magnitude).reshape(x.shape)


def _gnb_bound(
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
    """GroupNormBackward's bounds before the outputs' rounding.

    Per channel row k, ``DS = sum |dy|`` and ``DX = sum |dy x|`` (the kernels sum
    ``dy * x`` and subtract ``mean * sum dy``: cancellation scales with ``|x|``, not
    ``|x - mean|``). ``dx`` is ``A dy + B x + C`` from per-group coefficients:
    magnitude ``rstd |gamma dy| + rstd^2 (|x| + |mean|) C2 + rstd C1``, with ``C1 = sum_k
    |gamma_k| DS_k / M`` and ``C2 = sum_k |gamma_k| rstd (DX_k + |mean| DS_k) / M`` over
    the group's channels; K = (a row's sum chain) + (channels per group) + 12. ``dgamma``
    and ``dbeta`` add the rows over the samples in order: magnitudes ``sum_n rstd (DX +
    |mean| DS)`` and ``sum_n DS``, K = (a row's sum chain) + N + 6.
    """
    u = _unit(x.dtype)
    d = c // group
    dy = np.abs(grad_out.astype(F64).reshape(n, group, d, hxw))
    xs = np.abs(x.astype(F64).reshape(n, group, d, hxw))
    mu = np.abs(mean.astype(F64).reshape(n, group, 1, 1))
    r = np.abs(rstd.astype(F64).reshape(n, group, 1, 1))
    w = np.ones(c) if gamma is None else np.abs(gamma.astype(F64).reshape(c))
    w4 = w.reshape(1, group, d, 1)
    ds = dy.sum(axis=3, keepdims=True)  # (n, group, d, 1)
    dx_sums = (dy * xs).sum(axis=3, keepdims=True)
    per_row = r * (dx_sums + mu * ds)
    m = max(d * hxw, 1)
    c1 = (w4 * ds).sum(axis=2, keepdims=True) / m
    c2 = (w4 * per_row).sum(axis=2, keepdims=True) / m
    chain = _sum_chain(hxw)
    dx = (chain + d + 12) * u * (r * w4 * dy + r * r * (xs + mu) * c2 + r * c1)
    stat_shape = gamma.shape if gamma is not None else (c,)
    dgamma = (chain + n + 6) * u * per_row.sum(axis=0).reshape(stat_shape)
    dbeta = (chain + n + 6) * u * ds.sum(axis=0).reshape(stat_shape)
    outs = (dx.reshape(x.shape), dgamma, dbeta)
    return tuple(o if wanted else None for o, wanted in zip(outs, mask, strict=True))


def _rounding(want: np.ndarray, dtype: np.dtype) -> np.ndarray | float:
    """How far one rounding into ``dtype`` may move a value near ``want``: nothing to add
    for FLOAT and DOUBLE (computed in that dtype, their K counts it)."""
    if dtype in (np.dtype(np.float32), np.dtype(np.float64)):
        return 0.0
    info = ml_dtypes.finfo(dtype) if dtype == _BF16 else np.finfo(dtype)
    return float(info.eps) / 2 * np.abs(want) + float(info.smallest_subnormal) / 2


def error_bound(kind: str, args: tuple[Any, ...], dtype: np.dtype, want: Any) -> Any:
    """Per element, how far opsched's own kernels may put a template's result from the
    oracle's ``want`` (:func:`expected`): an array, or a tuple with Nones like ``want``."""
    if kind == "glu":
        g, x, dim = args
        return _glu_bound(g, x, dim, _unit(dtype)) + _rounding(want, dtype)
    if kind == "gn":
        return _gn_bound(*args) + _rounding(want, dtype)
    if kind == "gnb":
        bounds = _gnb_bound(*args)
        return tuple(
            None if b is None else b + _rounding(w, dtype)
            for b, w in zip(bounds, want, strict=True)
        )
    # a graph: the GLU of a group norm's result rounded to dtype; the product's rounded
    # intermediate may lie its own bound, and a rounding each way, from the oracle's
    x, dy, gamma, mean, rstd, gate = args
    intermediate = GROUP_NORM_GRAD.oracle(x, dy, gamma, mean, rstd)
    rounding = _rounding(intermediate, dtype)
    if isinstance(rounding, float):  # FLOAT: stored as computed, rounded once from float64
        rounding = _unit(dtype) * np.abs(intermediate)
    moved = _gn_bound(x, dy, gamma, mean, rstd) + 2 * rounding
    rounded = intermediate.astype(dtype)
    return _glu_bound(rounded, gate, -1, _unit(dtype), moved) + _rounding(want, dtype)


def within_bound(got: Any, want: Any, bound: Any) -> bool:
    """Whether ``got`` (an array, or a tuple with Nones) lies within ``bound`` of the
    oracle's ``want`` everywhere, NaNs matching NaNs (:func:`error_bound`)."""
    if isinstance(want, tuple):
        if not isinstance(got, tuple) or len(got) != len(want):
            return False
        return all(
            (g is None and w is None) or (g is not None and w is not None and within_bound(g, w, b))
            for g, w, b in zip(got, want, bound, strict=True)
        )
    if not isinstance(got, np.ndarray) or got.shape != want.shape:
        return False
    if not got.size:
        return True
    got64 = got.astype(F64)
    nan = np.isnan(want)
    if not np.array_equal(np.isnan(got64), nan):
        return False
    # (a NaN difference fails ``<=``: where both are NaN, ``nan`` lets it through)
    return bool(((np.abs(got64 - want) <= bound) | nan).all())
