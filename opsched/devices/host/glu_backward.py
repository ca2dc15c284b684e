"""GluBackward on the host devices: its plan, its kernels' launches, its fused layout.

A request is ``outer * half`` elementwise units. A fused launch gathers its requests'
operands one after another as each lies alone (``self`` as ``outer`` rows of its ``a`` and
``b`` halves side by side), and computes each signature group's rows with one kernel call:
a GluBackward of ``(rows, 2 * half)`` split along dim 1, whose output rows are the
requests' results in place.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from typing import Any

import numpy as np

from opsched.devices.host.launcher import HostLauncher, Layout
from opsched.kernels.glu import (
    GluPlan,
    glu_backward_fast,
    glu_backward_reference,
    glu_backward_runner,
    glu_backward_table,
    glu_grid,
    glu_table_row,
    make_glu_plan,
    plan_glu_backward,
)
from opsched.ops._base import (
    FusedGeometry,
    Launch,
    Tensors,
)
from opsched.ops._fusion import deliver_each, gather_into
from opsched.ops.glu_backward import GLU_BACKWARD

__all__ = ["GluBackwardLauncher"]


class GluBackwardLauncher(HostLauncher):
    """GluBackward on the host devices (see the module docstring)."""

    op = GLU_BACKWARD
    alone_from = 4 << 10

    def plan(self, tensors: Tensors, scalars: Mapping[str, Any], block: int) -> GluPlan:
        return plan_glu_backward(
            tensors["grad_out"], tensors["self"], scalars["dim"], tensors["out"], block=block
        )

    def prepare(self, plan: GluPlan, tensors: Tensors) -> Launch:
        # the usual layout: its flat views and the compiled call alone, checked once here
        run = glu_backward_runner(plan, tensors["grad_out"], tensors["self"], tensors["out"])
        if run is not None:

            def usual(t: Tensors, workspace: np.ndarray | None) -> None:
                run(t["grad_out"], t["self"], t["out"])

            return usual

        size = plan.workspace_bytes

        def staged(t: Tensors, workspace: np.ndarray | None) -> None:
            if workspace is None and size:  # (a launch in a caller's thread: its own)
                workspace = np.empty(size, np.uint8)
            glu_backward_fast(plan, t["grad_out"], t["self"], t["out"], workspace)

        return staged

    def table_row(self, request: Any) -> tuple[int, ...] | None:
        t = request.tensors
        x, out = t["self"], t["out"]
        if out is None:  # left to the launch: its own new array, as a solo launch's
            out = t["out"] = np.empty(x.shape, x.dtype)
        return glu_table_row(t["grad_out"], x, out, request.scalars["dim"])

    def table_call(self, rows: list[tuple[int, ...]], first: Any) -> Callable[[], None]:
        return glu_backward_table(first.tensors["self"].dtype, rows)

    def reference(self, tensors: Tensors, scalars: Mapping[str, Any]) -> np.ndarray:
        return glu_backward_reference(tensors["grad_out"], tensors["self"], scalars["dim"])

    def plan_scalars(self, plan: GluPlan) -> dict[str, Any]:
        return {"dim": plan.dim}

    def fused_geometry(self, key: Hashable, capacity: int) -> FusedGeometry:
        dtype: np.dtype = key[1]  # type: ignore[index]
        arrays: dict[str, tuple[tuple[int, ...], np.dtype]] = {
            "grad_out": ((capacity,), dtype),
            "self": ((2 * capacity,), dtype),
            "out": ((2 * capacity,), dtype),
        }
        return arrays, {"dim": 1}

    def fused_plan(self, key: Hashable, capacity: int, block: int) -> GluPlan:
        # rows of (a, b) halves split along dim 1: sizes come from each call's arrays
        return make_glu_plan((capacity, 2), 1, key[1], block=block)  # type: ignore[index]

    def gather(self, layout: Layout, fused: Tensors) -> None:
        # Each request's operands as they are laid out alone, one after another: a
        # signature group's grad_out with one concatenate, its self with another (a
        # request's self is its ``(outer, 2 * half)`` rows, halves side by side).
        g, x = fused["grad_out"], fused["self"]
        for members, _, start, stop in layout.spans():
            grad_outs, selves = layout.operands(members, "grad_out", "self")
            gather_into(grad_outs, g[start:stop])
            gather_into(selves, x[2 * start : 2 * stop])

    def fused_parts(self, layout: Layout, fused: Tensors) -> list[dict[str, np.ndarray]]:
        # one kernel call a signature group, on its rows as gathered: the kernel reads
        # each half where it lies, so nothing is split into halves and back
        g, x, out = fused["grad_out"], fused["self"], fused["out"]
        parts = []
        for members, first, start, stop in layout.spans():
            outer, half = glu_grid(first.tensors["self"].shape, first.scalars["dim"])
            rows = len(members) * outer
            parts.append(
                {
                    "grad_out": g[start:stop].reshape(rows, half),
                    "self": x[2 * start : 2 * stop].reshape(rows, 2 * half),
                    "out": out[2 * start : 2 * stop].reshape(rows, 2 * half),
                }
            )
        return parts

    def scatter(self, layout: Layout, fused: Tensors) -> None:
        out = fused["out"]
        for members, first, start, stop in layout.spans():
            results = out[2 * start : 2 * stop].reshape(len(members), *first.tensors["self"].shape)
            deliver_each(layout.requests, members, "out", results)
