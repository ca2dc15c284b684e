"""GroupNormalizationGrad on the host devices: its plan, its kernels' launches, its fused
layout.

A request is N * G groups of M elements; requests fuse when dtype and M match. The fused
launch is a GroupNormalizationGrad of x shape (capacity, 1, M).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from opsched.devices.host.launcher import HostLauncher
from opsched.kernels.group_norm import (
    GroupNormPlan,
    group_norm_grad_fast,
    group_norm_grad_reference,
    make_group_norm_plan,
    plan_group_norm_grad,
)
from opsched.ops._base import (
    FusedGeometry,
    Launch,
    Tensors,
)
from opsched.ops._fusion import deliver_each, gather_into, signature_groups
from opsched.ops.group_norm_grad import GROUP_NORM_GRAD

__all__ = ["GroupNormalizationGradLauncher"]


class GroupNormalizationGradLauncher(HostLauncher):
    """GroupNormalizationGrad on the host devices (see the module docstring)."""

    op = GROUP_NORM_GRAD

    def plan(self, tensors: Tensors, scalars: Mapping[str, Any], block: int) -> GroupNormPlan:
        return plan_group_norm_grad(tensors["x"], tensors["dy"], tensors["gamma"], tensors["dx"])

    def prepare(self, plan: GroupNormPlan, tensors: Tensors) -> Launch:
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

    def fused_parts(
        self, fused: Tensors, requests: Sequence[Any], offsets: list[int], units: int
    ) -> list[dict[str, np.ndarray]]:
        # one kernel call on the first ``units`` of every array
        return [{name: array[:units] for name, array in fused.items()}]

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
