"""GroupNormalizationGrad on the host devices: its plan, its kernels' launches, its fused
layout.

A request is N * G groups of M elements; requests fuse when dtype and M match. The fused
launch is a GroupNormalizationGrad of x shape (capacity, 1, M).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np

from opsched.devices.host.launcher import HostLauncher, Layout
from opsched.kernels.group_norm import (
    GroupNormPlan,
    group_norm_grad_fast,
    group_norm_grad_reference,
    group_norm_grad_runner,
    make_group_norm_plan,
    plan_group_norm_grad,
)
from opsched.ops._base import (
    FusedGeometry,
    Launch,
    Tensors,
)
from opsched.ops._fusion import deliver_each, gather_into
from opsched.ops.group_norm_grad import GROUP_NORM_GRAD

__all__ = ["GroupNormalizationGradLauncher"]


class GroupNormalizationGradLauncher(HostLauncher):
    """GroupNormalizationGrad on the host devices (see the module docstring)."""

    op = GROUP_NORM_GRAD
    alone_from = 32 << 10

    def plan(self, tensors: Tensors, scalars: Mapping[str, Any], block: int) -> GroupNormPlan:
        return plan_group_norm_grad(tensors["x"], tensors["dy"], tensors["gamma"], tensors["dx"])

    def prepare(self, plan: GroupNormPlan, tensors: Tensors) -> Launch:
        # the usual layout: its flat views and the compiled call alone, checked once here
        t = tensors
        run = group_norm_grad_runner(
            plan, t["x"], t["dy"], t["gamma"], t["mean"], t["rstd"], t["dx"]
        )
        if run is not None:

            def usual(t: Tensors, workspace: np.ndarray | None) -> None:
                run(t["x"], t["dy"], t["gamma"], t["mean"], t["rstd"], t["dx"])

            return usual

        size = plan.workspace_bytes

        def launch(t: Tensors, workspace: np.ndarray | None) -> None:
            if workspace is None and size:  # (a launch in a caller's thread: its own)
                workspace = np.empty(size, np.uint8)
            group_norm_grad_fast(
                plan, t["x"], t["dy"], t["gamma"], t["mean"], t["rstd"], t["dx"], workspace
            )

        return launch

    def reference(self, tensors: Tensors, scalars: Mapping[str, Any]) -> np.ndarray:
        t = tensors
        return group_norm_grad_reference(t["x"], t["dy"], t["gamma"], t["mean"], t["rstd"])

    def fused_geometry(self, key: Hashable, capacity: int) -> FusedGeometry:
        dtype: np.dtype = key[1]  # type: ignore[index]
        m: int = key[2]  # type: ignore[index]
        rows: tuple[tuple[int, ...], np.dtype] = ((capacity, 1, m), dtype)
        stats: tuple[tuple[int, ...], np.dtype] = ((capacity, 1), dtype)
        arrays = {"x": rows, "dy": rows, "gamma": rows, "mean": stats, "rstd": stats, "dx": rows}
        return arrays, {}

    def fused_parts(self, layout: Layout, fused: Tensors) -> list[dict[str, np.ndarray]]:
        # one kernel call on the rows in use of every array
        units = layout.bounds[-1]
        return [{name: array[:units] for name, array in fused.items()}]

    def fused_plan(self, key: Hashable, capacity: int, block: int) -> GroupNormPlan:
        dtype: np.dtype = key[1]  # type: ignore[index]
        m: int = key[2]  # type: ignore[index]
        return make_group_norm_plan((capacity, 1, m), dtype)

    def gather(self, layout: Layout, fused: Tensors) -> None:
        # Requests of one signature (same shapes) move together: one concatenate per
        # operand into their rows, seen in their own shape (no reshape per request).
        names = ("x", "dy", "gamma", "mean", "rstd")
        for members, _, start, stop in layout.spans():
            for name, parts in zip(names, layout.operands(members, *names), strict=True):
                gather_into(parts, fused[name][start:stop])

    def scatter(self, layout: Layout, fused: Tensors) -> None:
        # A signature group's rows are contiguous (the gather placed them so).
        dx_all = fused["dx"]
        for members, first, start, stop in layout.spans():
            shape = first.tensors["x"].shape
            deliver_each(layout.requests, members, "dx", dx_all[start:stop].reshape(-1, *shape))
