"""GroupNormBackward on the host devices: its plan, its kernels' launches, its fused
layout (per-row statistics summed into each request's dgamma / dbeta).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import numpy as np

from opsched.devices.base import allocate_missing
from opsched.devices.host.launcher import HostLauncher, Layout
from opsched.kernels.group_norm_backward import (
    GnbPlan,
    gnb_table_row,
    group_norm_backward_reference,
    group_norm_backward_rows_reference,
    group_norm_backward_runner,
    group_norm_backward_table,
    make_gnb_plan,
    plan_group_norm_backward,
    prepare_group_norm_backward,
)
from opsched.ops._base import (
    FusedGeometry,
    Launch,
    Tensors,
)
from opsched.ops._fusion import deliver_each, gather_into
from opsched.ops.group_norm_backward import GROUP_NORM_BACKWARD

__all__ = ["GroupNormBackwardLauncher"]

F32 = np.dtype(np.float32)
#: A request's arrays in the order the kernels take them: grad_out, input, mean, rstd,
#: gamma, dx, dgamma, dbeta.
_arrays: Callable[[Tensors], Any] = operator.itemgetter(*GROUP_NORM_BACKWARD.tensor_names)


class GroupNormBackwardLauncher(HostLauncher):
    """GroupNormBackward on the host devices (see the module docstring)."""

    op = GROUP_NORM_BACKWARD
    alone_from = 24 << 10

    def plan(self, tensors: Tensors, scalars: Mapping[str, Any], block: int) -> GnbPlan:
        s = scalars
        return plan_group_norm_backward(
            tensors["grad_out"],
            tensors["input"],
            tensors["dx"] if s["output_mask"][0] else None,
            s["N"],
            s["C"],
            s["HxW"],
            s["group"],
            s["output_mask"],
            tensors["gamma"] is not None,
        )

    def table_row(self, request: Any) -> tuple[int, ...] | None:
        t, s = request.tensors, request.scalars
        if not all(s["output_mask"]):  # the table loop computes all three
            return None
        fresh = t["dx"] is None and t["dgamma"] is None and t["dbeta"] is None
        allocate_missing(self.op, t, s)  # left to the launch: new arrays, as a solo's
        dy, x, mean, rstd, gamma, dx, dgamma, dbeta = _arrays(t)
        scalars = s["N"], s["C"], s["HxW"], s["group"]
        return gnb_table_row(dy, x, mean, rstd, gamma, dx, dgamma, dbeta, *scalars, fresh)

    def table_call(self, rows: list[tuple[int, ...]], first: Any) -> Callable[[], None]:
        return group_norm_backward_table(first.tensors["input"].dtype, rows)

    def prepare(self, plan: GnbPlan, tensors: Tensors) -> Launch:
        t = tensors
        # the usual layout: the compiled call on the arrays as they are, checked once here
        # (not a fused launch's, whose statistics go to its per-row sums)
        run = None
        if not plan.stats_out:
            run = group_norm_backward_runner(plan, *_arrays(t))
        if run is not None:

            def usual(t: Tensors, workspace: np.ndarray | None) -> None:
                run(*_arrays(t), workspace)

            return usual

        size = plan.workspace_bytes

        def staged(t: Tensors, workspace: np.ndarray | None) -> None:
            if workspace is None and size:  # (a launch in a caller's thread: its own)
                workspace = np.empty(size, np.uint8)
            prepare_group_norm_backward(
                plan,
                t["grad_out"],
                t["input"],
                t["mean"],
                t["rstd"],
                t.get("gamma"),
                t.get("dx"),
                t.get("dgamma"),
                t.get("dbeta"),
                ds_out=t.get("ds"),
                db_out=t.get("db"),
            )(workspace)

        return staged

    def reference(self, tensors: Tensors, scalars: Mapping[str, Any]) -> Any:
        """``(dx, dgamma, dbeta)`` from the reference kernel (all three, new arrays)."""
        t, s = tensors, scalars
        return group_norm_backward_reference(
            t["grad_out"],
            t["input"],
            t["mean"],
            t["rstd"],
            t["gamma"],
            s["N"],
            s["C"],
            s["HxW"],
            s["group"],
        )

    def prepare_reference(self, plan: GnbPlan, tensors: Tensors) -> Launch:
        def launch(t: Tensors, workspace: np.ndarray | None) -> None:
            self._reference_into(plan, t)

        return launch

    def _reference_into(self, plan: GnbPlan, t: Mapping[str, Any]) -> None:
        """The reference kernel for ``plan`` into the output arrays of ``t``."""
        if plan.stats_out:  # a fused launch: per-row gamma, stats to the caller
            rows, cpg = t["mean"].size, plan.cpg
            gamma = t.get("gamma")
            dx, ds, db = group_norm_backward_rows_reference(
                t["grad_out"], t["input"], t["mean"], t["rstd"], gamma, rows, cpg, plan.hxw
            )
            np.copyto(t["ds"], ds)
            np.copyto(t["db"], db)
            if plan.want_dx:
                np.copyto(t["dx"], dx.reshape(t["dx"].shape))
            return
        scalars = {
            "N": plan.n,
            "C": plan.c,
            "HxW": plan.hxw,
            "group": plan.group,
            "output_mask": (plan.want_dx, plan.want_dgamma, plan.want_dbeta),
        }
        for name, value in zip(self.op.outputs, self.reference(t, scalars), strict=True):
            if t.get(name) is not None:
                np.copyto(t[name], value.reshape(t[name].shape))

    def unplanned_overlap(self, plan: Any, tensors: Tensors) -> bool:
        return not plan.stage_dx and self.op.overlaps_any(tensors)

    def fused_geometry(self, key: Hashable, capacity: int) -> FusedGeometry:
        dtype, cpg, hxw, mask, has_gamma = _unkey(key)
        stat_dtype: np.dtype = key[6]  # type: ignore[index]
        rows = ((capacity * cpg, hxw), dtype)
        stats = ((capacity,), stat_dtype)
        arrays: dict[str, tuple[tuple[int, ...], np.dtype]] = {
            "grad_out": rows,
            "input": rows,
            "mean": stats,
            "rstd": stats,
        }
        if has_gamma:
            arrays["gamma"] = ((capacity, cpg), stat_dtype)
        if mask[0]:
            arrays["dx"] = rows
        arrays["ds"] = ((capacity * cpg,), F32)
        arrays["db"] = ((capacity * cpg,), F32)
        return arrays, {"N": capacity, "C": cpg, "HxW": hxw, "group": 1, "output_mask": mask}

    def fused_parts(self, layout: Layout, fused: Tensors) -> list[dict[str, np.ndarray]]:
        # one kernel call on the first units in use of every array
        units = layout.bounds[-1]
        cpg = fused["ds"].shape[0] // fused["mean"].shape[0]
        out = {}
        for name, array in fused.items():
            per_unit = cpg if name in ("grad_out", "input", "dx", "ds", "db") else 1
            out[name] = array[: units * per_unit]
        return [out]

    def fused_plan(self, key: Hashable, capacity: int, block: int) -> GnbPlan:
        dtype, cpg, hxw, mask, has_gamma = _unkey(key)
        return make_gnb_plan(
            capacity,
            cpg,
            hxw,
            1,
            dtype,
            mask,
            has_gamma=has_gamma,
            row_gamma=True,
            stats_out=True,
        )

    def gather(self, layout: Layout, fused: Tensors) -> None:
        # Requests of one signature (same shapes, N, C, group) move together: one
        # concatenate per operand, one broadcast copy of their gammas.
        cpg = fused["ds"].shape[0] // fused["mean"].shape[0]
        for members, first, start, offset in layout.spans():
            grad_outs, inputs, means, rstds = layout.operands(
                members, "grad_out", "input", "mean", "rstd"
            )
            gather_into(grad_outs, fused["grad_out"][start * cpg : offset * cpg])
            gather_into(inputs, fused["input"][start * cpg : offset * cpg])
            gather_into(means, fused["mean"][start:offset])
            gather_into(rstds, fused["rstd"][start:offset])
            if "gamma" in fused:
                n, c = first.scalars["N"], first.scalars["C"]
                rows = fused["gamma"][start:offset].reshape(len(members), n, c)
                # the group's gammas in a row (np.stack adds an axis to each array in
                # Python), then broadcast over each request's samples
                (parts,) = layout.operands(members, "gamma")
                gammas = np.empty(len(members) * parts[0].size, parts[0].dtype)
                gather_into(parts, gammas)
                np.copyto(rows, gammas.reshape(len(members), 1, c))

    def scatter(self, layout: Layout, fused: Tensors) -> None:
        # dgamma / dbeta: each request's per-row sums added over its own samples in order
        # 0, 1, ..., N-1 in FLOAT (as reduce_over_samples does for a solo launch), a whole
        # group at a time, then rounded once into the output dtype.
        cpg = fused["ds"].shape[0] // fused["mean"].shape[0]
        requests = layout.requests
        for members, first, start, stop in layout.spans():
            k, n, c = len(members), first.scalars["N"], first.scalars["C"]
            lo, hi = start * cpg, stop * cpg
            want_dx, want_dgamma, want_dbeta = first.scalars["output_mask"]
            shape = first.tensors["input"].shape
            if want_dx:
                deliver_each(requests, members, "dx", fused["dx"][lo:hi].reshape(k, *shape))
            gamma, mean = first.tensors["gamma"], first.tensors["mean"]
            stat_shape = gamma.shape if gamma is not None else (c,)
            for name, stats, wanted in (("dgamma", "db", want_dgamma), ("dbeta", "ds", want_dbeta)):
                if not wanted:
                    continue
                rows = fused[stats][lo:hi].reshape(k, n, c)
                sums = rows[:, 0].copy() if n else np.zeros((k, c), F32)
                for sample in range(1, n):
                    sums += rows[:, sample]
                results = sums.astype(mean.dtype).reshape(k, *stat_shape)
                deliver_each(requests, members, name, results)


def _unkey(key: Hashable) -> tuple[np.dtype, int, int, tuple[bool, bool, bool], bool]:
    """The parts of a fusion key: dtype, cpg, HxW, output_mask, has gamma."""
    parts: tuple[Any, ...] = key  # type: ignore[assignment]
    return parts[1], parts[2], parts[3], parts[4], parts[5]
