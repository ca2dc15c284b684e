"""GluBackward (``aclnnGluBackward``): checks in docs/operators.md's order, planning, kernels."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from opsched._errors import ParamInvalidError
from opsched.kernels._common import overlaps, rows_view
from opsched.kernels.glu import (
    glu_grid,
)
from opsched.ops._base import (
    ARRAY_TYPES,
    Operator,
    Parameter,
    Tensors,
    check_dtype,
    check_present,
    check_types,
    cuts,
    index_value,
)
from opsched.ops.products import OpSupport

__all__ = ["GLU_BACKWARD", "GluBackward"]

MAX_DIMS = 8


class GluBackward(Operator):
    """``out = glu_backward(grad_out, self, dim)``; see docs/operators.md, "GluBackward"."""

    name: ClassVar[str] = "GluBackward"
    method: ClassVar[str] = "glu_backward"
    summary: ClassVar[str] = (
        "GluBackward (``aclnnGluBackward``): the gradient of GLU; returns ``out``."
    )
    parameters: ClassVar[tuple[Parameter, ...]] = (
        Parameter(
            "grad_out", "np.ndarray", "the upstream gradient: self's shape, shape[dim] halved."
        ),
        Parameter("self", "np.ndarray", "the GLU input, split in halves a, b along dim."),
        Parameter("dim", "int", "the split dimension, in [-self.ndim, self.ndim - 1].", "-1"),
    )
    tensor_names: ClassVar[tuple[str, ...]] = ("grad_out", "self", "out")
    outputs: ClassVar[tuple[str, ...]] = ("out",)
    overlap_inputs: ClassVar[tuple[str, ...]] = ("grad_out", "self")
    dtypes: ClassVar[tuple[np.dtype, ...]] = tuple(
        np.dtype(d) for d in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16)
    )

    def check(
        self,
        tensors: Mapping[str, Any],
        scalars: Mapping[str, Any],
        *,
        allocate: bool,
        support: OpSupport | None = None,
    ) -> dict[str, Any]:
        op = self.name
        grad_out, x, out = tensors["grad_out"], tensors["self"], tensors["out"]
        required = {"grad_out": grad_out, "self": x}
        if not allocate:
            required["out"] = out
        check_present(op, **required)
        check_types(op, grad_out=grad_out, self=x, out=out)
        dim = index_value(op, "dim", scalars["dim"])
        # 2. dtypes: self's in the list; grad_out and out equal to it.
        allowed, product = self.allowed_dtypes(support)
        check_dtype(op, allowed, ("self", x), product=product, grad_out=grad_out, out=out)
        # 3. ranks.
        for name, t in (("self", x), ("grad_out", grad_out), ("out", out)):
            if t is not None and t.ndim > MAX_DIMS:
                msg = f"{op}: {name} has {t.ndim} dims; at most {MAX_DIMS} are supported"
                raise ParamInvalidError(msg)
        if x.ndim == 0:
            msg = f"{op}: self is 0-dimensional; it needs at least 1 dim to split"
            raise ParamInvalidError(msg)
        # 4. dim range.
        if not -x.ndim <= dim < x.ndim:
            msg = (
                f"{op}: dim={dim} is out of range [{-x.ndim}, {x.ndim - 1}] for self of "
                f"shape {x.shape}"
            )
            raise ParamInvalidError(msg)
        dim %= x.ndim
        # 5. an even split.
        if x.shape[dim] % 2:
            msg = (
                f"{op}: self.shape[{dim}] is {x.shape[dim]} (self shape {x.shape}); it must "
                "be even to split into two halves"
            )
            raise ParamInvalidError(msg)
        # 6. grad_out is self with dim halved.
        half = self.grad_shape(x.shape, dim)
        if grad_out.shape != half:
            msg = (
                f"{op}: grad_out.shape is {grad_out.shape}; expected {half} (self shape "
                f"{x.shape} halved along dim {dim})"
            )
            raise ParamInvalidError(msg)
        # 7. out is self's shape.
        if out is not None and out.shape != x.shape:
            msg = f"{op}: out.shape is {out.shape}; expected self's shape {x.shape}"
            raise ParamInvalidError(msg)
        return {"dim": dim}

    @staticmethod
    def grad_shape(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
        """``shape`` with ``shape[dim]`` halved: the shape of ``grad_out``."""
        return (*shape[:dim], shape[dim] // 2, *shape[dim + 1 :])

    # BEGIN GENERATED fast paths: scripts/gen_entry_points.py writes this; do not edit
    def call_tensors(
        self, args: Sequence[Any], out: Any
    ) -> tuple[Hashable | None, dict[str, Any] | None]:
        """The checks' cache key of a positional call and its tensors (generated)."""
        count = len(args)
        if count == 3:
            grad_out, self_, dim = args
        elif count == 2:
            grad_out, self_ = args
            dim = -1
        else:
            return super().call_tensors(args, out)
        kinds = ARRAY_TYPES
        if type(grad_out) in kinds and type(self_) in kinds and type(dim) is int:
            return (
                grad_out.shape,
                grad_out.dtype,
                self_.shape,
                self_.dtype,
                dim,
            ), {
                "grad_out": grad_out,
                "self": self_,
                "out": out,
            }
        return super().call_tensors(args, out)

    def arguments(self, args: Sequence[Any], out: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The argument dicts of a positional call (generated)."""
        count = len(args)
        if count == 3:
            grad_out, self_, dim = args
        elif count == 2:
            grad_out, self_ = args
            dim = -1
        else:
            return super().arguments(args, out)
        return (
            {
                "grad_out": grad_out,
                "self": self_,
                "out": out,
            },
            {"dim": dim},
        )

    def signature(self, tensors: Mapping[str, Any], scalars: Mapping[str, Any]) -> Hashable | None:
        """The checks' own cache key of a request (generated)."""
        grad_out = tensors["grad_out"]
        self_ = tensors["self"]
        out = tensors["out"]
        dim = scalars["dim"]
        if (
            type(grad_out) is np.ndarray
            and type(self_) is np.ndarray
            and (out is None or type(out) is np.ndarray)
            and type(dim) is int
        ):
            return (
                grad_out.shape,
                grad_out.dtype,
                self_.shape,
                self_.dtype,
                None if out is None else (out.shape, out.dtype),
                dim,
            )
        return super().signature(tensors, scalars)

    # END GENERATED fast paths

    def output_spec(
        self, tensors: Mapping[str, Any], scalars: Mapping[str, Any]
    ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        x = tensors["self"]
        return {"out": (x.shape, x.dtype)}

    def allocate(self, tensors: dict[str, Any], scalars: Mapping[str, Any]) -> None:
        if tensors["out"] is None:
            x = tensors["self"]  # the hot path: no intermediate dict
            tensors["out"] = np.empty(x.shape, x.dtype)

    #: FLOAT16 keeps one rounding of the float32 result: a tighter tolerance than the table's.
    tolerances: ClassVar[Mapping[np.dtype, tuple[float, float]]] = {
        **Operator.tolerances,
        np.dtype(np.float16): (1e-3, 1e-3),
    }

    def oracle(self, grad_out: np.ndarray, x: np.ndarray, dim: int = -1) -> np.ndarray:
        # s = sigmoid(b), written another way than the kernels; grad_a = g * s;
        # grad_b = grad_a * (a - a * s)
        x64, g64 = x.astype(np.float64), grad_out.astype(np.float64)
        a, b = np.split(x64, 2, axis=dim)
        s = 0.5 * (1.0 + np.tanh(0.5 * b))
        grad_a = g64 * s
        return np.concatenate([grad_a, grad_a * (a - a * s)], axis=dim)

    def example(self, rng: np.random.Generator, dtype: Any = np.float32) -> tuple[Any, ...]:
        # self 8x64, split along its last dim (dim left to its default)
        g = rng.standard_normal((8, 32)).astype(dtype)
        return g, rng.standard_normal((8, 64)).astype(dtype)

    # Fusion: a request is ``outer * half`` elementwise units. The fused launch is itself a
    # GluBackward of ``self`` shape (2, capacity) split along dim 0: row 0 gathers every
    # request's ``a`` half, row 1 its ``b`` half.

    def fusion(self, tensors: Tensors, scalars: Mapping[str, Any]) -> tuple[Hashable, int]:
        x = tensors["self"]
        outer, half = glu_grid(x.shape, scalars["dim"])
        return (self.name, x.dtype), outer * half

    def split(
        self, tensors: Tensors, scalars: Mapping[str, Any], parts: int
    ) -> list[tuple[dict[str, np.ndarray], dict[str, Any]]] | None:
        x, g, out = tensors["self"], tensors["grad_out"], tensors["out"]
        outer, half = glu_grid(x.shape, scalars["dim"])
        x3 = rows_view(x, (outer, 2, half))
        g3 = rows_view(g, (outer, 1, half))
        o3 = rows_view(out, (outer, 2, half))
        if x3 is None or g3 is None or o3 is None or overlaps(out, g, x) or parts < 2:
            return None
        if outer >= parts:  # whole rows per part
            views = [tuple(a[lo:hi] for a in (g3, x3, o3)) for lo, hi in cuts(outer, parts)]
        elif half >= parts:  # column ranges of every row
            views = [tuple(a[:, :, lo:hi] for a in (g3, x3, o3)) for lo, hi in cuts(half, parts)]
        else:
            return None
        return [(dict(zip(("grad_out", "self", "out"), v, strict=True)), {"dim": 1}) for v in views]


#: The GluBackward descriptor.
GLU_BACKWARD = GluBackward()
