"""GluBackward on the host devices: its plan, its kernels' launches, its fused layout.

A request is ``outer * half`` elementwise units. The fused launch is itself a GluBackward
of ``self`` shape (2, capacity) split along dim 0: row 0 gathers every request's ``a``
half, row 1 its ``b`` half.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import numpy as np

from opsched.devices.host.launcher import HostLauncher
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
from opsched.ops._fusion import deliver_each, gather_into, signature_groups
from opsched.ops.glu_backward import GLU_BACKWARD

__all__ = ["GluBackwardLauncher"]


class GluBackwardLauncher(HostLauncher):
    """GluBackward on the host devices (see the module docstring)."""

    op = GLU_BACKWARD

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
            "grad_out": ((1, capacity), dtype),
            "self": ((2, capacity), dtype),
            "out": ((2, capacity), dtype),
        }
        return arrays, {"dim": 0}

    def fused_prefix(self, fused: Tensors, units: int) -> dict[str, np.ndarray]:
        return {name: array[:, :units] for name, array in fused.items()}

    def fused_plan(self, key: Hashable, capacity: int, block: int) -> GluPlan:
        return make_glu_plan((2, capacity), 0, key[1], block=block)  # type: ignore[index]

    def gather(self, requests: Sequence[Any], fused: Tensors) -> list[int]:
        # Requests of one signature (same shapes, dim) move together: grad_out with one
        # concatenate into its row, self with one concatenate and two copies of its halves.
        # The concatenated selves are staged in the launch's ``out`` (the kernel writes it
        # after): no fresh memory, whose pages would fault on every launch.
        offsets = [0] * len(requests)
        offset = 0
        g_row, a_row, b_row = fused["grad_out"][0], fused["self"][0], fused["self"][1]
        staging = fused["out"].reshape(-1)
        for members in signature_groups(requests):
            first = requests[members[0]]
            x = first.tensors["self"]
            outer, half = glu_grid(x.shape, first.scalars["dim"])
            start = offset
            for i in members:
                offsets[i] = offset
                offset += outer * half
            rows = len(members) * outer
            segment = slice(start, offset)
            gather_into([requests[i].tensors["grad_out"] for i in members], g_row[segment])
            stacked = staging[2 * start : 2 * offset]
            gather_into([requests[i].tensors["self"] for i in members], stacked)
            halves = stacked.reshape(rows, 2, half)
            np.copyto(a_row[segment].reshape(rows, half), halves[:, 0])
            np.copyto(b_row[segment].reshape(rows, half), halves[:, 1])
        return offsets

    def scatter(self, requests: Sequence[Any], fused: Tensors, offsets: list[int]) -> None:
        # The halves are interleaved back in the launch's ``self`` (the kernel has read it),
        # then copied into each request's own result.
        oa_row, ob_row = fused["out"][0], fused["out"][1]
        staging = fused["self"].reshape(-1)
        for members in signature_groups(requests):
            first = requests[members[0]]
            x = first.tensors["self"]
            outer, half = glu_grid(x.shape, first.scalars["dim"])
            rows = len(members) * outer
            start = offsets[members[0]]
            segment = slice(start, start + rows * half)
            results = staging[2 * start : 2 * segment.stop].reshape(len(members), *x.shape)
            halves = results.reshape(rows, 2, half)
            np.copyto(halves[:, 0], oa_row[segment].reshape(rows, half))
            np.copyto(halves[:, 1], ob_row[segment].reshape(rows, half))
            deliver_each(requests, members, "out", results)
