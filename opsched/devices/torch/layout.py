"""Batch-invariant launches on a framework device: the layout rules every operator follows.

A fused launch on a torch device stacks requests of one shape into a few framework calls
and hands each request its slice back. Its results must not depend on the batch, so the
rules come from what the framework's CPU kernels do (torch 2.x, AVX512;
tests/devices/test_torch_fusion.py holds every rule):

- **Elementwise loops are position-dependent.** aten runs a contiguous row through a
  vectorised body and a scalar tail, and the two round differently (``sigmoid`` changes
  float32 results when the same values sit at another offset). A stacked
  launch therefore keeps each request's *rows* whole, as the framework lays out one request
  alone: a row of GluBackward's half is the same loop whether it is the request's first row or
  the thousandth of a stacked batch (no bit moves).
- **Intra-op threads split a loop's range at arbitrary points** (``TensorIterator``
  hands ranges of at least ``at::internal::GRAIN_SIZE`` = 32,768 elements to threads,
  and a GluBackward's float32 results change between 1 and 2 threads). With several intra-op threads
  a launch's calls are cut between rows into :func:`framework_rows` chunks below that size, so every
  call runs on the calling thread
  (with one thread every call does already). A row longer than that is cut into
  :data:`COLUMN_CHUNK` columns the same way in every batch, whatever the thread count.
- **Small requests stack, large ones do not.** Each operator names the size from which a
  request runs alone on its own tensors (copying it in costs more than a call of its own);
  which way a request goes depends on its own size only.
- **Kernels that parallelise per row** (the group-norm backward's per-(sample, channel)
  sums) keep a row on one thread, so stacking samples as channels changes nothing (the
  same bits on 1 and 2 threads).

Results delivered here are views of the launch's output (as ``torch.split`` returns): the
launch's memory lives until the last of its requests' results is released. A caller's
``out=`` tensor is written instead.

**Host operands.** On the CPU a request whose arrays are all numpy keeps them as numpy
until its launch (:class:`HostOperands`): converting each array to a tensor at submit and
each result back costs more than the launch's own calls (eight conversions and three views a tiny
GroupNormBackward request). A launch instead copies a group's numpy operands into one array with one
``numpy.concatenate`` and makes one tensor of it, and hands such a request numpy views of
its stacked results. The bits are the same either way: a gather copies values, and the
calls see the same stacked layout. A group's first request (which the launch reads the
geometry, dtypes and device from) has its inputs made tensors, views of the same memory.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import torch

from opsched.ops._fusion import gather_into, signature_groups

__all__ = [
    "COLUMN_CHUNK",
    "SERIAL_ELEMENTS",
    "HostOperands",
    "framework_cat",
    "framework_columns",
    "framework_deliver",
    "framework_gather",
    "framework_host",
    "framework_laid_out",
    "framework_output",
    "framework_own",
    "framework_plain",
    "framework_rows",
    "framework_scatter",
    "framework_split",
    "framework_split_deliver",
    "framework_stack",
    "framework_stacks",
    "framework_tensor",
]


class HostOperands(dict[str, Any]):
    """A request's arrays kept as numpy until its launch (see the module docstring): the
    torch device binds a request whose arrays are all numpy on the CPU as this instead of
    a dict of tensors. Its results are delivered as numpy (views of the launch's stacked
    output, or written into the numpy ``out=`` it was given)."""

    __slots__ = ()


_BF16 = np.dtype(ml_dtypes.bfloat16)


def framework_tensor(value: Any) -> Any:
    """``value`` as a CPU tensor: a numpy array as a view of its memory where torch can
    make one (writeable, non-negative strides), else as a copy; a tensor (or None) as it
    is. BFLOAT16 goes through its bits (torch cannot read ml_dtypes' type)."""
    if type(value) is not np.ndarray:
        return value
    if not value.flags.writeable or any(s < 0 for s in value.strides):
        value = np.array(value)
    if value.dtype == _BF16:
        return torch.from_numpy(value.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(value)


def framework_laid_out(array: np.ndarray, shape: Sequence[int]) -> Any:
    """A numpy ``array`` as a C-contiguous CPU tensor of ``shape`` (a lone host request's
    operand in a launch's layout): a view of its memory where it is C-contiguous already,
    else of a C-ordered copy."""
    return framework_tensor(np.ascontiguousarray(array).reshape(shape))


def framework_host(tensor: Any) -> Any:
    """A CPU ``tensor`` as a numpy view of its memory (BFLOAT16 through its bits); numpy
    (or None) as it is."""
    if type(tensor) is np.ndarray or tensor is None:
        return tensor
    tensor = tensor.detach()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(_BF16)
    return tensor.numpy()


#: aten's ``at::internal::GRAIN_SIZE``: a loop over fewer elements runs on the calling
#: thread; one over at least this many may be split between intra-op threads.
SERIAL_ELEMENTS = 32768

#: The width a row longer than a serial call is cut into: a multiple of 128 elements (any
#: vector length up to 2048 bits, twice unrolled), so each cut starts a vectorised body.
COLUMN_CHUNK = (SERIAL_ELEMENTS - 1) // 128 * 128


def framework_rows(rows: int, row: int, cpu: bool) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges over ``rows`` rows of ``row`` elements, each under
    :data:`SERIAL_ELEMENTS` elements (one row at least), on the CPU with several intra-op
    threads; one range on one thread (every call is serial then, and a serial call
    computes each row alike however many it holds, the row sums included) and
    on an accelerator (its elementwise kernels compute every position alike). The cuts
    fall between rows, so they never change a bit, only whether aten may split a call.
    ``cpu``: whether the tensors are on the CPU (``Tensor.is_cpu``, cheaper to ask than
    ``torch.device.type``).
    """
    if not cpu or torch.get_num_threads() == 1:
        return [(0, rows)]
    per = max(1, (SERIAL_ELEMENTS - 1) // max(row, 1))
    return [(start, min(rows, start + per)) for start in range(0, rows, per)]


def framework_columns(row: int, cpu: bool) -> list[tuple[int, int]]:
    """``[start, stop)`` column ranges cutting a row of ``row`` elements into serial calls
    on the CPU (``cpu``; one range elsewhere)."""
    if not cpu or row < SERIAL_ELEMENTS:
        return [(0, row)]
    return [(start, min(row, start + COLUMN_CHUNK)) for start in range(0, row, COLUMN_CHUNK)]


def framework_stacks(
    requests: Sequence[Any],
    key: Callable[[Any], Hashable],
    size: Callable[[Any], int],
    stack_max: int,
    row: Callable[[Any], Hashable],
    inputs: Collection[str],
) -> list[list[list[Any]]]:
    """``requests`` as stacks of groups. A group holds requests of one shape (their checked
    signature where they have one, else ``key(request)``, which reads shapes and scalars
    only: numpy arrays have them too), in order of first appearance;
    the groups whose rows match (``row(request)``: the row's length and layout) form one
    stack, so requests of different shapes share a launch's calls when their rows are
    alike (a sequence of any length, one hidden size). A request of at least ``stack_max``
    elements (``size``) is a stack of its own and runs on its own tensors, uncopied: which
    way a request goes depends on its own size only.

    The first request of each stack's groups, and each request that runs alone, has its
    numpy ``inputs`` made tensors (views of the same memory): the geometry, dtypes and
    device a launch reads from it are the framework's."""
    if len(requests) == 1:  # a lone request (a blocking call, a medium one): one stack
        _lead(requests[0], inputs)
        return [[[requests[0]]]]
    # by the checked signature (same shapes, dtypes, scalars), already a hashable tuple
    # shared by a run of calls seen before: no tensor attributes read per request
    groups = [[requests[i] for i in members] for members in signature_groups(requests, key)]
    stacks: dict[Hashable, list[list[Any]]] = {}
    alone: list[list[list[Any]]] = []
    for group in groups:  # one shape each: one size, weighed once
        _lead(group[0], inputs)
        if size(group[0]) >= stack_max:
            for request in group[1:]:  # each the first of its own stack
                _lead(request, inputs)
            alone.extend([[request]] for request in group)
        else:
            stacks.setdefault(row(group[0]), []).append(group)
    return [*stacks.values(), *alone]


def _lead(request: Any, inputs: Collection[str]) -> None:
    """Make a host request's numpy ``inputs`` tensors, in place (its outputs stay as the
    caller gave them: a numpy ``out=`` is written as numpy)."""
    tensors = request.tensors
    if type(tensors) is HostOperands:
        for name in inputs:
            tensors[name] = framework_tensor(tensors[name])


def framework_cat(tensors: list[Any]) -> Any:
    """``tensors`` (one row shape) concatenated along their first dimension; a lone one as
    itself."""
    return torch.cat(tensors) if len(tensors) > 1 else tensors[0]


def framework_stack(tensors: list[Any]) -> Any:
    """``tensors`` (one shape; tensors or numpy arrays) stacked into one new contiguous
    tensor; a lone one as itself where it is contiguous already (the same layout either
    way). Numpy arrays are copied together on the host, then made one tensor."""
    if len(tensors) == 1:
        return framework_tensor(tensors[0]).contiguous()
    if type(tensors[-1]) is np.ndarray:  # host operands: one numpy copy
        ndarray = np.ndarray
        arrays = [t if type(t) is ndarray else framework_host(t) for t in tensors]
        first = arrays[0]
        # C order whatever the arrays' own (numpy would keep Fortran order if all had it,
        # and aten reads some operands as contiguous whatever their strides)
        stacked = np.empty((len(arrays), *first.shape), first.dtype)
        if first.ndim:  # along the first axis: cheaper than numpy.stack, which makes a
            # new view of each array first (small parts joined as bytes: one dtype, the
            # fusion key's)
            gather_into(arrays, stacked)
        else:
            np.stack(arrays, out=stacked)
        return framework_tensor(stacked)
    try:  # tensors, the usual case: no call for each
        return torch.stack(tensors)
    except TypeError:  # numpy arrays among them (a host request grouped with tensors)
        return torch.stack([framework_tensor(t) for t in tensors])


def framework_gather(stack: Sequence[Sequence[Any]], name: str, shape: Sequence[int]) -> Any:
    """Operand ``name`` of a stack's requests, stacked group by group, as ``shape``."""
    parts = [framework_stack([r.tensors[name] for r in group]) for group in stack]
    if len(parts) == 1:
        return parts[0].view(shape)
    return torch.cat([part.view(-1) for part in parts]).view(shape)


def framework_output(
    stack: Sequence[Sequence[Any]], name: str, shape: Sequence[int], like: Any
) -> Any:
    """Where a launch writes output ``name`` of a stack, as ``shape``: a lone request's own
    contiguous output tensor where it has one (no copy afterwards), else a new tensor of
    ``like``'s dtype and device."""
    alone = len(stack) == 1 and len(stack[0]) == 1
    own = framework_own(stack[0][0].tensors, name) if alone else None
    if own is not None:
        return own.view(shape)
    return torch.empty(shape, dtype=like.dtype, device=like.device)


def framework_own(tensors: dict[str, Any], name: str) -> Any:
    """A request's own output ``name`` as a contiguous tensor a launch can write into (a
    numpy ``out=`` seen as a tensor of its memory); None where it has none, it is not
    contiguous, or it overlaps another of the request's operands (the launch then writes
    elsewhere and :func:`framework_deliver` copies: an output that overlaps an input gets
    the result computed from the input's values before the call, as docs/operators.md says, where
    aten's kernels would read back what they already wrote)."""
    given = tensors[name]
    if given is None:
        return None
    own = given
    if type(own) is np.ndarray:
        if not framework_plain(own):
            return None
        own = framework_tensor(own)
    if not own.is_contiguous():
        return None
    low, high = _extent(given)
    for other_name, other in tensors.items():
        if other is None or other_name == name:
            continue
        other_low, other_high = _extent(other)
        if other_low < high and low < other_high and _same_memory(given, other):
            return None
    return own


def _extent(value: Any) -> tuple[int, int]:
    """The bytes ``[low, high)`` an array or tensor may reach: a numpy array's own bounds,
    a tensor's whole storage (a superset: an overlap found there only costs a copy)."""
    if isinstance(value, np.ndarray):
        low, high = _byte_bounds(value)
        return int(low), int(high)
    storage = value.untyped_storage()
    start = storage.data_ptr()
    return start, start + storage.nbytes()


def _same_memory(a: Any, b: Any) -> bool:
    """Whether two operands' addresses are in one memory: numpy arrays and CPU tensors
    share the host's; a tensor on an accelerator only its own device's."""
    device_a = "cpu" if isinstance(a, np.ndarray) else str(a.device)
    device_b = "cpu" if isinstance(b, np.ndarray) else str(b.device)
    return device_a == device_b


try:  # numpy's byte_bounds: in numpy.lib.array_utils from numpy 2, top-level before
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # pragma: no cover - numpy 1.26
    _byte_bounds = np.byte_bounds  # type: ignore[attr-defined]


def framework_plain(array: np.ndarray) -> bool:
    """Whether torch can take a numpy ``array``'s memory as a launch lays it out: C-contiguous
    and writeable."""
    flags = array.flags
    return flags.c_contiguous and flags.writeable


def framework_scatter(
    out: Any,
    stack: Sequence[Sequence[Any]],
    name: str,
    rows: Sequence[int],
    operand: str,
) -> None:
    """Hand each request of a stack its view of output ``name``: ``out`` holds each group's
    ``rows`` in turn, each request's shaped as its ``operand``."""
    pieces = out.split(list(rows)) if len(stack) > 1 else (out,)
    for group, piece in zip(stack, pieces, strict=True):
        framework_split_deliver(piece, group, name, group[0].tensors[operand].shape)


def framework_split_deliver(
    stacked: Any, group: Sequence[Any], name: str, shape: Sequence[int]
) -> None:
    """Hand each request of ``group`` its view of ``stacked`` (the group's output ``name``,
    one ``shape`` each): numpy views to host requests, tensor views to the others."""
    k = len(group)
    tensor_views: Sequence[Any] | None = None
    host_views: list[Any] | None = None
    for i, r in enumerate(group):
        tensors = r.tensors
        if type(tensors) is HostOperands:
            if host_views is None:  # iterating a numpy array yields its views cheaply
                host_views = list(framework_host(stacked).reshape(k, *shape))
            if tensors[name] is None:  # the usual request: its view, no call
                tensors[name] = host_views[i]
                continue
            view = host_views[i]
        else:
            if tensor_views is None:
                tensor_views = framework_split(stacked, k, shape)
            view = tensor_views[i]
            if tensors[name] is None:  # the usual request: its view, no call
                tensors[name] = view
                continue
        framework_deliver(tensors, name, view)


def framework_split(stacked: Any, k: int, shape: Sequence[int]) -> Sequence[Any]:
    """A stacked output's ``k`` per-request views of ``shape``."""
    return stacked.view(k, *shape).unbind(0) if k > 1 else (stacked.view(shape),)


def framework_deliver(tensors: dict[str, Any], name: str, result: Any) -> None:
    """Hand one request its ``result`` (a tensor, or a numpy view for a host request):
    written into the output it was given (unless the launch wrote there already), or,
    where its launch allocates that output (None), the result itself (a view of the
    launch's output; for a host request, as numpy)."""
    out = tensors[name]
    if out is None:
        if type(tensors) is HostOperands and type(result) is not np.ndarray:
            result = framework_host(result)
        tensors[name] = result
    elif type(out) is np.ndarray:
        host = framework_host(result)
        if not np.may_share_memory(out, host):  # the launch wrote into it, or not
            np.copyto(out, host)
    elif out.data_ptr() != result.data_ptr():
        out.copy_(result)
