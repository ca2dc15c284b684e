"""GluBackward on a torch device: aten's operator, alone or on stacked requests.

The launcher of :mod:`opsched.devices.torch.launchers`; the layout rules every launch keeps
are in :mod:`opsched.devices.torch.layout`.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from opsched.devices.torch.layout import (
    SERIAL_ELEMENTS,
    HostOperands,
    framework_columns,
    framework_deliver,
    framework_gather,
    framework_output,
    framework_own,
    framework_plain,
    framework_rows,
    framework_scatter,
    framework_stacks,
    framework_tensor,
)
from opsched.kernels.glu import glu_grid
from opsched.ops import GLU_BACKWARD

__all__ = ["call", "launch"]

_INPUTS = GLU_BACKWARD.inputs


def call(tensors: Mapping[str, Any], s: Mapping[str, Any]) -> None:
    """One request: aten's operator (``aclnnGluBackward`` on torch_npu)."""
    if tensors["self"].numel():
        result = torch.ops.aten.glu_backward(tensors["grad_out"], tensors["self"], s["dim"])
        tensors["out"].copy_(result)


def launch(requests: Sequence[Any]) -> None:
    """Requests of one fusion key as one batch-invariant launch."""
    # One request alone is rows ``(outer, 2, half)``: the framework's own layout of it
    # (a half's row is contiguous, rows ``2 * half`` apart). Requests whose rows have one
    # length stack them, whatever their shapes, and every call covers whole rows and
    # runs serially on the CPU (ops/_framework.py): a row computes the same wherever it
    # sits.
    if len(requests) == 1 and _own(requests[0]):  # (a solo launch: aten's own call)
        return
    glu = torch.ops.aten.glu_backward.grad_input
    for stack in framework_stacks(requests, _stack_key, _size, _STACK_MAX, _half, _INPUTS):
        if sum(len(group) for group in stack) <= _ALONE_MAX:
            # a few requests: each its own call costs less than stacking them
            stack = [rest for group in stack if (rest := [r for r in group if not _own(r)])]
            if not stack:
                continue
        x0 = stack[0][0].tensors["self"]
        half = _half(stack[0][0])
        outers = [_grid(group[0])[0] * len(group) for group in stack]
        rows = sum(outers)
        cpu = x0.is_cpu
        columns = framework_columns(half, cpu)
        calls = framework_rows(rows, half, cpu)
        # aten's CPU kernel for FLOAT16 / BFLOAT16 rounds sigmoid(b) into that dtype and
        # computes grad_b from the rounded value: where 1 - s cancels, that is outside
        # the tolerance of docs/operators.md. The contract computes them in float32,
        # rounded once: so do we.
        wide = cpu and x0.dtype in (torch.float16, torch.bfloat16)
        x = framework_gather(stack, "self", (rows, 2, half))
        g = framework_gather(stack, "grad_out", (rows, 1, half))
        out = framework_output(stack, "out", (rows, 2, half), x)
        target = out
        if wide:
            x, g = x.float(), g.float()
            target = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        if rows * half == 0:
            pass
        elif len(columns) == 1:
            for a, b in calls:
                glu(g[a:b], x[a:b], 1, grad_input=target[a:b])
        else:  # rows too long for one serial call: the same column cuts in every row
            for row in range(rows):
                for a, b in columns:
                    cut = (slice(row, row + 1), slice(None), slice(a, b))
                    glu(g[cut], x[cut], 1, grad_input=target[cut])
        if wide:
            out.copy_(target)  # rounded once, to nearest even
        framework_scatter(out, stack, "out", outers, "self")


#: Stacks of at most this many requests run each request as its own call: the stacking's
#: copies, output and split cost more than the calls they save until about this many
#: share a launch (``opsched bench scheduler --parts targets``, its mixed-shape rows). The
#: same bits either way: a row computes alike wherever it sits.
_ALONE_MAX = 8

#: Requests of at least this many elements run alone: aten's own call on their tensors
#: costs less than copying them into a stack and out.
_STACK_MAX = 4096


def _lone(request: Any) -> bool:
    """Run a request launched alone as aten's own call, which lays its rows out as the
    stacked path does, wherever that path would make one call of it; say whether it did.
    That is: contiguous operands computed in their own dtype (on the CPU, FLOAT16 /
    BFLOAT16 are widened: the stacked path), and on the CPU no cut into serial calls: a
    grid under ``SERIAL_ELEMENTS``, or one intra-op thread and rows under it (as
    :func:`framework_rows` and :func:`framework_columns` cut). The checks cost less than
    the stacked path's geometry."""
    t = request.tensors
    x, g = t["self"], t["grad_out"]
    if x.is_cpu:
        if x.dtype in (torch.float16, torch.bfloat16):
            return False
        if x.numel() >= 2 * SERIAL_ELEMENTS and (
            torch.get_num_threads() > 1 or _half(request) >= SERIAL_ELEMENTS
        ):
            return False
    if not (x.is_contiguous() and g.is_contiguous()):
        return False
    dim, own = request.scalars["dim"] % x.dim(), framework_own(t, "out")
    if own is not None:
        torch.ops.aten.glu_backward.grad_input(g, x, dim, grad_input=own)
    else:
        framework_deliver(t, "out", torch.ops.aten.glu_backward(g, x, dim))
    return True


def _own(request: Any) -> bool:
    """Run a request of a small stack as its own call where :func:`_lone` (or, for one of
    numpy arrays, :func:`_lone_host`) would; say whether it did. A host request's inputs
    become tensors first where :func:`_lone_host` would not take it (as stacking makes
    them)."""
    t = request.tensors
    if type(t) is HostOperands:
        if type(t["self"]) is np.ndarray and _lone_host(request):
            return True
        for name in _INPUTS:
            t[name] = framework_tensor(t[name])
    return _lone(request)


def _lone_host(request: Any) -> bool:
    """:func:`_lone` for a request of numpy arrays (a blocking call's, say): aten's own
    call on tensors made of its arrays' memory, its result handed back as numpy, without
    the stacking path's conversions and checks of tensors (a good part of a tiny
    request's launch). The same call on the same values as
    :func:`_lone`: the same bits. Says whether it ran the request: not for tensors,
    FLOAT16 or BFLOAT16, operands that are not C-contiguous and writeable, or a size
    :func:`_lone` would cut."""
    t = request.tensors
    if type(t) is not HostOperands:
        return False
    x, g = t["self"], t["grad_out"]
    if x.dtype.itemsize < 4 or not framework_plain(x) or not framework_plain(g):
        return False
    dim = request.scalars["dim"] % x.ndim
    if x.size >= 2 * SERIAL_ELEMENTS and (
        torch.get_num_threads() > 1 or glu_grid(x.shape, dim)[1] >= SERIAL_ELEMENTS
    ):
        return False
    g_, x_, own = torch.from_numpy(g), torch.from_numpy(x), framework_own(t, "out")
    if own is not None:
        torch.ops.aten.glu_backward.grad_input(g_, x_, dim, grad_input=own)
    else:
        framework_deliver(t, "out", torch.ops.aten.glu_backward(g_, x_, dim).numpy())
    return True


def _stack_key(request: Any) -> Hashable:
    """Requests that stack in one framework launch: the same shape and dim."""
    return request.tensors["self"].shape, request.scalars["dim"]


def _size(request: Any) -> int:
    """A request's size as stacking weighs it: its largest operand's elements."""
    return request.tensors["self"].numel()


def _grid(request: Any) -> tuple[int, int]:
    """A request's ``(outer, half)``: its rows, and their length."""
    x = request.tensors["self"]
    return glu_grid(tuple(x.shape), request.scalars["dim"] % x.dim())


def _half(request: Any) -> int:
    """The length of a request's rows: requests stack when theirs are equal."""
    return _grid(request)[1]
