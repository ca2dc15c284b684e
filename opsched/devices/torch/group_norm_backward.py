"""GroupNormBackward on a framework device: the batch-invariant stacked launch.

Requests whose groups match (channels per group, HxW) stack their samples as the channels
of one sample, so one aten call serves requests of any N and C; the rules every framework
launch follows are in :mod:`opsched.ops._framework`. Kept apart from the operator's module,
which holds its checks, planning and numpy fusion.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from opsched.devices.torch.layout import (
    HostOperands,
    framework_cat,
    framework_deliver,
    framework_gather,
    framework_host,
    framework_laid_out,
    framework_split_deliver,
    framework_stack,
    framework_stacks,
    framework_tensor,
)
from opsched.ops import GROUP_NORM_BACKWARD

__all__ = ["call", "framework_dtypes", "launch"]

_INPUTS = GROUP_NORM_BACKWARD.inputs

_OUTPUTS = ("dx", "dgamma", "dbeta")


def call(tensors: Mapping[str, Any], s: Mapping[str, Any]) -> None:
    """One request: aten's operator (``aclnnGroupNormBackward`` on torch_npu)."""
    t = tensors
    n, c, hxw, group, mask = s["N"], s["C"], s["HxW"], s["group"], s["output_mask"]
    outs = (t["dx"], t["dgamma"], t["dbeta"])
    if n * c * hxw == 0:
        for out in outs[1:]:
            if out is not None:
                out.zero_()
        return
    gamma = t["gamma"].reshape(c) if t["gamma"] is not None else None
    results = torch.ops.aten.native_group_norm_backward(
        t["grad_out"].reshape(n, c, hxw),
        t["input"].reshape(n, c, hxw),
        t["mean"].reshape(n, group),
        t["rstd"].reshape(n, group),
        gamma,
        n,
        c,
        hxw,
        group,
        list(mask),
    )
    for out, result in zip(outs, results, strict=True):
        if out is not None and result is not None:
            out.copy_(result.reshape(out.shape))


def launch(requests: Sequence[Any]) -> None:
    """Requests of one fusion key as one batch-invariant launch: stacked as the
    channels of one sample, x as ``(1, channels, HxW)`` in ``channels / cpg`` groups, gamma repeated
    per sample. aten computes a channel's sums and a group's dx on one thread each, so dx
    is each request's own call, bit for bit, on any number of threads; dgamma /
    dbeta come per sample and are summed over a request's samples here, in order."""
    requests = [r for r in requests if not _own_call(r)]  # the CPU's: each its own call
    if not requests:
        return
    aten_call = torch.ops.aten.native_group_norm_backward
    for stack in framework_stacks(requests, _stack_key, _size, _STACK_MAX, _row, _INPUTS):
        first = stack[0][0]
        x0, stat_dtype = first.tensors["input"], first.tensors["mean"].dtype
        mask, hxw = first.scalars["output_mask"], first.scalars["HxW"]
        if _row(first) is _EMPTY:  # nothing to compute: dx is empty, the sums are zero
            for group in stack:
                _deliver_empty(group)
            continue
        data, wide = framework_dtypes(x0, stat_dtype)
        if _size(first) >= _STACK_MAX:  # large: alone, whatever it was launched with
            _alone(first, data, wide)
            continue
        if len(stack) == 1 and len(stack[0]) == 1:  # small, by itself: the same calls, flat
            _lone(first, data, wide)
            continue
        geometry = [(len(g), g[0].scalars["N"], g[0].scalars["C"]) for g in stack]
        channels = [k * n * c for k, n, c in geometry]
        total = sum(channels)
        groups = total // (first.scalars["C"] // first.scalars["group"])
        shapes: dict[str, tuple[int, ...]] = {
            "grad_out": (1, total, hxw),
            "input": (1, total, hxw),
            "mean": (1, groups),
            "rstd": (1, groups),
        }
        operands = {n: framework_gather(stack, n, shape) for n, shape in shapes.items()}
        gammas = []
        for group, (k, n, c) in zip(stack, geometry, strict=True):
            # aten reads gamma as contiguous whatever its strides, and cannot give
            # dgamma without one: an absent gamma is ones (docs/operators.md)
            if group[0].tensors["gamma"] is None:
                gammas.append(torch.ones(k * n * c, dtype=wide, device=x0.device))
            else:  # [gamma_i] * n per request: one cat (several times cheaper than repeat)
                gamma = _wide(framework_stack([r.tensors["gamma"] for r in group]), wide)
                gammas.append(torch.cat([gamma.view(k, c)] * n, dim=1).view(-1))
        dx, dgamma, dbeta = aten_call(
            _wide(operands["grad_out"], data),
            _wide(operands["input"], data),
            _wide(operands["mean"], wide),
            _wide(operands["rstd"], wide),
            framework_cat(gammas),
            1,
            total,
            hxw,
            groups,
            list(mask),
        )
        if dx is not None:
            dx = _wide(dx, x0.dtype)  # computed wider on an accelerator: rounded once
        pieces = [
            v.view(-1).split([ch * each for ch in channels])
            if v is not None and len(stack) > 1
            else (v,) * len(stack)
            for v, each in ((dx, hxw), (dgamma, 1), (dbeta, 1))
        ]
        for i, (group, (k, n, c)) in enumerate(zip(stack, geometry, strict=True)):
            sums = _sample_sums(pieces[1][i], pieces[2][i], k, n, c, stat_dtype)
            _deliver(group, (pieces[0][i], *sums))


def framework_dtypes(x: Any, stat_dtype: Any) -> tuple[Any, Any]:
    """``(data, statistics)``: the dtypes a launch hands aten's GroupNormBackward its
    ``grad_out`` / ``input`` and its ``mean`` / ``rstd`` / ``gamma`` in, for ``x`` (any
    request of the launch) with statistics of ``stat_dtype``.

    On the CPU the data keep their dtype and the statistics and gamma go in at least
    float32 (exact): aten's CPU kernel takes mixed dtypes, and then returns the per-sample
    dgamma / dbeta unrounded (dx is unchanged). aten's CUDA kernel reads every operand in
    the input's dtype (``GroupNormBackwardKernelImplInternal<T>``), so an accelerator gets
    one dtype for all: float32 for FLOAT16 and BFLOAT16 (computed in float32 and rounded
    once into the outputs, as docs/operators.md says), float32 too where the statistics are
    FLOAT beside half-precision data.
    """
    wide = torch.promote_types(stat_dtype, torch.float32)
    if x.is_cpu:
        return x.dtype, wide
    compute = torch.promote_types(x.dtype, wide)
    return compute, compute


def _alone(request: Any, data: Any, wide: Any) -> None:
    """Run a large request as aten's own call on its own tensors and geometry (aten sums
    dgamma / dbeta over the samples itself), statistics and gamma widened as a stacked
    launch widens them; its results come in its own shapes (no view to make). ``data``
    None: its operands go in as they are (:func:`_own_call`'s usual request, where every
    widening and rounding would change nothing)."""
    t, s = request.tensors, request.scalars
    x, gamma, mask = t["input"], t["gamma"], s["output_mask"]
    operands = (t["grad_out"], x, t["mean"], t["rstd"], gamma)
    if data is not None:
        if gamma is None:  # aten cannot give dgamma without one: ones, what none means
            gamma = torch.ones(s["C"], dtype=wide, device=x.device)
        dtypes = (data, data, wide, wide, wide)
        operands = tuple(_wide(o, d) for o, d in zip((*operands[:4], gamma), dtypes, strict=True))
    grad_out, x_in, mean, rstd, gamma_in = operands
    # aten reads every operand as contiguous whatever its strides: made so
    results = torch.ops.aten.native_group_norm_backward(
        grad_out.contiguous(),
        x_in.contiguous(),
        mean.contiguous(),
        rstd.contiguous(),
        gamma_in.contiguous(),
        s["N"],
        s["C"],
        s["HxW"],
        s["group"],
        list(mask),
    )
    if data is None:
        for name, result, want in zip(_OUTPUTS, results, mask, strict=True):
            if want:
                framework_deliver(t, name, result)
        return
    rounded = (x.dtype, t["mean"].dtype, t["mean"].dtype)  # dx, dgamma, dbeta
    for name, result, want, dtype in zip(_OUTPUTS, results, mask, rounded, strict=True):
        if want:
            framework_deliver(t, name, _wide(result, dtype))


def _lone(request: Any, data: Any, wide: Any) -> None:
    """A small request launched by itself, in the stacked layout: the framework calls a
    stack of this one request makes, on the same values (so the same bits), without the
    stacking's per-group bookkeeping (a lone GroupNormBackward 4 x 64 x 8: 103-113 ->
    86-89 us of launch, aten's call 12 of it; the rest is twenty-odd small torch calls)."""
    t, s = request.tensors, request.scalars
    n, c, hxw, mask = s["N"], s["C"], s["HxW"], s["output_mask"]
    total, groups = n * c, n * s["group"]
    x, gamma, stat_dtype = t["input"], t["gamma"], t["mean"].dtype
    if gamma is None:  # aten cannot give dgamma without one: ones, what an absent gamma means
        gammas = torch.ones(total, dtype=wide, device=x.device)
    else:  # [gamma] * n, as a stack of one repeats it
        gammas = torch.cat([_wide(gamma.contiguous(), wide).view(1, c)] * n, dim=1).view(-1)
    rows, stats = (1, total, hxw), (1, groups)
    dx, dgamma, dbeta = torch.ops.aten.native_group_norm_backward(
        _wide(t["grad_out"].contiguous().view(rows), data),
        _wide(x.contiguous().view(rows), data),
        _wide(t["mean"].contiguous().view(stats), wide),
        _wide(t["rstd"].contiguous().view(stats), wide),
        gammas,
        1,
        total,
        hxw,
        groups,
        list(mask),
    )
    if dx is not None:
        dx = _wide(dx, x.dtype)  # computed wider on an accelerator: rounded once
    sums = _sample_sums(dgamma, dbeta, 1, n, c, stat_dtype)
    stat_shape = _stat_shape(request)
    shapes = (tuple(x.shape), stat_shape, stat_shape)
    for name, result, shape, want in zip(_OUTPUTS, (dx, *sums), shapes, mask, strict=True):
        if want:
            framework_deliver(t, name, result.view(shape))


def _own_call(request: Any) -> bool:
    """On the CPU, a request with something to compute runs as aten's own call on its
    own tensors and geometry, whatever it is launched with (docs/torch.md): its dgamma /
    dbeta are aten's own bits, requests of mixed shapes are not cut into stacks of a few
    (the launcher's cost more than their own calls), and a request launched alone makes
    aten's one call, not a stack's twenty-odd torch calls around it; a request that
    always runs alone gets the same bits in any batch. Says whether it ran the request
    (not: an accelerator's, or one with nothing to compute)."""
    t, s = request.tensors, request.scalars
    if not s["N"] * s["C"] * s["HxW"]:
        return False
    if type(t) is HostOperands:
        _own_host(request)
        return True
    x, mean, float32 = t["input"], t["mean"], torch.float32
    if not x.is_cpu:
        return False
    gamma = t["gamma"]
    if (
        mean.dtype is float32
        and t["rstd"].dtype is float32
        and gamma is not None
        and gamma.dtype is float32
    ):  # the usual request: aten takes its operands and gives its results as they are
        _alone(request, None, None)
    else:
        _alone(request, *framework_dtypes(x, mean.dtype))
    return True


def _own_host(request: Any) -> None:
    """:func:`_alone` for a request of numpy arrays (a blocking call's, say): the same aten
    call on the same values, on tensors viewing its arrays (statistics and gamma in at
    least float32, as :func:`framework_dtypes` says for the CPU), its results rounded
    once into the request's dtypes and handed back as numpy."""
    t, s = request.tensors, request.scalars
    n, c, hxw, group, mask = s["N"], s["C"], s["HxW"], s["group"], s["output_mask"]
    x, stat_dtype = t["input"], t["mean"].dtype
    wide = np.promote_types(stat_dtype, np.float32)

    def tensor(name: str, shape: tuple[int, ...], dtype: Any = None) -> Any:
        array = t[name] if dtype is None else t[name].astype(dtype, copy=False)
        return framework_laid_out(array, shape)

    # aten cannot give dgamma without a gamma: ones, what an absent gamma means
    ones = t["gamma"] is None
    gammas = framework_tensor(np.ones(c, wide)) if ones else tensor("gamma", (c,), wide)
    results = torch.ops.aten.native_group_norm_backward(
        tensor("grad_out", (n, c, hxw)),
        tensor("input", (n, c, hxw)),
        tensor("mean", (n, group), wide),
        tensor("rstd", (n, group), wide),
        gammas,
        n,
        c,
        hxw,
        group,
        list(mask),
    )
    shapes = (x.shape, _stat_shape(request), _stat_shape(request))
    dtypes = (x.dtype, stat_dtype, stat_dtype)
    for name, result, want, shape, dtype in zip(
        _OUTPUTS, results, mask, shapes, dtypes, strict=True
    ):
        if want:
            host = framework_host(result).astype(dtype, copy=False)
            framework_deliver(t, name, host.reshape(shape))


def _stat_shape(request: Any) -> tuple[int, ...]:
    """The shape of a request's dgamma and dbeta: gamma's, or (C,) without one."""
    gamma = request.tensors["gamma"]
    return tuple(gamma.shape) if gamma is not None else (request.scalars["C"],)


def _deliver(group: Sequence[Any], results: Sequence[Any]) -> None:
    """Hand each request of ``group`` (one shape) its views of ``results`` (dx,
    dgamma, dbeta stacked over the group; None where not asked for)."""
    stat_shape = _stat_shape(group[0])
    shapes = (tuple(group[0].tensors["input"].shape), stat_shape, stat_shape)
    mask = group[0].scalars["output_mask"]
    for name, result, shape, want in zip(_OUTPUTS, results, shapes, mask, strict=True):
        if want:
            framework_split_deliver(result, group, name, shape)


def _deliver_empty(group: Sequence[Any]) -> None:
    """A group with nothing to compute: an empty dx, zero dgamma / dbeta."""
    first, k = group[0].tensors, len(group)
    x0 = first["input"]
    dx = torch.empty((k, *x0.shape), dtype=x0.dtype, device=x0.device)
    stat = torch.zeros((k, *_stat_shape(group[0])), dtype=first["mean"].dtype, device=x0.device)
    _deliver(group, (dx, stat, stat.clone()))


#: Requests of at least this many elements run alone, on their own tensors: copying them
#: into a stack and the fresh memory it takes cost more than the framework calls a launch
#: makes.
_STACK_MAX = 8192


def _stack_key(request: Any) -> Hashable:
    """Requests that stack in one framework launch: the same shapes and scalars."""
    t = request.tensors
    gamma = t["gamma"]
    shapes = (t["grad_out"].shape, t["input"].shape, t["mean"].shape, t["rstd"].shape)
    return shapes, None if gamma is None else gamma.shape, *request.scalars.values()


def _sample_sums(dgamma: Any, dbeta: Any, k: int, n: int, c: int, dtype: Any) -> tuple[Any, Any]:
    """A stacked launch's per-sample dgamma and dbeta summed over each request's ``n``
    samples, then rounded to ``dtype`` (None where not computed). One ``cumsum`` for both:
    aten accumulates each (request, channel) lane on its own, in sample order, in float64
    on the CPU, so a lane's sum does not depend on the lanes beside it."""
    stats = [s for s in (dgamma, dbeta) if s is not None]
    if not stats:
        return None, None
    both = torch.stack(stats) if len(stats) > 1 else stats[0]
    totals = _wide(both.view(len(stats), k, n, c).cumsum(2)[:, :, -1], dtype).unbind(0)
    sums = iter(totals)
    return tuple(None if s is None else next(sums) for s in (dgamma, dbeta))  # type: ignore[return-value]


def _size(request: Any) -> int:
    """A request's size as stacking weighs it: its largest operand's elements."""
    return request.tensors["input"].numel()


def _wide(tensor: Any, dtype: Any) -> Any:
    """``tensor`` in ``dtype`` (no call when it is already: each costs a few us)."""
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


#: The row key of a request with nothing to compute (N, C or HxW zero).
_EMPTY = ("empty",)


def _row(request: Any) -> Hashable:
    """What must match for requests to stack as channels: channels per group and HxW."""
    s = request.scalars
    if s["N"] * s["C"] * s["HxW"] == 0:
        return _EMPTY
    return s["C"] // s["group"], s["HxW"]
