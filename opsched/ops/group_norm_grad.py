"""GroupNormalizationGrad (``aclnnGroupNormalizationGrad``): checks, planning, kernels.

The device formula equals the true gradient only when gamma is all ones (docs/operators.md,
"GroupNormalizationGrad").
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from opsched._errors import ParamInvalidError
from opsched.kernels._common import overlaps, rows_view
from opsched.ops._base import (
    ARRAY_TYPES,
    Operator,
    Parameter,
    Tensors,
    check_dtype,
    check_present,
    check_types,
    cuts,
)
from opsched.ops.products import OpSupport

__all__ = ["GROUP_NORM_GRAD", "GroupNormalizationGrad"]

MIN_DIMS, MAX_DIMS = 3, 8


class GroupNormalizationGrad(Operator):
    """``dx = group_norm_grad(x, dy, gamma, mean, rstd)``; see docs/operators.md."""

    name: ClassVar[str] = "GroupNormalizationGrad"
    method: ClassVar[str] = "group_norm_grad"
    summary: ClassVar[str] = (
        "GroupNormalizationGrad (``aclnnGroupNormalizationGrad``); returns ``dx``."
    )
    parameters: ClassVar[tuple[Parameter, ...]] = (
        Parameter("x", "np.ndarray", "(N, G, *rest), 3 to 8 dims: FLOAT, FLOAT16 or BFLOAT16."),
        Parameter("dy", "np.ndarray", "the upstream gradient, x's shape and dtype."),
        Parameter("gamma", "np.ndarray", "already broadcast to x's shape."),
        Parameter("mean", "np.ndarray", "(N, G)."),
        Parameter("rstd", "np.ndarray", "(N, G)."),
    )
    tensor_names: ClassVar[tuple[str, ...]] = ("x", "dy", "gamma", "mean", "rstd", "dx")
    outputs: ClassVar[tuple[str, ...]] = ("dx",)
    overlap_inputs: ClassVar[tuple[str, ...]] = ("x", "dy", "gamma")
    dtypes: ClassVar[tuple[np.dtype, ...]] = tuple(
        np.dtype(d) for d in (np.float32, np.float16, ml_dtypes.bfloat16)
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
        x = tensors["x"]
        inputs = {n: tensors[n] for n in self.tensor_names[:-1]}
        required = dict(inputs) if allocate else {**inputs, "dx": tensors["dx"]}
        check_present(op, **required)
        check_types(op, **tensors)
        others = {n: tensors[n] for n in self.tensor_names[1:]}
        allowed, product = self.allowed_dtypes(support)
        check_dtype(op, allowed, ("x", x), product=product, **others)
        for name in ("x", "dy", "gamma", "dx"):
            t = tensors[name]
            if t is not None and not MIN_DIMS <= t.ndim <= MAX_DIMS:
                msg = f"{op}: {name} has {t.ndim} dims; expected {MIN_DIMS} to {MAX_DIMS}"
                raise ParamInvalidError(msg)
        for name in ("mean", "rstd"):
            if tensors[name].ndim != 2:
                msg = f"{op}: {name} has {tensors[name].ndim} dims; expected 2 (N, G)"
                raise ParamInvalidError(msg)
        expected = {"dy": x.shape, "gamma": x.shape, "mean": x.shape[:2], "rstd": x.shape[:2]}
        expected["dx"] = x.shape
        for name, shape in expected.items():
            t = tensors[name]
            if t is not None and t.shape != shape:
                msg = f"{op}: {name}.shape is {t.shape}; expected {shape} (x shape {x.shape})"
                raise ParamInvalidError(msg)
        return {}

    # BEGIN GENERATED fast paths: scripts/gen_entry_points.py writes this; do not edit
    def call_tensors(
        self, args: Sequence[Any], out: Any
    ) -> tuple[Hashable | None, dict[str, Any] | None]:
        """The checks' cache key of a positional call and its tensors (generated)."""
        count = len(args)
        if count == 5:
            x, dy, gamma, mean, rstd = args
        else:
            return super().call_tensors(args, out)
        kinds = ARRAY_TYPES
        if (
            type(x) in kinds
            and type(dy) in kinds
            and type(gamma) in kinds
            and type(mean) in kinds
            and type(rstd) in kinds
        ):
            return (
                x.shape,
                x.dtype,
                dy.shape,
                dy.dtype,
                gamma.shape,
                gamma.dtype,
                mean.shape,
                mean.dtype,
                rstd.shape,
                rstd.dtype,
            ), {
                "x": x,
                "dy": dy,
                "gamma": gamma,
                "mean": mean,
                "rstd": rstd,
                "dx": out,
            }
        return super().call_tensors(args, out)

    def arguments(self, args: Sequence[Any], out: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The argument dicts of a positional call (generated)."""
        count = len(args)
        if count == 5:
            x, dy, gamma, mean, rstd = args
        else:
            return super().arguments(args, out)
        return (
            {
                "x": x,
                "dy": dy,
                "gamma": gamma,
                "mean": mean,
                "rstd": rstd,
                "dx": out,
            },
            {},
        )

    def signature(self, tensors: Mapping[str, Any], scalars: Mapping[str, Any]) -> Hashable | None:
        """The checks' own cache key of a request (generated)."""
        x = tensors["x"]
        dy = tensors["dy"]
        gamma = tensors["gamma"]
        mean = tensors["mean"]
        rstd = tensors["rstd"]
        dx = tensors["dx"]
        if (
            type(x) is np.ndarray
            and type(dy) is np.ndarray
            and type(gamma) is np.ndarray
            and type(mean) is np.ndarray
            and type(rstd) is np.ndarray
            and (dx is None or type(dx) is np.ndarray)
        ):
            return (
                x.shape,
                x.dtype,
                dy.shape,
                dy.dtype,
                gamma.shape,
                gamma.dtype,
                mean.shape,
                mean.dtype,
                rstd.shape,
                rstd.dtype,
                None if dx is None else (dx.shape, dx.dtype),
            )
        return super().signature(tensors, scalars)

    # END GENERATED fast paths

    def output_spec(
        self, tensors: Mapping[str, Any], scalars: Mapping[str, Any]
    ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        x = tensors["x"]
        return {"dx": (x.shape, x.dtype)}

    def oracle(
        self, x: np.ndarray, dy: np.ndarray, gamma: np.ndarray, mean: np.ndarray, rstd: np.ndarray
    ) -> np.ndarray:
        # per group (n, g) of M elements: dx = (rstd / M) * gamma
        #   * (M * dy - sum(dy * gamma) - xhat * sum(dy * gamma * xhat))
        n, g = x.shape[:2]
        m = math.prod(x.shape[2:])
        xs, dys, gs = (a.astype(np.float64).reshape(n, g, m) for a in (x, dy, gamma))
        mu = mean.astype(np.float64).reshape(n, g, 1)
        r = rstd.astype(np.float64).reshape(n, g, 1)
        xhat = (xs - mu) * r
        s1 = (dys * gs).sum(axis=-1, keepdims=True)
        s2 = (dys * gs * xhat).sum(axis=-1, keepdims=True)
        return ((r / m) * gs * (m * dys - s1 - xhat * s2)).reshape(x.shape)

    def example(self, rng: np.random.Generator, dtype: Any = np.float32) -> tuple[Any, ...]:
        # x of 4 samples x 8 groups x 64 elements
        x, dy, gamma = (rng.standard_normal((4, 8, 64)).astype(dtype) for _ in range(3))
        mean = rng.standard_normal((4, 8)).astype(dtype)
        rstd = (rng.random((4, 8)) + 0.5).astype(dtype)
        return x, dy, gamma, mean, rstd

    # Fusion: a request is N * G groups of M elements; requests fuse when dtype and M match.
    # The fused launch is a GroupNormalizationGrad of x shape (capacity, 1, M).

    def fusion(self, tensors: Tensors, scalars: Mapping[str, Any]) -> tuple[Hashable, int]:
        x = tensors["x"]
        return (self.name, x.dtype, math.prod(x.shape[2:])), x.shape[0] * x.shape[1]

    def split(
        self, tensors: Tensors, scalars: Mapping[str, Any], parts: int
    ) -> list[tuple[dict[str, np.ndarray], dict[str, Any]]] | None:
        x = tensors["x"]
        rows, m = x.shape[0] * x.shape[1], math.prod(x.shape[2:])
        shapes = {"mean": (rows, 1), "rstd": (rows, 1)}
        views = {n: rows_view(tensors[n], shapes.get(n, (rows, 1, m))) for n in self.tensor_names}
        if any(v is None for v in views.values()) or rows < parts or parts < 2:
            return None
        if overlaps(tensors["dx"], x, tensors["dy"], tensors["gamma"]):
            return None
        return [
            ({n: v[lo:hi] for n, v in views.items() if v is not None}, {})
            for lo, hi in cuts(rows, parts)
        ]


#: The GroupNormalizationGrad descriptor.
GROUP_NORM_GRAD = GroupNormalizationGrad()
