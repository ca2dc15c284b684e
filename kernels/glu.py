"""GluBackward kernels: the reference formula and a blocked, allocation-free fast kernel.

``self`` of shape ``S`` is split along ``dim`` into halves ``a`` and ``b``. With
``outer = prod(S[:dim])`` and ``H = S[dim] // 2 * prod(S[dim + 1:])`` a C-ordered ``self`` is
the view ``(outer, 2, H)``, ``grad_out`` is ``(outer, H)`` and the operation is elementwise
over the ``(outer, H)`` grid::

    s      = 1 / (1 + exp(-b))
    grad_a = grad_out * s
    grad_b = grad_a * (a - a * s)

For FLOAT, FLOAT16 and BFLOAT16 the fast kernel is one compiled loop (:mod:`._jit`): each
element is loaded, converted, computed and stored in registers, in one pass over memory, with
no scratch memory at all. Rows must have unit stride; operands whose rows do not (transposed,
step-sliced) are first copied into the workspace, and an ``out`` that overlaps an input is
computed into the workspace and copied at the end: both copies are part of the planned
workspace size. DOUBLE keeps the numpy ufunc kernel: it walks the grid in blocks small enough
to stay in L2, each ufunc over a contiguous buffer.

A table launch (:func:`glu_backward_table`) runs many requests in one compiled call: a
row of operand addresses and geometry per request (:func:`glu_table_row`), each request
computed by the same loop with the arguments of its own launch, on its own arrays.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numba
import numpy as np

from . import _jit
from ._common import (
    DEFAULT_BLOCK,
    Carver,
    as_compute,
    blocks,
    compute_dtype,
    direct,
    must_stage,
    overlaps,
    staged,
    store,
    workspace_bytes,
)

#: Compute-dtype block buffers :func:`glu_backward_rows` needs.
ROW_BUFFERS = 4

__all__ = [
    "ROW_BUFFERS",
    "GluPlan",
    "glu_backward_fast",
    "glu_backward_reference",
    "glu_backward_rows",
    "glu_backward_runner",
    "glu_backward_table",
    "glu_grid",
    "make_glu_plan",
    "plan_glu_backward",
    "glu_table_row",
]


@np.errstate(all="ignore")  # NaN / Inf are computed through, as on the device
def glu_backward_reference(grad_out: np.ndarray, self: np.ndarray, dim: int) -> np.ndarray:
    """Return ``glu_backward(grad_out, self, dim)`` straight from its formula
    (docs/operators.md).

    FLOAT16 / BFLOAT16 are computed in float32, DOUBLE in float64, and rounded once. The
    float32 sigmoid is the compiled kernels' :func:`._jit.sigmoid`, so the reference device
    and the compiled kernel agree bit for bit; the tests' float64 goldens stay independent
    of both.
    """
    ct = compute_dtype(self.dtype)
    a, b = np.split(self.astype(ct), 2, axis=dim)
    g = grad_out.astype(ct)
    s = 1 / (1 + np.exp(-b)) if ct == np.float64 else _jit.sigmoid32(b)
    grad_a = g * s
    grad_b = grad_a * (a - a * s)
    return np.concatenate([grad_a, grad_b], axis=dim).astype(self.dtype)


class GluPlan(NamedTuple):
    """The geometry and workspace layout of one GluBackward launch (pure data)."""

    shape: tuple[int, ...]
    dim: int
    outer: int
    half: int
    dtype: np.dtype
    block: int
    stage_grad: bool
    stage_self: bool
    stage_out: bool
    workspace_bytes: int

    @property
    def size(self) -> int:
        """Elements of ``self`` (0 for an empty launch)."""
        return 2 * self.outer * self.half


def plan_glu_backward(
    grad_out: np.ndarray,
    self: np.ndarray,
    dim: int,
    out: np.ndarray,
    *,
    block: int = DEFAULT_BLOCK,
) -> GluPlan:
    """Plan a launch on validated arguments: which operands to stage, workspace bytes."""
    shape = self.shape
    dim %= self.ndim
    outer, half = glu_grid(shape, dim)
    compiled = _jit.kind_of(self.dtype) is not None
    return make_glu_plan(
        shape,
        dim,
        self.dtype,
        stage_grad=must_stage(grad_out, (outer, half), compiled),
        stage_self=must_stage(self, (outer, 2, half), compiled),
        stage_out=must_stage(out, (outer, 2, half), compiled) or overlaps(out, grad_out, self),
        block=block,
    )


def glu_grid(shape: tuple[int, ...], dim: int) -> tuple[int, int]:
    """``(outer, half)``: the elementwise grid of a GLU of ``shape`` split along ``dim``."""
    return math.prod(shape[:dim]), shape[dim] // 2 * math.prod(shape[dim + 1 :])


def make_glu_plan(
    shape: tuple[int, ...],
    dim: int,
    dtype: np.dtype,
    *,
    stage_grad: bool = False,
    stage_self: bool = False,
    stage_out: bool = False,
    block: int = DEFAULT_BLOCK,
) -> GluPlan:
    """Plan from geometry alone (e.g. for gathered, contiguous operands)."""
    outer, half = glu_grid(shape, dim)
    n = outer * half
    ct = compute_dtype(dtype)
    rows = 0 if _jit.kind_of(np.dtype(dtype)) is not None else ROW_BUFFERS  # compiled: none
    buffers = [
        (2 * n if stage_self else 0, dtype),
        (n if stage_grad else 0, dtype),
        (2 * n if stage_out else 0, dtype),
    ] + [(min(block, n), ct)] * rows
    nbytes = workspace_bytes(buffers) if n else 0
    return GluPlan(shape, dim, outer, half, dtype, block, stage_grad, stage_self, stage_out, nbytes)


def glu_backward_fast(
    plan: GluPlan,
    grad_out: np.ndarray,
    self: np.ndarray,
    out: np.ndarray,
    workspace: np.ndarray | None,
) -> None:
    """Compute GluBackward into ``out`` using only ``workspace`` for scratch memory.

    Args:
        plan: from :func:`plan_glu_backward` on arrays of the same geometry, or from
            :func:`make_glu_plan` for a larger one with the same layout (a prefix of the
            planned arrays may run on it: sizes are read from the arrays).
        grad_out, self, out: the operands (any strides; ``out`` may overlap the inputs only
            when the plan stages it).
        workspace: a ``uint8`` array of at least ``plan.workspace_bytes`` (None when 0).
    """
    _prepared(plan, grad_out, self, out)(workspace)


def _prepared(
    plan: GluPlan, grad_out: np.ndarray, self: np.ndarray, out: np.ndarray
) -> Callable[[np.ndarray | None], None]:
    """The launch of ``plan`` on these arrays, a function of the workspace: the staged
    numpy or compiled path, or the compiled loop's call on arguments computed here."""
    outer, half = glu_grid(self.shape, plan.dim)  # sizes from the arrays: <= the plan's
    kind = _jit.kind_of(plan.dtype)
    if outer * half == 0:
        return _nothing
    if kind is None or plan.stage_self or plan.stage_grad or plan.stage_out:
        return functools.partial(_glu_staged, plan, kind, grad_out, self, out, outer, half)
    args = _compiled_args(kind, grad_out, self, out, outer, half)
    loop = _LOOPS[kind.name]
    return lambda workspace: loop(*args)


def glu_backward_runner(
    plan: GluPlan, grad_out: np.ndarray, self: np.ndarray, out: np.ndarray
) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None] | None:
    """The usual launch of ``plan`` with its layout checked once, on these arrays: a
    function ``run(grad_out, self, out)`` for every later call whose arrays have these
    shapes, dtypes and strides and whose output overlaps no input (it needs no workspace).
    None for any other launch: DOUBLE (the numpy kernel), a staged operand, an operand that
    is not C-contiguous, or nothing to compute.

    A call made again with arrays laid out as before pays for the flat views and the
    compiled call alone (GluBackward 8x64: 2.2 -> about 0.5 us before the call)."""
    outer, half = glu_grid(self.shape, plan.dim)
    kind = _jit.kind_of(plan.dtype)
    if outer * half == 0 or kind is None:
        return None
    if plan.stage_self or plan.stage_grad or plan.stage_out:
        return None
    if not (grad_out.flags.c_contiguous and self.flags.c_contiguous and out.flags.c_contiguous):
        return None
    loop = _ROWS_LOOPS[kind.name]
    if plan.dtype == kind.storage:  # float32: the arrays' own flat views

        def run(grad_out: np.ndarray, self: np.ndarray, out: np.ndarray) -> None:
            loop(grad_out.ravel(), self.ravel(), out.ravel(), outer, half)

        return run
    bits = kind.storage  # the half types: their flat views as raw 16-bit words

    def run_bits(grad_out: np.ndarray, self: np.ndarray, out: np.ndarray) -> None:
        loop(
            grad_out.ravel().view(bits),
            self.ravel().view(bits),
            out.ravel().view(bits),
            outer,
            half,
        )

    return run_bits


def _nothing(workspace: np.ndarray | None) -> None:
    """The launch of an empty request."""


def _glu_staged(
    plan: GluPlan,
    kind: _jit.Kind | None,
    grad_out: np.ndarray,
    self: np.ndarray,
    out: np.ndarray,
    outer: int,
    half: int,
    workspace: np.ndarray | None,
) -> None:
    """A launch that stages operands in the workspace, or (``kind`` None: DOUBLE) runs the
    numpy kernel."""
    carve = Carver(workspace)
    self3 = staged(carve, self, plan.stage_self, (outer, 2, half))
    grad2 = staged(carve, grad_out, plan.stage_grad, (outer, half))
    if plan.stage_out:
        target = carve.take(2 * outer * half, plan.dtype)
        out3 = target.reshape(outer, 2, half)
    else:
        out3 = out.reshape(outer, 2, half)  # viewable: the plan checked
    if kind is not None:
        _LOOPS[kind.name](*_compiled_args(kind, grad2, self3, out3, outer, half))
    else:
        ct = compute_dtype(plan.dtype)
        bufs = [carve.take(min(plan.block, outer * half), ct) for _ in range(ROW_BUFFERS)]
        glu_backward_rows(
            grad2, self3[:, 0, :], self3[:, 1, :], out3[:, 0, :], out3[:, 1, :], bufs, plan.block
        )
    if plan.stage_out:
        np.copyto(out, target.reshape(out.shape))


@np.errstate(all="ignore")  # NaN / Inf are computed through, as on the device
def glu_backward_rows(
    g: np.ndarray,
    a: np.ndarray,
    b: np.ndarray,
    out_a: np.ndarray,
    out_b: np.ndarray,
    bufs: list[np.ndarray],
    block: int,
) -> None:
    """The blocked core on 2-D views of one shape ``(rows, cols)``.

    ``bufs``: :data:`ROW_BUFFERS` buffers of ``min(block, rows * cols)`` elements of the
    compute dtype.
    """
    rows, cols = g.shape
    ct = bufs[0].dtype
    one = ct.type(1)
    for r0, r1, c0, c1 in blocks(rows, cols, block):
        tile = (r1 - r0, c1 - c0)
        n = tile[0] * tile[1]
        s, t, u, v = (buf[:n].reshape(tile) for buf in bufs)
        # s = sigmoid(b) in a contiguous buffer, so exp always takes the same SIMD loop
        # (bit-identical results whatever the operands' strides or the tile boundaries).
        np.negative(as_compute(s, b[r0:r1, c0:c1]), out=s)
        np.exp(s, out=s)
        np.add(s, one, out=s)
        np.reciprocal(s, out=s)
        np.multiply(as_compute(t, g[r0:r1, c0:c1]), s, out=t)  # grad_a, unrounded
        store(out_a[r0:r1, c0:c1], t)  # rounded once into out
        aa = as_compute(u, a[r0:r1, c0:c1])
        np.multiply(aa, s, out=v)
        np.subtract(aa, v, out=v)
        ob = out_b[r0:r1, c0:c1]
        if direct(ob, ct):
            np.multiply(t, v, out=ob)  # grad_b = grad_a * (a - a * s), straight into out
        else:
            np.multiply(t, v, out=v)
            store(ob, v)


@_jit.body
def _glu_body(g, go, gs, x, xa, xb, xs, o, oa, ob, os_, rows, cols, load, store):  # type: ignore[no-untyped-def]
    """The compiled GluBackward loop (see :mod:`._jit`).

    Operands are flat 1-D arrays with, per ``(outer, half)`` row ``i``: ``grad_out`` at
    ``g[go + i * gs + j]``, ``a`` / ``b`` at ``x[xa / xb + i * xs + j]``, ``grad_a`` /
    ``grad_b`` at ``o[oa / ob + i * os_ + j]``. The formula is docs/operators.md's, in float32, each
    output rounded once.
    """
    for i in range(rows):
        # row slices: unit-stride arrays LLVM can check for overlap once per row and
        # vectorise (indexing the flat arrays directly defeats its alias analysis)
        g_row = g[go + i * gs : go + i * gs + cols]
        a_row = x[xa + i * xs : xa + i * xs + cols]
        b_row = x[xb + i * xs : xb + i * xs + cols]
        oa_row = o[oa + i * os_ : oa + i * os_ + cols]
        ob_row = o[ob + i * os_ : ob + i * os_ + cols]
        for j in range(cols):
            s = _jit.sigmoid(load(b_row[j]))
            grad_a = load(g_row[j]) * s
            a = load(a_row[j])
            oa_row[j] = store(grad_a)
            ob_row[j] = store(grad_a * (a - a * s))


def _signature(storage: str) -> object:
    i8, inp = _jit.I8, _jit.readonly(storage)
    out = _jit.writeable(storage)
    return _jit.void(inp, i8, i8, inp, i8, i8, i8, out, i8, i8, i8, i8, i8)


def _glu_float32(g, go, gs, x, xa, xb, xs, o, oa, ob, os_, rows, cols):  # type: ignore[no-untyped-def]
    _glu_body(g, go, gs, x, xa, xb, xs, o, oa, ob, os_, rows, cols, _jit.same, _jit.same)


def _glu_float16(g, go, gs, x, xa, xb, xs, o, oa, ob, os_, rows, cols):  # type: ignore[no-untyped-def]
    _glu_body(
        g, go, gs, x, xa, xb, xs, o, oa, ob, os_, rows, cols, _jit.half_to_f32, _jit.f32_to_half
    )


def _glu_bfloat16(g, go, gs, x, xa, xb, xs, o, oa, ob, os_, rows, cols):  # type: ignore[no-untyped-def]
    _glu_body(
        g, go, gs, x, xa, xb, xs, o, oa, ob, os_, rows, cols, _jit.bf16_to_f32, _jit.f32_to_bf16
    )


#: The entry point of each storage kind (:data:`._jit.KINDS`), compiled on first use.
_LOOPS = _jit.Loops(
    {
        "float32": (_glu_float32, _signature("float32")),
        "float16": (_glu_float16, _signature("uint16")),
        "bfloat16": (_glu_bfloat16, _signature("uint16")),
    }
)


def _rows_signature(storage: str) -> object:
    inp, out = _jit.readonly(storage), _jit.writeable(storage)
    return _jit.void(inp, inp, out, _jit.I8, _jit.I8)


@_jit.body
def _glu_rows_body(g, x, o, rows, cols, load, store):  # type: ignore[no-untyped-def]
    """:func:`_glu_body` on C-contiguous operands: rows ``(rows, cols)`` of ``grad_out``,
    ``(rows, 2, cols)`` of ``self`` and ``out`` (the usual launch's, and a table row's)."""
    _glu_body(g, 0, cols, x, 0, cols, 2 * cols, o, 0, cols, 2 * cols, rows, cols, load, store)


# The usual launch's entry points: the same body on the same arguments as the general
# entry point's (so the same bits), for five arguments instead of thirteen: numba types and
# converts each argument of every call, a good part of a tiny request's launch.


def _glu_rows_float32(g, x, o, rows, cols):  # type: ignore[no-untyped-def]
    _glu_rows_body(g, x, o, rows, cols, _jit.same, _jit.same)


def _glu_rows_float16(g, x, o, rows, cols):  # type: ignore[no-untyped-def]
    _glu_rows_body(g, x, o, rows, cols, _jit.half_to_f32, _jit.f32_to_half)


def _glu_rows_bfloat16(g, x, o, rows, cols):  # type: ignore[no-untyped-def]
    _glu_rows_body(g, x, o, rows, cols, _jit.bf16_to_f32, _jit.f32_to_bf16)


#: The usual launch's entry point of each storage kind, compiled on first use.
_ROWS_LOOPS = _jit.Loops(
    {
        "float32": (_glu_rows_float32, _rows_signature("float32")),
        "float16": (_glu_rows_float16, _rows_signature("uint16")),
        "bfloat16": (_glu_rows_bfloat16, _rows_signature("uint16")),
    }
)


@_jit.body
def _glu_table_body(table, storage, load, store):  # type: ignore[no-untyped-def]
    """The compiled loop of a table launch: for each row of ``table`` (``grad_out``,
    ``self`` and ``out``'s addresses, ``outer``, ``half``; C-contiguous operands), that
    request's own arrays through :func:`_glu_rows_body`, as its solo launch computes them
    (so the same bits)."""
    for r in range(table.shape[0]):
        outer = table[r, 3]
        half = table[r, 4]
        n = outer * half
        g = numba.carray(_jit.pointer(table[r, 0]), n, storage)
        x = numba.carray(_jit.pointer(table[r, 1]), 2 * n, storage)
        o = numba.carray(_jit.pointer(table[r, 2]), 2 * n, storage)
        _glu_rows_body(g, x, o, outer, half, load, store)


def _glu_table_float32(table):  # type: ignore[no-untyped-def]
    _glu_table_body(table, np.float32, _jit.same, _jit.same)


def _glu_table_float16(table):  # type: ignore[no-untyped-def]
    _glu_table_body(table, np.uint16, _jit.half_to_f32, _jit.f32_to_half)


def _glu_table_bfloat16(table):  # type: ignore[no-untyped-def]
    _glu_table_body(table, np.uint16, _jit.bf16_to_f32, _jit.f32_to_bf16)


_TABLE = _jit.void(_jit.TABLE)
#: The table launch's entry point of each storage kind, compiled on first use.
_TABLE_LOOPS = _jit.Loops(
    {
        "float32": (_glu_table_float32, _TABLE),
        "float16": (_glu_table_float16, _TABLE),
        "bfloat16": (_glu_table_bfloat16, _TABLE),
    }
)


def glu_table_row(
    grad_out: np.ndarray, self: np.ndarray, out: np.ndarray, dim: int
) -> tuple[int, ...] | None:
    """A request's row of a table launch (:func:`glu_backward_table`): its operands'
    addresses, ``outer`` and ``half``. None for a request that cannot take part, which
    runs its own launch: DOUBLE (the numpy kernel), an operand that is not C-contiguous,
    an ``out`` that overlaps an input (its launch stages it), nothing to compute."""
    kind = _jit.kind_of(self.dtype)
    if kind is None or not (
        grad_out.flags.c_contiguous and self.flags.c_contiguous and out.flags.c_contiguous
    ):
        return None
    outer, half = glu_grid(self.shape, dim % self.ndim)
    if not outer * half:
        return None
    g, x, o = _jit.addresses(kind, grad_out, self, out)
    size = out.nbytes
    if (o < x + self.nbytes and x < o + size) or (o < g + grad_out.nbytes and g < o + size):
        return None
    return g, x, o, outer, half


def glu_backward_table(dtype: np.dtype, rows: list[tuple[int, ...]]) -> Callable[[], None]:
    """One compiled call computing every request of ``rows`` (:func:`glu_table_row`, all
    of ``dtype``) on its own arrays: a fused launch without a gather or a scatter, each
    request's bits its solo launch's. The arrays must stay alive until it has run."""
    kind = _jit.kind_of(dtype)
    assert kind is not None, "glu_table_row takes compiled dtypes only"
    loop, table = _TABLE_LOOPS[kind.name], np.array(rows, np.int64)
    return lambda: loop(table)


def _flat_args(
    kind: _jit.Kind,
    grad_out: np.ndarray,
    self: np.ndarray,
    out: np.ndarray,
    outer: int,
    half: int,
) -> tuple[Any, ...]:
    """:func:`_compiled_args` of C-contiguous operands (the usual call): flat views, strides
    from the geometry alone (a row of self is its two halves a, b; a row of grad_out one
    half), no 2-D / 3-D views."""
    storage, row = _jit.storage, 2 * half
    return (
        storage(grad_out, kind),
        0,
        half,
        storage(self, kind),
        0,
        half,
        row,
        storage(out, kind),
        0,
        half,
        row,
        outer,
        half,
    )


def _compiled_args(
    kind: _jit.Kind,
    grad_out: np.ndarray,
    self: np.ndarray,
    out: np.ndarray,
    outer: int,
    half: int,
) -> tuple[Any, ...]:
    """The compiled loop's arguments for operands whose rows have unit stride (the plan
    staged any other), seen as ``(outer, half)`` / ``(outer, 2, half)``."""
    if grad_out.flags.c_contiguous and self.flags.c_contiguous and out.flags.c_contiguous:
        return _flat_args(kind, grad_out, self, out, outer, half)
    g2, x3 = grad_out.reshape(outer, half), self.reshape(outer, 2, half)
    o3 = out.reshape(outer, 2, half)
    g, gs = _jit.flat(g2, kind)
    x, xs = _jit.flat(x3, kind)
    o, os_ = _jit.flat(o3, kind)
    xb, ob = x3.strides[1] // x3.itemsize, o3.strides[1] // o3.itemsize  # where b starts
    return g, 0, gs, x, 0, xb, xs, o, 0, ob, os_, outer, half
