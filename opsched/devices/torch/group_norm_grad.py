"""GroupNormalizationGrad on a torch device: the contract's formula in torch operations
(no aten operator binds it), alone or on stacked requests' rows.

The launcher of :mod:`opsched.devices.torch.launchers`; the layout rules every launch keeps
are in :mod:`opsched.devices.torch.layout`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from opsched.devices.torch.layout import (
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
from opsched.ops import GROUP_NORM_GRAD

__all__ = ["call", "launch", "tree_sums"]

_INPUTS = GROUP_NORM_GRAD.inputs


def call(tensors: Mapping[str, Any], s: Mapping[str, Any]) -> None:
    """One request (or rows of stacked ones)."""
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
    x_, dy_, gamma_ = (_f32(tensors[k], rows) for k in ("x", "dy", "gamma"))
    mean_, rstd_ = (_f32(tensors[k], stats) for k in ("mean", "rstd"))
    xhat = (x_ - mean_).mul_(rstd_)
    dyg = dy_ * gamma_
    # the CPU's serial sum adds a row in one order wherever it sits (framework_rows
    # keeps every call serial); an accelerator's reduction picks its blocks by the
    # whole call's shape, so there the order is a fixed tree of element-wise adds
    row_sums = _serial_sums if x.is_cpu else tree_sums
    s1 = row_sums(dyg)
    s2 = row_sums(dyg.mul_(xhat))  # (dy * gamma) * xhat
    inner = (dy_ * m).sub_(s1).sub_(xhat.mul_(s2))  # m * dy - s1 - xhat * s2
    scale = (rstd_ / m) * gamma_
    if dx.dtype == torch.float32 and dx.is_contiguous():
        torch.mul(scale, inner, out=dx.view(rows))
    else:  # rounded once into dx's dtype, written through its strides
        dx.copy_(scale.mul_(inner).view(dx.shape))


def launch(requests: Sequence[Any]) -> None:
    """Requests of one fusion key as one batch-invariant launch."""
    # A request is N * G rows of M elements; requests whose rows have one length stack
    # them as (rows, 1, M), whatever their N and G, and each call covers whole rows and
    # runs serially on the CPU (ops/_framework.py): a row's sums and dx are the same
    # wherever it sits.
    if len(requests) == 1 and _lone_host(requests[0]):
        return
    for stack in framework_stacks(requests, _stack_key, _size, _STACK_MAX, _row, _INPUTS):
        x0 = stack[0][0].tensors["x"]
        m = _row(stack[0][0])
        counts = [
            len(group) * group[0].tensors["x"].shape[0] * group[0].tensors["x"].shape[1]
            for group in stack
        ]
        rows = sum(counts)
        stacked = {
            name: framework_gather(stack, name, (rows, 1, size))
            for name, size in (("x", m), ("dy", m), ("gamma", m), ("mean", 1), ("rstd", 1))
        }
        stacked["dx"] = out = framework_output(stack, "dx", (rows, 1, m), x0)
        _rows_calls(stacked, rows, m, x0.is_cpu)
        framework_scatter(out, stack, "dx", counts, "x")


def _rows_calls(stacked: dict[str, Any], rows: int, m: int, cpu: bool) -> None:
    """The framework calls on ``stacked`` operands of ``rows`` rows of ``m``: one on the
    whole tensors (no slice to make), or one per :func:`framework_rows` range."""
    calls = framework_rows(rows, m, cpu)
    if len(calls) == 1:
        call(stacked, {})
        return
    for a, b in calls:
        call({k: v[a:b] for k, v in stacked.items()}, {})


def _lone_host(request: Any) -> bool:
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
        name: framework_laid_out(t[name], (rows, 1, size))
        for name, size in (("x", m), ("dy", m), ("gamma", m), ("mean", 1), ("rstd", 1))
    }
    own = framework_own(t, "dx")
    if own is not None:
        call["dx"] = dx = own.view(rows, 1, m)
    else:
        call["dx"] = dx = torch.empty((rows, 1, m), dtype=call["x"].dtype)
    _rows_calls(call, rows, m, True)
    framework_deliver(t, "dx", framework_host(dx).reshape(x.shape))
    return True


def _serial_sums(rows: Any) -> Any:
    """Each row's sum (the last axis), kept as an axis of one: aten's own reduction."""
    return rows.sum(-1, keepdim=True)


def tree_sums(rows: Any) -> Any:
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


def _f32(tensor: Any, shape: tuple[int, ...]) -> Any:
    """``tensor`` in float32, seen as ``shape`` (no call where it already is either)."""
    if tensor.dtype != torch.float32:
        tensor = tensor.to(torch.float32)
    return tensor if tensor.shape == shape else tensor.reshape(shape)


def _row(request: Any) -> int:
    """The length of a request's rows (M): requests stack when theirs are equal."""
    return math.prod(request.tensors["x"].shape[2:])
