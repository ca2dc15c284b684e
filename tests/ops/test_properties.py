"""Property tests: random shapes, dtypes, dims and layouts give either the right result or
exactly the status an independent reading of docs/operators.md predicts, never another exception.

Two kinds of strategy: bad-input ones (mostly invalid requests: each must get exactly the
predicted status) and valid ones (every example valid and non-empty: each compares values
with an independent float64 golden). The valid ones run more examples, so most examples of
this file compare values."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from opsched import AclnnError, Status, aclnn
from tests.helpers import (
    BF16,
    GLU_DTYPES,
    GN_DTYPES,
    assert_close,
    glu_golden,
    gn_golden,
)

ALL_DTYPES = [*GLU_DTYPES, np.dtype(np.int32), np.dtype(np.complex64)]
NULL, INVALID = Status.ERR_PARAM_NULLPTR, Status.ERR_PARAM_INVALID


@st.composite
def arrays(draw, shape, dtype):
    """An array of ``shape`` / ``dtype`` in a random layout, values in [-4, 4]."""
    layout = draw(st.sampled_from(["c", "f", "step", "reversed"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    values = np.asarray(rng.random(shape) * 8 - 4).astype(dtype)
    if layout == "f":
        return np.asfortranarray(values)
    if layout == "step" and values.ndim:
        big = np.zeros(tuple(2 * s for s in shape), dtype)
        view = big[tuple(slice(None, None, 2) for _ in shape)]
        view[...] = values
        return view
    if layout == "reversed" and values.ndim:
        rev = np.ascontiguousarray(values[::-1])
        return rev[::-1]
    return values


def glu_oracle(grad_out, x, dim, out):
    """GluBackward's checks (docs/operators.md), in order, written without the library."""
    if grad_out is None or x is None or out is None:
        return NULL
    if x.dtype not in GLU_DTYPES or grad_out.dtype != x.dtype or out.dtype != x.dtype:
        return INVALID
    if max(x.ndim, grad_out.ndim, out.ndim) > 8 or x.ndim == 0:
        return INVALID
    if not -x.ndim <= dim <= x.ndim - 1:
        return INVALID
    d = dim % x.ndim
    if x.shape[d] % 2:
        return INVALID
    if grad_out.shape != tuple(s // 2 if i == d else s for i, s in enumerate(x.shape)):
        return INVALID
    if out.shape != x.shape:
        return INVALID
    return Status.SUCCESS


@st.composite
def glu_requests(draw):
    ndim = draw(st.integers(0, 9))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(ALL_DTYPES))
    dim = draw(st.integers(-10, 10))
    d = dim % ndim if ndim else 0
    g_shape = tuple(s // 2 if i == d else s for i, s in enumerate(shape))
    if draw(st.booleans()) and draw(st.booleans()):  # a quarter: a wrong grad_out shape
        g_shape = (*g_shape, 1)
    g_dtype = dtype if draw(st.integers(0, 9)) else draw(st.sampled_from(ALL_DTYPES))
    o_shape = shape if draw(st.integers(0, 9)) else (*shape[:-1], 3)
    x = draw(arrays(shape, dtype))
    g = draw(arrays(g_shape, g_dtype)) if draw(st.integers(0, 30)) else None
    out = draw(arrays(o_shape, dtype)) if draw(st.integers(0, 30)) else None
    return g, x, dim, out


@given(glu_requests())
def test_glu_result_or_exact_status(req):
    g, x, dim, out = req
    want = glu_oracle(g, x, dim, out)
    try:
        size, ex = aclnn.glu_backward_get_workspace_size(g, x, dim, out)
        aclnn.glu_backward(np.empty(size, np.uint8) if size else None, size, ex)
    except AclnnError as err:
        assert err.status == want, (want, err)
        return
    assert want == Status.SUCCESS
    if x.size:
        assert_close(out, glu_golden(g, x, dim), x.dtype, "glu")


def gn_oracle(x, dy, gamma, mean, rstd, dx):
    """GroupNormalizationGrad's checks (docs/operators.md), in order."""
    tensors = [x, dy, gamma, mean, rstd, dx]
    if any(t is None for t in tensors):
        return NULL
    if any(t.dtype not in GN_DTYPES or t.dtype != x.dtype for t in tensors):
        return INVALID
    if any(not 3 <= t.ndim <= 8 for t in (x, dy, gamma, dx)) or mean.ndim != 2 or rstd.ndim != 2:
        return INVALID
    if dy.shape != x.shape or gamma.shape != x.shape or dx.shape != x.shape:
        return INVALID
    if mean.shape != x.shape[:2] or rstd.shape != x.shape[:2]:
        return INVALID
    return Status.SUCCESS


@st.composite
def gn_requests(draw):
    ndim = draw(st.integers(2, 9))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from([*GN_DTYPES, np.dtype(np.float64)]))

    def maybe_wrong(s):
        return s if draw(st.integers(0, 12)) else (*s, 2)

    x = draw(arrays(shape, dtype))
    dy = draw(arrays(maybe_wrong(shape), dtype))
    gamma = draw(arrays(maybe_wrong(shape), dtype if draw(st.integers(0, 12)) else BF16))
    mean = draw(arrays(maybe_wrong(shape[:2]), dtype))
    rstd = np.abs(draw(arrays(maybe_wrong(shape[:2]), dtype))) + dtype.type(0.5)
    dx = draw(arrays(maybe_wrong(shape), dtype)) if draw(st.integers(0, 30)) else None
    return x, dy, gamma, mean, rstd, dx


@given(gn_requests())
def test_gn_result_or_exact_status(req):
    want = gn_oracle(*req)
    x = req[0]
    try:
        size, ex = aclnn.group_norm_grad_get_workspace_size(*req)
        aclnn.group_norm_grad(np.empty(size, np.uint8) if size else None, size, ex)
    except AclnnError as err:
        assert err.status == want, (want, err)
        return
    assert want == Status.SUCCESS
    if x.size:
        assert_close(req[5], gn_golden(*req[:5]), x.dtype, "gn")


# ------------------------------------------------------------------- valid requests: values


@st.composite
def valid_glu_requests(draw):
    """Always a valid, non-empty GluBackward call: every example compares values."""
    ndim = draw(st.integers(1, 6))
    shape = list(draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim)))
    dim = draw(st.integers(-ndim, ndim - 1))
    shape[dim] *= 2
    dtype = draw(st.sampled_from(GLU_DTYPES))
    g_shape = tuple(s // 2 if i == dim % ndim else s for i, s in enumerate(shape))
    x = draw(arrays(tuple(shape), dtype))
    g = draw(arrays(g_shape, dtype))
    out = draw(arrays(tuple(shape), dtype))
    return g, x, dim, out


@settings(max_examples=400)  # most examples of this file compare values
@given(valid_glu_requests())
def test_valid_glu_requests_compare_values_every_time(req):
    g, x, dim, out = req
    assert glu_oracle(g, x, dim, out) == Status.SUCCESS and x.size  # by construction
    size, ex = aclnn.glu_backward_get_workspace_size(g, x, dim, out)
    aclnn.glu_backward(np.empty(size, np.uint8) if size else None, size, ex)
    assert_close(out, glu_golden(g, x, dim), x.dtype, "glu")


@st.composite
def valid_gn_requests(draw):
    """Always a valid, non-empty GroupNormalizationGrad call."""
    ndim = draw(st.integers(3, 6))
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=ndim, max_size=ndim)))
    dtype = draw(st.sampled_from(GN_DTYPES))
    x, dy, gamma = (draw(arrays(shape, dtype)) for _ in range(3))
    mean = draw(arrays(shape[:2], dtype))
    # rstd in [0.5, 1.5]: a normalised layer's; larger ones overflow FLOAT16 legitimately
    rstd = (np.abs(draw(arrays(shape[:2], dtype))) / 4 + 0.5).astype(dtype)
    dx = draw(arrays(shape, dtype))
    return x, dy, gamma, mean, rstd, dx


@settings(max_examples=400)
@given(valid_gn_requests())
def test_valid_gn_requests_compare_values_every_time(req):
    assert gn_oracle(*req) == Status.SUCCESS and req[0].size  # by construction
    size, ex = aclnn.group_norm_grad_get_workspace_size(*req)
    aclnn.group_norm_grad(np.empty(size, np.uint8) if size else None, size, ex)
    assert_close(req[5], gn_golden(*req[:5]), req[0].dtype, "gn")
