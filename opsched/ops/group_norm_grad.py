"""GroupNormalizationGrad (``aclnnGroupNormalizationGrad``): checks, planning, kernels.

The device formula equals the true gradient only when gamma is all ones (SPEC caveat).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from kernels.group_norm import (
    GroupNormPlan,
    group_norm_grad_fast,
    group_norm_grad_reference,
    plan_group_norm_grad,
)
from opsched._errors import ParamInvalidError
from opsched.ops._base import Operator, Tensors, check_dtype, check_present, check_types

__all__ = ["GROUP_NORM_GRAD", "GroupNormalizationGrad"]

MIN_DIMS, MAX_DIMS = 3, 8


class GroupNormalizationGrad(Operator):
    """``dx = group_norm_grad(x, dy, gamma, mean, rstd)``; see SPEC."""

    name: ClassVar[str] = "GroupNormalizationGrad"
    tensor_names: ClassVar[tuple[str, ...]] = ("x", "dy", "gamma", "mean", "rstd", "dx")
    outputs: ClassVar[tuple[str, ...]] = ("dx",)
    overlap_inputs: ClassVar[tuple[str, ...]] = ("x", "dy", "gamma")
    dtypes: ClassVar[tuple[np.dtype, ...]] = tuple(
        np.dtype(d) for d in (np.float32, np.float16, ml_dtypes.bfloat16)
    )

    def check(
        self, tensors: Mapping[str, Any], scalars: Mapping[str, Any], *, allocate: bool
    ) -> dict[str, Any]:
        op = self.name
        x = tensors["x"]
        inputs = {n: tensors[n] for n in self.tensor_names[:-1]}
        required = dict(inputs) if allocate else {**inputs, "dx": tensors["dx"]}
        check_present(op, **required)
        check_types(op, **tensors)
        others = {n: tensors[n] for n in self.tensor_names[1:]}
        check_dtype(op, self.dtypes, ("x", x), **others)
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

    def allocate(self, tensors: Tensors, scalars: Mapping[str, Any]) -> dict[str, np.ndarray]:
        x = tensors["x"]
        return {"dx": np.empty(x.shape, x.dtype)}

    def plan(self, tensors: Tensors, scalars: Mapping[str, Any], block: int) -> GroupNormPlan:
        return plan_group_norm_grad(
            tensors["x"], tensors["dy"], tensors["gamma"], tensors["dx"], block=block
        )

    def workspace_size(self, plan: GroupNormPlan) -> int:
        return plan.workspace_bytes

    def run(self, plan: GroupNormPlan, tensors: Tensors, workspace: np.ndarray | None) -> None:
        t = tensors
        group_norm_grad_fast(
            plan, t["x"], t["dy"], t["gamma"], t["mean"], t["rstd"], t["dx"], workspace
        )

    def reference(self, tensors: Tensors, scalars: Mapping[str, Any]) -> np.ndarray:
        t = tensors
        return group_norm_grad_reference(t["x"], t["dy"], t["gamma"], t["mean"], t["rstd"])


#: The GroupNormalizationGrad descriptor.
GROUP_NORM_GRAD = GroupNormalizationGrad()
