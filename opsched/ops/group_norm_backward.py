"""GroupNormBackward (``aclnnGroupNormBackward``): the true group-norm gradient, three outputs.

``(dx, dgamma, dbeta) = group_norm_backward(grad_out, input, mean, rstd, gamma, N, C, HxW,
group, output_mask)``; each output is None where its ``output_mask`` entry is False. The
formula and its determinism are in :mod:`opsched.kernels.group_norm_backward`.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any, ClassVar

import ml_dtypes
import numpy as np

from opsched._errors import ParamInvalidError
from opsched.ops._base import (
    ARRAY_TYPES,
    Operator,
    Parameter,
    Tensors,
    check_dtype,
    check_present,
    check_types,
    dtype_name,
    index_value,
    may_overlap,
)
from opsched.ops.products import OpSupport

__all__ = ["GROUP_NORM_BACKWARD", "GroupNormBackward"]

MAX_DIMS = 8
F32 = np.dtype(np.float32)

_INPUTS = ("grad_out", "input", "mean", "rstd", "gamma")
_STATS = ("mean", "rstd", "gamma", "dgamma", "dbeta")
_OUTPUTS = ("dx", "dgamma", "dbeta")
#: output_mask's default.
_ALL = (True, True, True)


class GroupNormBackward(Operator):
    """See the module docstring and the README's "Which group-norm operator"."""

    name: ClassVar[str] = "GroupNormBackward"
    method: ClassVar[str] = "group_norm_backward"
    summary: ClassVar[str] = (
        "GroupNormBackward (``aclnnGroupNormBackward``): the true group-norm gradient; "
        "returns ``(dx, dgamma, dbeta)``, None where ``output_mask`` is False."
    )
    parameters: ClassVar[tuple[Parameter, ...]] = (
        Parameter("grad_out", "np.ndarray", "N * C * HxW elements (e.g. (N, C, H, W))."),
        Parameter("input", "np.ndarray", "the forward input, grad_out's shape and dtype."),
        Parameter("mean", "np.ndarray", "N * group elements, laid out as (N, group)."),
        Parameter("rstd", "np.ndarray", "N * group elements, laid out as (N, group)."),
        Parameter("gamma", "np.ndarray | None", "C elements, or None (ones)."),
        Parameter("N", "int", "the batch size."),
        Parameter("C", "int", "the channels."),
        Parameter("HxW", "int", "the elements per channel."),
        Parameter("group", "int", "the groups; it divides C."),
        Parameter(
            "output_mask", "Sequence[bool]", "compute (dx, dgamma, dbeta).", "(True, True, True)"
        ),
    )
    result_annotation: ClassVar[str] = (
        "tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]"
    )
    out_annotation: ClassVar[str] = (
        "tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None] | None"
    )
    output_annotation: ClassVar[str] = "np.ndarray | None"
    tensor_names: ClassVar[tuple[str, ...]] = _INPUTS + _OUTPUTS
    outputs: ClassVar[tuple[str, ...]] = _OUTPUTS
    splits: ClassVar[bool] = False  # dgamma / dbeta reduce over every sample
    overlap_inputs: ClassVar[tuple[str, ...]] = ("grad_out", "input")
    dtypes: ClassVar[tuple[np.dtype, ...]] = tuple(
        np.dtype(d) for d in (np.float32, np.float16, ml_dtypes.bfloat16)
    )

    # BEGIN GENERATED fast paths: scripts/gen_entry_points.py writes this; do not edit
    def call_tensors(
        self, args: Sequence[Any], out: Any
    ) -> tuple[Hashable | None, dict[str, Any] | None]:
        """The checks' cache key of a positional call and its tensors (generated)."""
        count = len(args)
        if count == 10:
            grad_out, input, mean, rstd, gamma, N, C, HxW, group, output_mask = args
        elif count == 9:
            grad_out, input, mean, rstd, gamma, N, C, HxW, group = args
            output_mask = (True, True, True)
        else:
            return super().call_tensors(args, out)
        kinds = ARRAY_TYPES
        if (
            type(grad_out) in kinds
            and type(input) in kinds
            and type(mean) in kinds
            and type(rstd) in kinds
            and (gamma is None or type(gamma) in kinds)
            and type(N) is int
            and type(C) is int
            and type(HxW) is int
            and type(group) is int
            and (
                type(output_mask) is tuple
                and len(output_mask) == 3
                and type(output_mask[0]) is bool
                and type(output_mask[1]) is bool
                and type(output_mask[2]) is bool
            )
        ):
            return (
                grad_out.shape,
                grad_out.dtype,
                input.shape,
                input.dtype,
                mean.shape,
                mean.dtype,
                rstd.shape,
                rstd.dtype,
                None if gamma is None else (gamma.shape, gamma.dtype),
                N,
                C,
                HxW,
                group,
                output_mask,
            ), (
                self.arguments(args, out)[0]
                if out is not None
                else {
                    "grad_out": grad_out,
                    "input": input,
                    "mean": mean,
                    "rstd": rstd,
                    "gamma": gamma,
                    "dx": None,
                    "dgamma": None,
                    "dbeta": None,
                }
            )
        return super().call_tensors(args, out)

    def arguments(self, args: Sequence[Any], out: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The argument dicts of a positional call (generated)."""
        count = len(args)
        if count == 10:
            grad_out, input, mean, rstd, gamma, N, C, HxW, group, output_mask = args
        elif count == 9:
            grad_out, input, mean, rstd, gamma, N, C, HxW, group = args
            output_mask = (True, True, True)
        else:
            return super().arguments(args, out)
        if out is not None:
            return super().arguments(args, out)
        return (
            {
                "grad_out": grad_out,
                "input": input,
                "mean": mean,
                "rstd": rstd,
                "gamma": gamma,
                "dx": None,
                "dgamma": None,
                "dbeta": None,
            },
            {"N": N, "C": C, "HxW": HxW, "group": group, "output_mask": output_mask},
        )

    def signature(self, tensors: Mapping[str, Any], scalars: Mapping[str, Any]) -> Hashable | None:
        """The checks' own cache key of a request (generated)."""
        grad_out = tensors["grad_out"]
        input = tensors["input"]
        mean = tensors["mean"]
        rstd = tensors["rstd"]
        gamma = tensors["gamma"]
        dx = tensors["dx"]
        dgamma = tensors["dgamma"]
        dbeta = tensors["dbeta"]
        N = scalars["N"]
        C = scalars["C"]
        HxW = scalars["HxW"]
        group = scalars["group"]
        output_mask = scalars["output_mask"]
        if (
            type(grad_out) is np.ndarray
            and type(input) is np.ndarray
            and type(mean) is np.ndarray
            and type(rstd) is np.ndarray
            and (gamma is None or type(gamma) is np.ndarray)
            and (dx is None or type(dx) is np.ndarray)
            and (dgamma is None or type(dgamma) is np.ndarray)
            and (dbeta is None or type(dbeta) is np.ndarray)
            and type(N) is int
            and type(C) is int
            and type(HxW) is int
            and type(group) is int
            and (
                type(output_mask) is tuple
                and len(output_mask) == 3
                and type(output_mask[0]) is bool
                and type(output_mask[1]) is bool
                and type(output_mask[2]) is bool
            )
        ):
            return (
                grad_out.shape,
                grad_out.dtype,
                input.shape,
                input.dtype,
                mean.shape,
                mean.dtype,
                rstd.shape,
                rstd.dtype,
                None if gamma is None else (gamma.shape, gamma.dtype),
                None if dx is None else (dx.shape, dx.dtype),
                None if dgamma is None else (dgamma.shape, dgamma.dtype),
                None if dbeta is None else (dbeta.shape, dbeta.dtype),
                N,
                C,
                HxW,
                group,
                output_mask,
            )
        return super().signature(tensors, scalars)

    # END GENERATED fast paths

    def unasked_outputs(self, scalars: Mapping[str, Any]) -> tuple[str, ...]:
        # output_mask's False entries (a malformed mask is the checks' to refuse)
        given: Any = scalars.get("output_mask")
        if type(given) not in (tuple, list) or len(given) != 3:
            return ()
        return tuple(
            name
            for name, wanted in zip(_OUTPUTS, given, strict=True)
            if wanted is False or (type(wanted) is np.bool_ and not wanted)
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
        t = tensors
        # 1. the required inputs.
        check_present(op, **{k: t[k] for k in ("grad_out", "input", "mean", "rstd")})
        check_types(op, **{k: t[k] for k in self.tensor_names})
        # 2. output_mask, and the outputs it asks for.
        mask = _mask(op, scalars["output_mask"])
        if not allocate:
            for name, wanted in zip(_OUTPUTS, mask, strict=True):
                if wanted and t[name] is None:
                    msg = (
                        f"{op}: {name} is None but output_mask asks for it "
                        f"(output_mask={list(mask)}); pass an array or set its entry False"
                    )
                    raise ParamInvalidError(msg)
        # 3. dtypes: grad_out's in the list; every other tensor equal to it (on a product
        # with FLOAT statistics, those may instead all be FLOAT).
        allowed, product = self.allowed_dtypes(support)
        grad_out = t["grad_out"]
        if support is not None and support.float_stats and grad_out.dtype != F32:
            check_dtype(
                op, allowed, ("grad_out", grad_out), product=product, input=t["input"], dx=t["dx"]
            )
            stats = {k: t[k] for k in _STATS}
            if t["mean"].dtype not in (grad_out.dtype, F32):
                msg = (
                    f"{op}: mean.dtype is {dtype_name(t['mean'].dtype)}; on {product} the "
                    f"statistics ({', '.join(_STATS)}) are FLOAT or grad_out's dtype "
                    f"{dtype_name(grad_out.dtype)}"
                )
                raise ParamInvalidError(msg)
            check_dtype(op, (t["mean"].dtype,), ("mean", t["mean"]), product=product, **stats)
        else:
            others = {k: t[k] for k in self.tensor_names if k != "grad_out"}
            check_dtype(op, allowed, ("grad_out", grad_out), product=product, **others)
        # 4. group.
        n, c, hxw, group = (index_value(op, k, scalars[k]) for k in ("N", "C", "HxW", "group"))
        for name, value in (("N", n), ("C", c), ("HxW", hxw)):
            if value < 0:
                msg = f"{op}: {name}={value} is negative"
                raise ParamInvalidError(msg)
        if group <= 0 or c % group:
            msg = f"{op}: group={group} must be > 0 and divide C={c}"
            raise ParamInvalidError(msg)
        # 5. ranks.
        for name in self.tensor_names:
            if t[name] is not None and t[name].ndim > MAX_DIMS:
                msg = f"{op}: {name} has {t[name].ndim} dims; at most {MAX_DIMS} are supported"
                raise ParamInvalidError(msg)
        # 6. element counts.
        counts = {
            "input": (n * c * hxw, "N*C*HxW"),
            "grad_out": (n * c * hxw, "N*C*HxW"),
            "mean": (n * group, "N*group"),
            "rstd": (n * group, "N*group"),
            "gamma": (c, "C"),
        }
        for name, (want, formula) in counts.items():
            if t[name] is not None and t[name].size != want:
                msg = (
                    f"{op}: {name} has {t[name].size} elements (shape {t[name].shape}); "
                    f"expected {formula} = {want} (N={n}, C={c}, HxW={hxw}, group={group})"
                )
                raise ParamInvalidError(msg)
        # 7. output shapes.
        stat_shape = t["gamma"].shape if t["gamma"] is not None else (c,)
        shapes = {"dx": t["input"].shape, "dgamma": stat_shape, "dbeta": stat_shape}
        for name, want_shape in shapes.items():
            if t[name] is not None and t[name].shape != want_shape:
                what = (
                    "input's shape"
                    if name == "dx"
                    else ("gamma's shape" if t["gamma"] is not None else "(C,) without gamma")
                )
                msg = f"{op}: {name}.shape is {t[name].shape}; expected {want_shape} ({what})"
                raise ParamInvalidError(msg)
        return {"N": n, "C": c, "HxW": hxw, "group": group, "output_mask": mask}

    def output_spec(
        self, tensors: Mapping[str, Any], scalars: Mapping[str, Any]
    ) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        # branches, not a dict filtered by the mask: this runs for every request
        x, gamma = tensors["input"], tensors["gamma"]
        want_dx, want_dgamma, want_dbeta = scalars["output_mask"]
        # dgamma / dbeta: gamma's shape, or (C,); the statistics' dtype (the input's, or FLOAT)
        stat = (gamma.shape if gamma is not None else (scalars["C"],), tensors["mean"].dtype)
        spec: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        if want_dx:
            spec["dx"] = (x.shape, x.dtype)
        if want_dgamma:
            spec["dgamma"] = stat
        if want_dbeta:
            spec["dbeta"] = stat
        return spec

    def oracle(
        self,
        grad_out: np.ndarray,
        input: np.ndarray,
        mean: np.ndarray,
        rstd: np.ndarray,
        gamma: np.ndarray | None,
        N: int,
        C: int,
        HxW: int,
        group: int,
        output_mask: Sequence[bool] = _ALL,
    ) -> tuple[np.ndarray | None, ...]:
        # the true gradient of y = gamma * xhat + beta over (N, C, HxW) in `group` groups
        n, c, hxw, d = N, C, HxW, C // group
        dy = grad_out.astype(np.float64).reshape(n, group, d, hxw)
        xs = input.astype(np.float64).reshape(n, group, d, hxw)
        mu = mean.astype(np.float64).reshape(n, group, 1, 1)
        r = rstd.astype(np.float64).reshape(n, group, 1, 1)
        w = np.ones(c) if gamma is None else gamma.astype(np.float64).reshape(c)
        xhat = (xs - mu) * r
        dxhat = dy * w.reshape(1, group, d, 1)
        m = d * hxw
        mean_dxhat = dxhat.sum(axis=(2, 3), keepdims=True) / m
        mean_dxhat_xhat = (dxhat * xhat).sum(axis=(2, 3), keepdims=True) / m
        dx = r * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat)
        stat_shape = gamma.shape if gamma is not None else (c,)
        dgamma = (dy * xhat).sum(axis=(0, 3)).reshape(stat_shape)
        dbeta = dy.sum(axis=(0, 3)).reshape(stat_shape)
        outs = (dx.reshape(input.shape), dgamma, dbeta)
        return tuple(o if wanted else None for o, wanted in zip(outs, output_mask, strict=True))

    def example(self, rng: np.random.Generator, dtype: Any = np.float32) -> tuple[Any, ...]:
        # N=4, C=8, HxW=64, 4 groups
        x, dy = (rng.standard_normal((4, 8, 64)).astype(dtype) for _ in range(2))
        mean = rng.standard_normal((4, 4)).astype(dtype)
        rstd = (rng.random((4, 4)) + 0.5).astype(dtype)
        gamma = rng.standard_normal(8).astype(dtype)
        return dy, x, mean, rstd, gamma, 4, 8, 64, 4

    def overlaps_any(self, tensors: Tensors) -> bool:
        dx = tensors["dx"]  # against overlap_inputs, spelled out: this runs for every call
        return dx is not None and (
            may_overlap(dx, tensors["grad_out"]) or may_overlap(dx, tensors["input"])
        )

    def nbytes(self, tensors: Tensors) -> int:
        return sum(tensors[n].nbytes for n in self.tensor_names if tensors[n] is not None)

    # Fusion: a request is N * group rows of cpg channels of HxW elements; requests fuse when
    # dtype, cpg, HxW, output_mask and whether gamma is given match. The fused launch has
    # N' = rows, group' = 1, C' = cpg, gamma given per row, and writes each channel row's
    # ds / db, which the scatter reduces per request over its own samples.

    def fusion(self, tensors: Tensors, scalars: Mapping[str, Any]) -> tuple[Hashable, int]:
        s = scalars
        cpg = s["C"] // s["group"]
        key = (
            self.name,
            tensors["grad_out"].dtype,
            cpg,
            s["HxW"],
            s["output_mask"],
            tensors["gamma"] is not None,
            tensors["mean"].dtype,
        )
        return key, s["N"] * s["group"]

    def split(
        self, tensors: Tensors, scalars: Mapping[str, Any], parts: int
    ) -> list[tuple[dict[str, np.ndarray], dict[str, Any]]] | None:
        return None  # dgamma / dbeta reduce over every sample: a request runs whole


def _mask(op: str, value: object) -> tuple[bool, bool, bool]:
    """``output_mask`` as a tuple of three bools (161002 when not of length 3)."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
        msg = f"{op}: output_mask must be a sequence of 3 bools, got {type(value).__qualname__}"
        raise TypeError(msg)
    if len(value) != 3:
        msg = (
            f"{op}: output_mask has {len(value)} entries ({list(value)}); expected 3 "
            "(dx, dgamma, dbeta)"
        )
        raise ParamInvalidError(msg)
    for v in value:
        if not isinstance(v, bool | np.bool_):
            msg = f"{op}: output_mask entries must be bools, got {type(v).__qualname__} {v!r}"
            raise TypeError(msg)
    return bool(value[0]), bool(value[1]), bool(value[2])


#: The GroupNormBackward descriptor.
GROUP_NORM_BACKWARD = GroupNormBackward()
