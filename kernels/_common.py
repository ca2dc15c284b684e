"""Shared pieces of the kernels: compute dtypes, workspace carving, block iteration.

A fast kernel works on 2-D views ``(rows, cols)`` of its operands (any strides) and walks
them in blocks of at most ``block`` elements. Every block is first brought into contiguous
buffers of the compute dtype carved out of the caller's workspace, so that each ufunc runs
the same contiguous SIMD loop whatever the strides, offsets or block boundaries were: that is
what makes results bit-identical however requests are later batched.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any, cast

import numpy as np

#: Byte alignment of every buffer carved out of a workspace (one cache line).
ALIGN = 64

#: Elements per block when the caller does not choose: 64K float32 = 256 KiB per buffer: large
#: enough to amortise the ~1 us cost of each ufunc call, small enough to stay in cache.
DEFAULT_BLOCK = 65536


def compute_dtype(dtype: np.dtype) -> np.dtype:
    """Return the dtype a kernel computes in: float64 for float64, float32 otherwise.

    FLOAT16 and BFLOAT16 are computed in float32 and rounded once into the output
    (docs/operators.md, "Precision").
    """
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def address(array: np.ndarray) -> int:
    """The address of ``array``'s first byte. For a writeable array through ctypes'
    buffer protocol (about 0.25 us), not ``array.ctypes`` (1-2 us: it builds a helper
    object), since this runs per launch."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(cast(Any, array)))
    except (TypeError, ValueError, BufferError):  # read-only, empty, or not contiguous
        return int(array.ctypes.data)


def aligned(nbytes: int) -> int:
    """Round ``nbytes`` up to a multiple of :data:`ALIGN`."""
    return -(-nbytes // ALIGN) * ALIGN


class Carver:
    """Hands out aligned, typed buffers from a workspace, in a fixed order.

    The planner and the kernel carve the same sequence of buffers, so the planner's byte
    count is exactly what the kernel uses (one :data:`ALIGN` of slack covers the workspace's
    own base address).
    """

    __slots__ = ("_offset", "_ws")

    def __init__(self, workspace: np.ndarray | None) -> None:
        self._ws = workspace
        base = 0 if workspace is None else address(workspace)
        self._offset = (-base) % ALIGN

    @property
    def offset(self) -> int:
        """Bytes of the workspace carved so far (alignment padding included)."""
        return self._offset

    def take(self, count: int, dtype: np.dtype) -> np.ndarray:
        """Return a contiguous 1-D buffer of ``count`` elements of ``dtype``."""
        nbytes = count * dtype.itemsize
        assert self._ws is not None, "a non-empty buffer needs a workspace"
        start = self._offset
        self._offset = start + aligned(nbytes)
        if start + nbytes > self._ws.nbytes:
            msg = f"workspace of {self._ws.nbytes} bytes is too small for the kernel's buffers"
            raise ValueError(msg)
        # a 1-D contiguous uint8 array: read as a buffer (cheaper than a slice, then a view)
        return np.frombuffer(self._ws, dtype, count, start)


def workspace_bytes(buffers: list[tuple[int, np.dtype]]) -> int:
    """Bytes a :class:`Carver` needs for ``buffers`` (count, dtype), slack included."""
    total = sum(aligned(count * dtype.itemsize) for count, dtype in buffers if count)
    return total + ALIGN if total else 0


def blocks(rows: int, cols: int, block: int) -> Iterator[tuple[int, int, int, int]]:
    """Yield ``(r0, r1, c0, c1)`` tiles covering a ``rows x cols`` grid row-major.

    A tile holds at most ``block`` elements: whole rows when a row fits, else pieces of one
    row.
    """
    if cols <= block:
        step = block // cols
        for r0 in range(0, rows, step):
            yield r0, min(rows, r0 + step), 0, cols
    else:
        for r in range(rows):
            for c0 in range(0, cols, block):
                yield r, r + 1, c0, min(cols, c0 + block)


def rows_view(array: Any, shape: tuple[int, ...]) -> Any:
    """Return ``array`` reshaped to ``shape`` without copying, or None when that needs a copy.

    Also for a torch tensor (a torch device splitting a request): its ``view``.
    """
    if not isinstance(array, np.ndarray):
        try:
            return array.view(shape)
        except RuntimeError:
            return None
    try:
        return np.reshape(array, shape, copy=False)
    except ValueError:
        return None


def must_stage(array: Any, shape: tuple[int, ...], compiled: bool) -> bool:
    """True when ``array`` must be copied into the workspace to be read as ``shape``: it
    cannot be viewed so, or a compiled loop reads it and its rows are not unit-stride."""
    view = rows_view(array, shape)
    return view is None or (compiled and flat_rows(view) is None)


def overlaps(out: Any, *inputs: Any) -> bool:
    """True when ``out`` may share memory with one of ``inputs`` (a cheap bounds check;
    for torch tensors: the same storage)."""
    if not isinstance(out, np.ndarray):
        where = out.untyped_storage().data_ptr()
        return any(x.untyped_storage().data_ptr() == where for x in inputs)
    return any(np.may_share_memory(out, x) for x in inputs)


def staged(carve: Carver, array: np.ndarray, stage: bool, shape: tuple[int, ...]) -> np.ndarray:
    """View ``array`` as ``shape``; when ``stage``, first copy it into the workspace.

    Unstaged operands were proven viewable by the plan (same shape and strides), so the
    plain, faster ``reshape`` cannot copy here.
    """
    if not stage:
        return array.reshape(shape)
    buf = carve.take(array.size, array.dtype)
    np.copyto(buf.reshape(array.shape), array)
    return buf.reshape(shape)


def direct(view: np.ndarray, dtype: np.dtype) -> bool:
    """True when ufuncs can use ``view`` as is: the compute dtype and C-contiguous.

    Anything else goes through ``copyto``: a ufunc given a cast or a strided 2-D operand
    allocates a hidden 8192-element scratch buffer per call, while ``copyto`` does not.
    """
    return view.dtype == dtype and view.flags.c_contiguous


def as_compute(buf: np.ndarray, view: np.ndarray) -> np.ndarray:
    """``view`` itself when ufuncs can use it directly, else ``view`` copied into ``buf``."""
    if direct(view, buf.dtype):
        return view
    np.copyto(buf, view, casting="unsafe")
    return buf


def store(target: np.ndarray, result: np.ndarray) -> None:
    """Round ``result`` once into ``target`` (unbuffered cast)."""
    np.copyto(target, result, casting="unsafe")


def flat_rows(view: np.ndarray) -> tuple[np.ndarray, int] | None:
    """Describe a view whose rows have unit stride as ``(flat, row stride)``.

    ``flat`` is a 1-D array of the view's dtype over the memory the view spans, starting at
    its first element (cut from the C-contiguous array that owns it); the row stride (of
    axis 0) counts its elements. None when the last axis is strided, a stride is negative
    or not a whole number of elements, or the owner is not a C-contiguous array: the caller
    then stages the operand. Compiled loops index ``flat`` directly, so every layout of rows
    runs through one code path.
    """
    item = view.itemsize
    shape, strides = view.shape, view.strides
    if not shape:
        return None
    for n, s in zip(shape, strides, strict=True):
        if n > 1 and (s < 0 or s % item):
            return None
    if shape[-1] > 1 and strides[-1] != item:
        return None
    row = strides[0] // item if shape[0] > 1 else 0
    if view.flags.c_contiguous:
        return view.ravel(), row  # a view: the array is C-contiguous
    owner = view
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    if owner is view or not owner.flags.c_contiguous:
        return None
    start = view.ctypes.data - owner.ctypes.data
    span = sum((n - 1) * s for n, s in zip(shape, strides, strict=True)) + item
    if start < 0 or start + span > owner.nbytes:
        return None
    flat = owner.reshape(-1).view(np.uint8)[start : start + span].view(view.dtype)
    return flat, row
