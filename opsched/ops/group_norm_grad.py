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
from opsched.kernels.group_norm import (
    GroupNormPlan,
    group_norm_grad_fast,
    group_norm_grad_reference,
    make_group_norm_plan,
    plan_group_norm_grad,
)
from opsched.ops._base import (
    ARRAY_TYPES,
    FusedGeometry,
    Operator,
    Parameter,
    Tensors,
    check_dtype,
    check_present,
    check_types,
    cuts,
)
from opsched.ops._framework import (
    HostOperands,
    framework_deliver,
    framework_gather,
    framework_host,
    framework_laid_out,
    framework_output,
    framework_own,
    framework_rows,
    framework_scatter,
    framework_stacks,
)
from opsched.ops._fusion import deliver_each, gather_into, signature_groups
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

    def call_signature(self, args: Sequence[Any]) -> Hashable | None:
        # the hot path of every repeated call (five arrays): a flat tuple, no loop
        if len(args) == 5:
            x, dy, gamma, mean, rstd = args
            kinds = ARRAY_TYPES
            if (
                type(x) in kinds and type(dy) in kinds and type(gamma) in kinds
                and type(mean) in kinds and type(rstd) in kinds
            ):  # fmt: skip
                return (
                    x.shape, x.dtype, dy.shape, dy.dtype, gamma.shape, gamma.dtype,
                    mean.shape, mean.dtype, rstd.shape, rstd.dtype,
                )  # fmt: skip
        return super().call_signature(args)

    def arguments(self, args: Sequence[Any], out: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        if len(args) == 5:  # the hot path: no generic loop
            x, dy, gamma, mean, rstd = args
            return {"x": x, "dy": dy, "gamma": gamma, "mean": mean, "rstd": rstd, "dx": out}, {}
        return super().arguments(args, out)

    def signature(self, tensors: Mapping[str, Any], scalars: Mapping[str, Any]) -> Hashable | None:
        t = tensors
        x, dy, gamma, mean, rstd, dx = t["x"], t["dy"], t["gamma"], t["mean"], t["rstd"], t["dx"]
        arrays = (x, dy, gamma, mean, rstd)
        if any(type(a) is not np.ndarray for a in arrays):
            return super().signature(tensors, scalars)
        base = (x.shape, x.dtype, dy.shape, dy.dtype, gamma.shape, gamma.dtype,
                mean.shape, mean.dtype, rstd.shape, rstd.dtype)  # fmt: skip
        if dx is None:
            return base
        if type(dx) is not np.ndarray:
            return None
        return (*base, dx.shape, dx.dtype)

    def framework_call(self, torch: Any, tensors: Mapping[str, Any], s: Mapping[str, Any]) -> None:
        # No aten operator binds aclnnGroupNormalizationGrad: the formula of docs/operators.md in
        # torch operations, in float32, rounded once into dx's dtype (as the numpy reference).
        # Thirteen arithmetic calls on FLOAT rows (a tiny call costs 2-4 us whatever its
        # size, and on an accelerator each is a kernel launch): no conversion or reshape a
        # tensor does not need, temporaries reused in place. Each operation and its
        # operands' order are the contract's, so the bits are those of the plain expression.
        x, dx = tensors["x"], tensors["dx"]
        if not x.numel():
            return
        n, g = x.shape[0], x.shape[1]
        m = x.numel() // max(n * g, 1)
        rows, stats = (n, g, m), (n, g, 1)
        x_, dy_, gamma_ = (_f32(torch, tensors[k], rows) for k in ("x", "dy", "gamma"))
        mean_, rstd_ = (_f32(torch, tensors[k], stats) for k in ("mean", "rstd"))
        xhat = (x_ - mean_).mul_(rstd_)
        dyg = dy_ * gamma_
        # the CPU's serial sum adds a row in one order wherever it sits (framework_rows
        # keeps every call serial); an accelerator's reduction picks its blocks by the
        # whole call's shape, so there the order is a fixed tree of element-wise adds
        row_sums = _serial_sums if x.is_cpu else tree_sums
        s1 = row_sums(torch, dyg)
        s2 = row_sums(torch, dyg.mul_(xhat))  # (dy * gamma) * xhat
        inner = (dy_ * m).sub_(s1).sub_(xhat.mul_(s2))  # m * dy - s1 - xhat * s2
        scale = (rstd_ / m) * gamma_
        if dx.dtype == torch.float32 and dx.is_contiguous():
            torch.mul(scale, inner, out=dx.view(rows))
        else:  # rounded once into dx's dtype, written through its strides
            dx.copy_(scale.mul_(inner).view(dx.shape))

    def framework_batch(self, torch: Any, requests: Sequence[Any]) -> None:
        # A request is N * G rows of M elements; requests whose rows have one length stack
        # them as (rows, 1, M), whatever their N and G, and each call covers whole rows and
        # runs serially on the CPU (ops/_framework.py): a row's sums and dx are the same
        # wherever it sits.
        if len(requests) == 1 and self._lone_host(torch, requests[0]):
            return
        for stack in framework_stacks(
            torch, requests, _stack_key, _size, _STACK_MAX, _row, self.inputs
        ):
            x0 = stack[0][0].tensors["x"]
            m = _row(stack[0][0])
            counts = [
                len(group) * group[0].tensors["x"].shape[0] * group[0].tensors["x"].shape[1]
                for group in stack
            ]
            rows = sum(counts)
            stacked = {
                name: framework_gather(torch, stack, name, (rows, 1, size))
                for name, size in (("x", m), ("dy", m), ("gamma", m), ("mean", 1), ("rstd", 1))
            }
            stacked["dx"] = out = framework_output(torch, stack, "dx", (rows, 1, m), x0)
            self._rows_calls(torch, stacked, rows, m, x0.is_cpu)
            framework_scatter(torch, out, stack, "dx", counts, "x")

    def _rows_calls(
        self, torch: Any, stacked: dict[str, Any], rows: int, m: int, cpu: bool
    ) -> None:
        """The framework calls on ``stacked`` operands of ``rows`` rows of ``m``: one on the
        whole tensors (no slice to make), or one per :func:`framework_rows` range."""
        calls = framework_rows(torch, rows, m, cpu)
        if len(calls) == 1:
            self.framework_call(torch, stacked, {})
            return
        for a, b in calls:
            self.framework_call(torch, {k: v[a:b] for k, v in stacked.items()}, {})

    def _lone_host(self, torch: Any, request: Any) -> bool:
        """A lone request of numpy arrays (a blocking call's, say) in the stacked layout,
        ``(rows, 1, M)``, made straight from its arrays: the same calls on the same values
        as a stack of one (the same bits), without the stacking path's conversions, views
        and hand-off (a good part of a tiny request's launch). Says whether it ran the request
        (not: tensors, nothing to compute)."""
        t = request.tensors
        x = t["x"]
        if type(t) is not HostOperands or not x.size:
            return False
        rows = x.shape[0] * x.shape[1]
        m = x.size // rows
        call = {
            name: framework_laid_out(torch, t[name], (rows, 1, size))
            for name, size in (("x", m), ("dy", m), ("gamma", m), ("mean", 1), ("rstd", 1))
        }
        own = framework_own(torch, t, "dx")
        if own is not None:
            call["dx"] = dx = own.view(rows, 1, m)
        else:
            call["dx"] = dx = torch.empty((rows, 1, m), dtype=call["x"].dtype)
        self._rows_calls(torch, call, rows, m, True)
        framework_deliver(torch, t, "dx", framework_host(torch, dx).reshape(x.shape))
        return True

    def output_spec(
        self, tensors: Mapping[str, Any], scalars: Mapping[str, Any]
    ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        x = tensors["x"]
        return {"dx": (x.shape, x.dtype)}

    def plan(self, tensors: Tensors, scalars: Mapping[str, Any], block: int) -> GroupNormPlan:
        return plan_group_norm_grad(tensors["x"], tensors["dy"], tensors["gamma"], tensors["dx"])

    def run(self, plan: GroupNormPlan, tensors: Tensors, workspace: np.ndarray | None) -> None:
        t = tensors
        group_norm_grad_fast(
            plan, t["x"], t["dy"], t["gamma"], t["mean"], t["rstd"], t["dx"], workspace
        )

    def reference(self, tensors: Tensors, scalars: Mapping[str, Any]) -> np.ndarray:
        t = tensors
        return group_norm_grad_reference(t["x"], t["dy"], t["gamma"], t["mean"], t["rstd"])

    # Fusion: a request is N * G groups of M elements; requests fuse when dtype and M match.
    # The fused launch is a GroupNormalizationGrad of x shape (capacity, 1, M).

    def fusion(self, tensors: Tensors, scalars: Mapping[str, Any]) -> tuple[Hashable, int]:
        x = tensors["x"]
        return (self.name, x.dtype, math.prod(x.shape[2:])), x.shape[0] * x.shape[1]

    def fused_geometry(self, key: Hashable, capacity: int) -> FusedGeometry:
        dtype: np.dtype = key[1]  # type: ignore[index]
        m: int = key[2]  # type: ignore[index]
        rows: tuple[tuple[int, ...], np.dtype] = ((capacity, 1, m), dtype)
        stats: tuple[tuple[int, ...], np.dtype] = ((capacity, 1), dtype)
        arrays = {"x": rows, "dy": rows, "gamma": rows, "mean": stats, "rstd": stats, "dx": rows}
        return arrays, {}

    def fused_prefix(self, fused: Tensors, units: int) -> dict[str, np.ndarray]:
        return {name: array[:units] for name, array in fused.items()}

    def fused_plan(self, key: Hashable, capacity: int, block: int) -> GroupNormPlan:
        dtype: np.dtype = key[1]  # type: ignore[index]
        m: int = key[2]  # type: ignore[index]
        return make_group_norm_plan((capacity, 1, m), dtype)

    def gather(self, requests: Sequence[Any], fused: Tensors) -> list[int]:
        # Requests of one signature (same shapes) move together: one concatenate per
        # operand into their rows, seen in their own shape (no reshape per request).
        offsets = [0] * len(requests)
        offset = 0
        for members in signature_groups(requests):
            x = requests[members[0]].tensors["x"]
            rows = x.shape[0] * x.shape[1]
            start = offset
            for i in members:
                offsets[i] = offset
                offset += rows
            for name in ("x", "dy", "gamma", "mean", "rstd"):
                parts = [requests[i].tensors[name] for i in members]
                gather_into(parts, fused[name][start:offset])
        return offsets

    def scatter(self, requests: Sequence[Any], fused: Tensors, offsets: list[int]) -> None:
        # A signature group's rows are contiguous (the gather placed them so).
        dx_all = fused["dx"]
        for members in signature_groups(requests):
            shape = requests[members[0]].tensors["x"].shape
            start = offsets[members[0]]
            stop = start + len(members) * shape[0] * shape[1]
            deliver_each(requests, members, "dx", dx_all[start:stop].reshape(-1, *shape))

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


def _serial_sums(torch: Any, rows: Any) -> Any:
    """Each row's sum (the last axis), kept as an axis of one: aten's own reduction."""
    return rows.sum(-1, keepdim=True)


def tree_sums(torch: Any, rows: Any) -> Any:
    """Each row's sum (the last axis, kept as an axis of one) in a fixed order on any
    device: the upper half of the row added onto its lower half, element by element, until
    one element is left (an odd element out rides along to the next level). Every add is
    one element's, so a row's sum depends on its length alone, never on how many rows the
    call holds or where the row sits: batch invariance where the framework's reductions
    choose their blocks by the call's shape (CUDA's, NPU's). Pairwise, it is also more
    accurate than a running sum."""
    while rows.shape[-1] > 1:
        m = rows.shape[-1]
        half = m // 2
        added = rows[..., :half] + rows[..., half : 2 * half]
        rows = added if m % 2 == 0 else torch.cat((added, rows[..., 2 * half :]), -1)
    return rows


#: Requests of at least this many elements run alone, on their own tensors: copying them
#: into a stack and the fresh memory it takes cost more than the framework calls a launch
#: makes.
_STACK_MAX = 8192


def _stack_key(request: Any) -> Hashable:
    """Requests that stack in one framework launch: the same shapes."""
    t = request.tensors
    return tuple(t[name].shape for name in ("x", "dy", "gamma", "mean", "rstd"))


def _size(request: Any) -> int:
    """A request's size as stacking weighs it: its largest operand's elements."""
    return request.tensors["x"].numel()


def _f32(torch: Any, tensor: Any, shape: tuple[int, ...]) -> Any:
    """``tensor`` in float32, seen as ``shape`` (no call where it already is either)."""
    if tensor.dtype != torch.float32:
        tensor = tensor.to(torch.float32)
    return tensor if tensor.shape == shape else tensor.reshape(shape)


def _row(request: Any) -> int:
    """The length of a request's rows (M): requests stack when theirs are equal."""
    return math.prod(request.tensors["x"].shape[2:])
