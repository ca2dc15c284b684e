"""Every check of docs/operators.md: its status, its message, and the order checks fire."""

from __future__ import annotations

import numpy as np
import pytest

from opsched import ParamInvalidError, ParamNullptrError, Status, aclnn
from tests.helpers import BF16

F32, F16, F64 = np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64)


def glu_args(shape=(2, 4, 6), dim=-1, dtype=F32):
    x = np.zeros(shape, dtype)
    d = dim % len(shape)
    g = np.zeros((*shape[:d], shape[d] // 2, *shape[d + 1 :]), dtype)
    return {"grad_out": g, "self": x, "dim": dim, "out": np.zeros(shape, dtype)}


def glu(**kw):
    return aclnn.glu_backward_get_workspace_size(kw["grad_out"], kw["self"], kw["dim"], kw["out"])


def gn_args(shape=(2, 3, 4, 5), dtype=F32):
    return {
        "x": np.zeros(shape, dtype),
        "dy": np.zeros(shape, dtype),
        "gamma": np.ones(shape, dtype),
        "mean": np.zeros(shape[:2], dtype),
        "rstd": np.ones(shape[:2], dtype),
        "dx": np.zeros(shape, dtype),
    }


def gn(**kw):
    return aclnn.group_norm_grad_get_workspace_size(**kw)


def expect(status: Status, call, *words: str) -> None:
    """Assert ``call`` raises exactly ``status`` with every word in its message."""
    cls = ParamNullptrError if status == Status.ERR_PARAM_NULLPTR else ParamInvalidError
    with pytest.raises(cls) as info:
        call()
    assert info.value.status == status
    assert type(info.value) is cls
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# ---------------------------------------------------------------- GluBackward, in
# docs/operators.md's order

NULL, INVALID = Status.ERR_PARAM_NULLPTR, Status.ERR_PARAM_INVALID


@pytest.mark.parametrize("name", ["grad_out", "self", "out"])
def test_glu_1_missing_tensor_is_nullptr(name):
    args = glu_args()
    args[name] = None
    expect(NULL, lambda: glu(**args), name, "None")


@pytest.mark.parametrize("dtype", [np.int32, np.float128 if hasattr(np, "float128") else np.int8])
def test_glu_2_self_dtype_outside_list(dtype):
    expect(INVALID, lambda: glu(**glu_args(dtype=np.dtype(dtype))), "self.dtype", "FLOAT16")


@pytest.mark.parametrize("name", ["grad_out", "out"])
def test_glu_2_dtype_differs_from_self(name):
    args = glu_args()
    args[name] = args[name].astype(F16)
    expect(INVALID, lambda: glu(**args), f"{name}.dtype is FLOAT16", "self.dtype is FLOAT")


@pytest.mark.parametrize("name", ["self", "grad_out", "out"])
def test_glu_3_more_than_8_dims(name):
    args = glu_args(shape=(2,) * 8)
    args[name] = np.zeros((2,) * 9, F32)
    expect(INVALID, lambda: glu(**args), f"{name} has 9 dims", "at most 8")


def test_glu_3_zero_dim_self():
    args = glu_args()
    args["self"] = np.zeros((), F32)
    expect(INVALID, lambda: glu(**args), "0-dimensional")


@pytest.mark.parametrize("dim", [3, -4, 100])
def test_glu_4_dim_out_of_range(dim):
    args = glu_args()
    args["dim"] = dim
    expect(INVALID, lambda: glu(**args), f"dim={dim}", "[-3, 2]")


def test_glu_5_odd_split():
    args = glu_args(shape=(2, 5, 4), dim=1)
    args["grad_out"] = np.zeros((2, 2, 4), F32)
    expect(INVALID, lambda: glu(**args), "self.shape[1] is 5", "even")


def test_glu_6_grad_out_shape():
    args = glu_args()
    args["grad_out"] = np.zeros((2, 4, 6), F32)
    expect(INVALID, lambda: glu(**args), "grad_out.shape is (2, 4, 6)", "(2, 4, 3)")


def test_glu_7_out_shape():
    args = glu_args()
    args["out"] = np.zeros((2, 4, 3), F32)
    expect(INVALID, lambda: glu(**args), "out.shape is (2, 4, 3)", "(2, 4, 6)")


def test_glu_order_nullptr_before_dtype():
    args = glu_args(dtype=np.dtype(np.int32))
    args["out"] = None
    expect(NULL, lambda: glu(**args), "out")


def test_glu_order_dtype_before_rank():
    args = glu_args()
    args["self"] = np.zeros((2,) * 9, np.int64)
    expect(INVALID, lambda: glu(**args), "dtype")


def test_glu_order_rank_before_dim():
    args = glu_args()
    args["out"] = np.zeros((1,) * 9, F32)
    args["dim"] = 7
    expect(INVALID, lambda: glu(**args), "out has 9 dims")


def test_glu_order_dim_before_odd_and_shapes():
    args = glu_args(shape=(3, 5))
    args["grad_out"] = np.zeros((7,), F32)
    args["dim"] = 2
    expect(INVALID, lambda: glu(**args), "dim=2")


def test_glu_order_odd_before_grad_shape():
    args = glu_args(shape=(4, 5), dim=0)
    args["dim"] = 1
    args["out"] = np.zeros((1,), F32)
    expect(INVALID, lambda: glu(**args), "must be even")


def test_glu_order_grad_shape_before_out_shape():
    args = glu_args()
    args["grad_out"] = np.zeros((1,), F32)
    args["out"] = np.zeros((1,), F32)
    expect(INVALID, lambda: glu(**args), "grad_out.shape")


@pytest.mark.parametrize("dim", [np.int64(-1), np.int8(2), np.uint32(2), 2])
def test_glu_any_integer_dim(dim):
    size, ex = glu(**{**glu_args(), "dim": dim})
    assert size >= 0 and ex.scalars["dim"] == 2


@pytest.mark.parametrize("dim", [1.0, "1", None, True, np.float32(1)])
def test_glu_dim_not_integer_is_type_error(dim):
    with pytest.raises(TypeError, match="dim must be an integer"):
        glu(**{**glu_args(), "dim": dim})


@pytest.mark.parametrize("name", ["grad_out", "self", "out"])
def test_glu_non_array_is_type_error(name):
    args = glu_args()
    args[name] = args[name].tolist()
    with pytest.raises(TypeError, match=f"{name} must be a numpy.ndarray, got builtins.list"):
        glu(**args)


@pytest.mark.parametrize("dtype", [F64, F32, F16, BF16])
def test_glu_every_dtype_accepted(dtype):
    size, ex = glu(**glu_args(dtype=dtype))
    # DOUBLE's numpy kernel carves block buffers; the compiled loops of the others need none
    # for contiguous operands
    assert (size > 0) == (dtype == F64) and not ex.repeatable


# ------------------------------------------------------- GroupNormalizationGrad, in order


@pytest.mark.parametrize("name", ["x", "dy", "gamma", "mean", "rstd", "dx"])
def test_gn_1_missing_tensor_is_nullptr(name):
    args = gn_args()
    args[name] = None
    expect(NULL, lambda: gn(**args), name, "None")


@pytest.mark.parametrize("name", ["x", "dy", "gamma", "mean", "rstd", "dx"])
def test_gn_2_dtype_outside_list(name):
    args = gn_args()
    args[name] = args[name].astype(F64)
    expect(INVALID, lambda: gn(**args), f"{name}.dtype is DOUBLE")


@pytest.mark.parametrize("name", ["dy", "gamma", "mean", "rstd", "dx"])
def test_gn_2_dtype_differs_from_x(name):
    args = gn_args()
    args[name] = args[name].astype(BF16)
    expect(INVALID, lambda: gn(**args), f"{name}.dtype is BFLOAT16", "x.dtype is FLOAT")


@pytest.mark.parametrize("name", ["x", "dy", "gamma", "dx"])
@pytest.mark.parametrize("ndim", [2, 9])
def test_gn_3_rank(name, ndim):
    args = gn_args()
    args[name] = np.zeros((2,) * ndim, F32)
    expect(INVALID, lambda: gn(**args), f"{name} has {ndim} dims", "3 to 8")


@pytest.mark.parametrize("name", ["mean", "rstd"])
def test_gn_3_stats_not_2d(name):
    args = gn_args()
    args[name] = np.zeros((2, 3, 1), F32)
    expect(INVALID, lambda: gn(**args), f"{name} has 3 dims", "expected 2")


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("dy", (2, 3, 4, 6)),
        ("gamma", (2, 3, 5, 4)),
        ("mean", (3, 2)),
        ("rstd", (2, 4)),
        ("dx", (2, 3, 20)),
    ],
)
def test_gn_4_shapes(name, shape):
    args = gn_args()
    args[name] = np.zeros(shape, F32)
    expect(INVALID, lambda: gn(**args), f"{name}.shape is {shape}")


def test_gn_order_nullptr_before_dtype():
    args = gn_args()
    args["x"] = args["x"].astype(np.int32)
    args["rstd"] = None
    expect(NULL, lambda: gn(**args), "rstd")


def test_gn_order_dtype_before_rank():
    args = gn_args()
    args["dx"] = np.zeros((2, 2), F16)
    expect(INVALID, lambda: gn(**args), "dx.dtype")


def test_gn_order_rank_before_shape():
    args = gn_args()
    args["dy"] = np.zeros((7, 7, 7), F32)
    args["mean"] = np.zeros((2,), F32)
    expect(INVALID, lambda: gn(**args), "mean has 1 dims")


def test_gn_order_dy_shape_before_dx_shape():
    args = gn_args()
    args["dy"] = np.zeros((1, 1, 1), F32)
    args["dx"] = np.zeros((1, 1, 1), F32)
    expect(INVALID, lambda: gn(**args), "dy.shape")


@pytest.mark.parametrize("name", ["x", "gamma", "mean"])
def test_gn_non_array_is_type_error(name):
    args = gn_args()
    args[name] = 3.0
    with pytest.raises(TypeError, match=f"{name} must be a numpy.ndarray, got builtins.float"):
        gn(**args)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_gn_every_dtype_accepted(dtype):
    size, _ = gn(**gn_args(dtype=dtype))
    assert size > 0


def test_signature_groups_keep_first_appearance_order_and_isolate_the_unsigned():
    from types import SimpleNamespace

    from opsched.ops._fusion import signature_groups

    a, b = ("a", (2, 3)), ("b", (4,))
    equal_a = ("a", (2, 3))  # equal to ``a``, another object: grouped by value
    sigs = [a, a, b, equal_a, None, None, a, b, b]  # two unsigned in a row: two groups
    requests = [SimpleNamespace(signature=s) for s in sigs]
    assert signature_groups(requests) == [[0, 1, 3, 6], [2, 7, 8], [4], [5]]
    assert signature_groups([]) == []
    # one signature throughout (the usual launch), by identity or by value: one group
    assert signature_groups([requests[0], requests[3], requests[6]]) == [[0, 1, 2]]
    assert signature_groups([requests[4], requests[5]]) == [[0], [1]]  # unsigned: alone
    # given a key, the unsigned group by it (a framework launch's shapes), the signed as before
    shapes = [None, None, None, None, (1,), (2,), None, None, None]
    for r, shape in zip(requests, shapes, strict=True):
        r.shape = shape
    unsigned = [*requests, SimpleNamespace(signature=None, shape=(1,))]
    by_shape = signature_groups(unsigned, key=lambda r: r.shape)
    assert by_shape == [[0, 1, 3, 6], [2, 7, 8], [4, 9], [5]]
