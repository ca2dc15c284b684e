"""Compiled element-wise pieces of the fast kernels (numba), and what keeps them exact.

numpy runs a kernel as a chain of ufuncs, one pass over a tile per operation, and its
float16 casts are a scalar loop (1.4 ns per element in, 2.7 ns out on our 2-core machine).
A numba loop does every operation of an element in registers, in one pass over memory; this
module holds the pieces those loops share: bit-exact dtype conversions, a ``sigmoid`` and the
per-dtype "kinds" a kernel is compiled for.

Determinism (docs/operators.md, "Determinism") rests on three rules here:

- **One formula per element, no contraction.** The loops are compiled without ``fastmath``:
  LLVM may not fuse a multiply and an add into an FMA or reorder an operation, so the
  vectorised body of a loop and its scalar remainder compute the same IEEE operations and
  give the same bits. Which element lands in which part depends on the launch's length and
  position; the result must not (``tests/ops/test_jit.py`` checks every position).
- **No library math.** ``sigmoid`` below is plain arithmetic and bit operations. A call to
  ``math.exp`` would be vectorised with Intel's SVML when ``icc_rt`` happens to be installed,
  and the scalar remainder would use libm: two implementations, two results.
- **Exact conversions.** FLOAT16 <-> float32 use the CPU's conversion instructions (F16C /
  AVX-512, round to nearest even, exact; LLVM emits a library call of the same semantics where
  they are missing). BFLOAT16 -> float32 is a 16-bit shift; float32 -> BFLOAT16 a
  round-to-nearest-even on the integer view, NaN kept NaN (as ``ml_dtypes``). The
  AVX-512 BF16 instruction is not used: it flushes subnormals to zero.

Each loop has one body and a two-line entry point per kind (its load and store). Inputs are
typed read-only (a writeable array converts to that type for free), so one compiled entry
point serves writeable arrays, memory-mapped files opened read-only and ``np.frombuffer``
views alike.

Nothing is compiled at import. An entry point is compiled, or loaded from numba's disk
cache, the first time a launch needs it, for the one dtype that launch has (:class:`Loops`),
under a lock: two streams that need it at once compile it once. :func:`warm` compiles every
entry point ahead (``opsched warm``, at image build time). The disk cache lies beside the
modules, under ``NUMBA_CACHE_DIR`` when that is set, or in the user's cache directory when
the install is read-only (kept in step with every kernel source by :mod:`._cache`); when no
directory can be written at all, the kernels are compiled in memory, once per process, and
the ``opsched.kernels`` logger says so once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import ml_dtypes
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._cache import refresh_package
from ._common import flat_rows

__all__ = [
    "KINDS",
    "LANES",
    "Kind",
    "B1",
    "I8",
    "Loops",
    "OUTPUT",
    "TABLE",
    "addresses",
    "addresses_with_float32",
    "bf16_to_f32",
    "body",
    "compiled",
    "f32_to_bf16",
    "f32_to_half",
    "flat",
    "fold",
    "folded",
    "half_to_f32",
    "kind_of",
    "lane_sums",
    "lanes",
    "pointer",
    "readonly",
    "same",
    "sigmoid",
    "sigmoid32",
    "storage",
    "void",
    "warm",
    "writeable",
]

U32 = np.uint32
F32 = np.float32

#: The numba releases whose internals :func:`lanes` and :func:`fold` build on (its
#: ``cgutils`` and array structures) were checked against.
NUMBA_CHECKED = ((0, 60), (0, 68))


def _numba_internals() -> bool:
    """Whether :func:`lanes` and :func:`fold` may use numba's internals: a checked
    release, and ``OPSCHED_PUBLIC_ONLY`` not set (then, or past the gate, they are the
    public loops below: the same bits, slower)."""
    if os.environ.get("OPSCHED_PUBLIC_ONLY", "") not in ("", "0"):
        return False
    try:
        major, minor = (int(p) for p in numba.__version__.split(".")[:2])
    except ValueError:
        return False
    low, high = NUMBA_CHECKED
    return low <= (major, minor) <= high


#: See :func:`_numba_internals`; part of the kernels' cache fingerprint (``._cache``).
NUMBA_INTERNALS = _numba_internals()
if NUMBA_INTERNALS:
    try:
        from numba.core import cgutils
        from numba.np.arrayobj import make_array, populate_array
    except ImportError:  # moved in this release after all: the public loops
        NUMBA_INTERNALS = False


def _f32_bits_typing(typingctx: Any, x: Any) -> Any:
    """The bits of a float32 as uint32 (a bitcast, no conversion)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


_f32_bits: Any = intrinsic(_f32_bits_typing)


def _bits_f32_typing(typingctx: Any, x: Any) -> Any:
    """The float32 whose bits are a uint32."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


_bits_f32: Any = intrinsic(_bits_f32_typing)


def _half_to_f32_typing(typingctx: Any, x: Any) -> Any:
    """FLOAT16 bits (uint16) to float32: exact."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.uint16), codegen


half_to_f32: Any = intrinsic(_half_to_f32_typing)


def _f32_to_half_typing(typingctx: Any, x: Any) -> Any:
    """float32 to FLOAT16 bits, rounded to nearest even (overflow to inf, NaN stays NaN)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


f32_to_half: Any = intrinsic(_f32_to_half_typing)


def _fma_typing(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """``a * b + c`` rounded once (``llvm.fma``: a fused multiply-add wherever the CPU has
    one, the same exact result in every lane, vector or scalar, on every machine)."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        f32 = ir.FloatType()
        signature = ir.FunctionType(f32, [f32, f32, f32])
        fma = builder.module.declare_intrinsic("llvm.fma", [f32], signature)
        return builder.call(fma, args)

    return types.float32(types.float32, types.float32, types.float32), codegen


fma: Any = intrinsic(_fma_typing)


def _pointer_typing(typingctx: Any, address: Any) -> Any:
    """An address (int64) as a void pointer: what ``numba.carray`` makes an array of."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(types.int64), codegen


#: ``pointer(address)``: a table launch's operand (see :func:`addresses`).
pointer: Any = intrinsic(_pointer_typing)


# The loads (storage element -> float32) and stores (float32 -> storage element, rounded
# once) a loop's per-kind entry points pass to its body.


@numba.njit(inline="always")
def same(x: Any) -> Any:
    """FLOAT's load and store: the element itself."""
    return x


@numba.njit(inline="always")
def bf16_to_f32(h: Any) -> Any:
    return _bits_f32(U32(h) << U32(16))


@numba.njit(inline="always")
def f32_to_bf16(x: Any) -> Any:
    # round to nearest even on the integer view; NaN -> the quiet NaN 0x7fc0 with x's sign
    # (as ml_dtypes). One select on 32-bit lanes, one narrowing: half the cost of selecting
    # between two 16-bit results.
    u = _f32_bits(x)
    rounded = u + U32(0x7FFF) + ((u >> U32(16)) & U32(1))
    nan = (u & U32(0x80000000)) | U32(0x7FC00000)
    return np.uint16((nan if x != x else rounded) >> U32(16))


# sigmoid(b) = 1 / (1 + exp(-b)), with exp(x) = 2**n * (1 + poly(r)), x = n * ln2 + r,
# |r| <= ln2 / 2. The polynomial is the degree-5 minimax of Arm's optimized-routines
# (v_expf). The exponent x = -b is clamped to [-20, 88.75], which changes no sigmoid:
# below -20, exp(x) < 2**-28 and 1 + exp(x) rounds to 1 exactly, as it does for every x
# down to -inf; from n = 128 (x >= 88.38) 2**n is +inf, so exp(x) is +inf and the sigmoid
# +0.0 (the true value there is below 6e-39, under FLOAT's tolerance). So 2**n is a single
# factor (no subnormal exp to build) and no comparison selects inf or zero: a quarter fewer
# instructions in GLU's loop than a general exp. Every multiply-add is one fused, exactly
# rounded ``fma``: the same bits in vector lanes and in the scalar tail, on any machine, and
# fewer instructions again. Its error is tested against float64 (tests/ops/test_jit.py).
_SHIFT = F32(12582912.0)  # 1.5 * 2**23: adding it rounds to an integer
_INV_LN2 = F32(1.44269502162933349609375)
_LN2_HI = F32(0.693145751953125)
_LN2_LO = F32(1.428606765330187045e-06)
_C0 = F32(float.fromhex("0x1.0e4020p-7"))
_C1 = F32(float.fromhex("0x1.573e2ep-5"))
_C2 = F32(float.fromhex("0x1.555e66p-3"))
_C3 = F32(float.fromhex("0x1.fffdb6p-2"))
_C4 = F32(float.fromhex("0x1.ffffecp-1"))
_ONE = F32(1.0)
_X_MIN = F32(-20.0)  # exp below it: 1 + exp(x) == 1
_X_MAX = F32(88.75)  # n = 128 from 88.38: 2**n is +inf


@numba.njit(inline="always")
def sigmoid(b: Any) -> Any:
    """``1 / (1 + exp(-b))`` for a float32, in plain arithmetic (no library call): see the
    comment above. NaN in, NaN out: Python's ``max`` / ``min`` keep their first argument
    when a comparison fails, so a NaN ``-b`` passes the clamp and every step after it."""
    x = min(max(-b, _X_MIN), _X_MAX)
    z = fma(x, _INV_LN2, _SHIFT)
    n = z - _SHIFT
    r = fma(-n, _LN2_HI, x)
    r = fma(-n, _LN2_LO, r)
    # 2**n from n's bits in z (n + 127 in [107, 255]: 255 is +inf's exponent)
    biased = np.int32(_f32_bits(z) - _f32_bits(_SHIFT)) + np.int32(127)
    scale = _bits_f32(U32(biased << np.int32(23)))
    r2 = r * r
    p = fma(_C0, r, _C1)
    q = fma(_C2, r, _C3)
    q = fma(p, r2, q)
    poly = fma(q, r2, _C4 * r)
    # (1 + poly) > 0, so an infinite scale gives +inf, never inf - inf
    return _ONE / (_ONE + (poly + _ONE) * scale)


# Sums. A loop that adds into one float32 cannot be vectorised without reordering the adds
# (fastmath); so a row is summed in LANES fixed lanes: lane j adds the elements j, j + LANES,
# j + 2 * LANES, ... in order, the lanes are folded in a fixed tree (:func:`fold`) and the
# tail (the last ``len % LANES`` elements) is added to that in order. The order depends on
# the row's length only, never on where the row lies in memory or in a launch;
# :func:`lane_sums` is the same order in numpy, for the reference kernels.

#: Lanes of a row sum: two AVX2 vectors per sum.
LANES = 32


def _lanes_typing(typingctx: Any) -> Any:
    """A zeroed float32 array of LANES elements on the stack: unlike a heap array, LLVM
    knows it aliases nothing, keeps it in vector registers and never stores it."""
    array = types.Array(types.float32, 1, "C")

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        llvm_type = ir.ArrayType(ir.FloatType(), LANES)
        slot = cgutils.alloca_once(builder, llvm_type)  # in the entry block: registers
        builder.store(ir.Constant(llvm_type, [0.0] * LANES), slot)
        intp = context.get_value_type(types.intp)
        value = make_array(array)(context, builder)
        populate_array(
            value,
            data=builder.bitcast(slot, ir.FloatType().as_pointer()),
            shape=[ir.Constant(intp, LANES)],
            strides=[ir.Constant(intp, 4)],
            itemsize=ir.Constant(intp, 4),
            meminfo=None,
        )
        return value._getvalue()

    return array(), codegen


@numba.njit(inline="always")
def _heap_lanes() -> Any:
    """:func:`lanes` without numba's internals: a zeroed heap array."""
    return np.zeros(LANES, F32)


#: A zeroed float32 array of LANES elements for a row's sums.
lanes: Any = intrinsic(_lanes_typing) if NUMBA_INTERNALS else _heap_lanes


def _fold_typing(typingctx: Any, acc: Any) -> Any:
    """The sum of a :func:`lanes` array, halving in a fixed tree: lanes ``j + 16`` into
    ``j``, then ``j + 8``, ``j + 4``, ``j + 2``, and lane 1 into lane 0.

    Emitted as vector adds of the array's halves: written as scalar loops, LLVM adds the 31
    pairs one by one, which costs as much as summing a 128-element row."""

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        data = make_array(sig.args[0])(context, builder, args[0]).data
        vector_type = ir.VectorType(ir.FloatType(), LANES)
        vector = builder.load(builder.bitcast(data, vector_type.as_pointer()))
        width = LANES
        while width > 1:
            width //= 2
            lanes = ir.VectorType(ir.IntType(32), width)
            low = builder.shuffle_vector(vector, vector, ir.Constant(lanes, list(range(width))))
            high = ir.Constant(lanes, list(range(width, 2 * width)))
            vector = builder.fadd(low, builder.shuffle_vector(vector, vector, high))
        return builder.extract_element(vector, ir.Constant(ir.IntType(32), 0))

    return types.float32(acc), codegen


@numba.njit(inline="always")
def _scalar_fold(acc: Any) -> Any:
    """:func:`fold` without numba's internals: the same adds in the same tree, one lane at
    a time (consumes ``acc``: callers take fresh lanes for each row)."""
    width = LANES
    while width > 1:
        width //= 2
        for j in range(width):
            acc[j] = acc[j] + acc[j + width]
    return acc[0]


#: The sum of a :func:`lanes` array in the fixed tree.
fold: Any = intrinsic(_fold_typing) if NUMBA_INTERNALS else _scalar_fold


@numba.njit(inline="always")
def folded(acc: Any, full: Any) -> Any:
    """:func:`fold` of a row's lanes, or +0.0 without folding when the row had no whole
    block of LANES elements (``full`` 0: every lane is +0.0, and so is their fold): the
    same bits, without the fold's shuffles for each short row."""
    return fold(acc) if full else F32(0.0)


def lane_sums(rows: np.ndarray) -> np.ndarray:
    """Sum each row of a float32 ``(rows, n)`` array in the compiled loops' order (lanes,
    fold, tail), in numpy: the reference kernels' sums."""
    rows = np.asarray(rows, F32)
    count, n = rows.shape
    full = n - n % LANES
    acc = np.zeros((count, LANES), F32)
    for i in range(0, full, LANES):
        acc += rows[:, i : i + LANES]
    width = LANES // 2
    while width:
        acc[:, :width] += acc[:, width : 2 * width]
        width //= 2
    total = acc[:, 0].copy()
    for i in range(full, n):
        total += rows[:, i]
    return total


class Kind(NamedTuple):
    """A storage dtype the compiled loops read and write.

    Attributes:
        name: ``"float32"``, ``"float16"`` or ``"bfloat16"``: the key of a kernel's loops.
        storage: the dtype the compiled loop sees (uint16 for both half types).
    """

    name: str
    storage: np.dtype


#: The dtypes with compiled kernels, by numpy dtype. DOUBLE keeps the numpy ufunc kernels.
KINDS: dict[np.dtype, Kind] = {
    np.dtype(np.float32): Kind("float32", np.dtype(np.float32)),
    np.dtype(np.float16): Kind("float16", np.dtype(np.uint16)),
    np.dtype(ml_dtypes.bfloat16): Kind("bfloat16", np.dtype(np.uint16)),
}


def kind_of(dtype: np.dtype) -> Kind | None:
    """The compiled kind for ``dtype``, or None (DOUBLE: the numpy kernels)."""
    return KINDS.get(dtype)


def storage(array: np.ndarray, kind: Kind) -> np.ndarray:
    """A C-contiguous array as the flat 1-D view of the dtype the compiled loop reads
    (``ravel``: a view of a C-contiguous array, four times cheaper than ``reshape(-1)``)."""
    flat = array.ravel()
    # ``is`` first: float32 storage is numpy's one float32 dtype (cheaper than ==; per launch)
    if flat.dtype is kind.storage or flat.dtype == kind.storage:
        return flat
    return flat.view(kind.storage)


def flat(view: np.ndarray, kind: Kind) -> tuple[np.ndarray, int]:
    """``(flat storage view, row stride)`` of a view whose rows have unit stride (the plan
    staged any other): what a compiled loop indexes."""
    if view.flags.c_contiguous:  # the per-launch hot path: skip flat_rows' per-axis checks
        return storage(view, kind), (view.strides[0] // view.itemsize if view.ndim else 0)
    found = flat_rows(view)
    assert found is not None, "the plan stages views whose rows are not unit-stride"
    array, stride = found
    return storage(array, kind), stride


def readonly(dtype: str) -> Any:
    """The numba type of a C-contiguous 1-D operand a loop only reads: read-only arrays
    match it, and writeable ones convert to it (numba's safe conversion), so both run the
    same compiled code."""
    return types.Array(numba.from_dtype(np.dtype(dtype)), 1, "C", readonly=True)


def writeable(dtype: str) -> Any:
    """The numba type of a C-contiguous 1-D array a loop writes."""
    return types.Array(numba.from_dtype(np.dtype(dtype)), 1, "C")


#: A loop's signature: ``void(argument types...)``.
void = types.void
#: The loops' scalar arguments: offsets, strides and counts, and flags.
I8 = types.int64
B1 = types.boolean
#: A table launch's rows: int64, one per request (its operands' addresses, its geometry).
TABLE = types.Array(types.int64, 2, "C", readonly=True)
#: The float32 operand of every kind's loop that it writes (sums, statistics scratch).
OUTPUT = writeable("float32")

_log = logging.getLogger("opsched.kernels")

#: Serialises compilation: two streams needing one entry point compile it once.
_COMPILING = threading.RLock()


def _new_lock_in_child() -> None:
    """A forked child's own compile lock: a thread of the parent may have held it at the
    fork, and nobody in the child would ever let it go."""
    global _COMPILING  # the one module lock, remade once per fork
    _COMPILING = threading.RLock()


os.register_at_fork(after_in_child=_new_lock_in_child)
#: Whether numba found a writable cache directory (None: not asked yet).
_disk_cache: list[bool | None] = [None]
#: Every :class:`Loops` made, for :func:`warm`.
_ALL: list[Loops] = []


def _compile(func: Callable[..., Any], signature: Any, nogil: bool = True) -> Any:
    """``func`` compiled for ``signature`` (or loaded from the disk cache): without the
    GIL unless ``nogil`` is False (streams run in parallel), numpy's float semantics
    (division by zero gives inf, not an exception), never ``fastmath``. Caller holds
    :data:`_COMPILING`."""
    options: dict[str, Any] = {"nogil": nogil, "error_model": "numpy"}
    if _disk_cache[0] is None:
        # before the first load from the cache: stale entries removed
        refresh_package(NUMBA_INTERNALS)
    if _disk_cache[0] is not False:
        try:
            compiled = numba.njit([signature], cache=True, **options)(func)
        except RuntimeError as exc:  # numba: "cannot cache function ...: no locator"
            if "cannot cache" not in str(exc):
                raise
            _disk_cache[0] = False
            _log.info(
                "no writable cache directory for the compiled kernels (set NUMBA_CACHE_DIR "
                "to keep them across processes); compiling them in memory: %s",
                exc,
            )
        else:
            _disk_cache[0] = True
            return compiled
    return numba.njit([signature], cache=False, **options)(func)


class Loops(dict[str, Any]):
    """A loop's compiled entry points by kind name (``"float32"``, ``"float16"``,
    ``"bfloat16"``, or any name the loop chooses), each compiled the first time it is
    looked up.

    A lookup of an entry point already compiled is a plain dict lookup: the launches' hot
    path pays nothing for the laziness.

    Args:
        sources: per name, the Python function and the numba signature it compiles for.
        nogil: the entry points let go of the GIL while they run (a loop over many
            elements: other threads run Python meanwhile). False for calls of a few
            nanoseconds: letting go and taking back the GIL would hand it to another
            thread and wait for its return, far longer than the call.
    """

    def __init__(
        self, sources: dict[str, tuple[Callable[..., Any], Any]], *, nogil: bool = True
    ) -> None:
        super().__init__()
        self._sources = sources
        self._nogil = nogil
        _ALL.append(self)

    def __missing__(self, name: str) -> Any:
        func, signature = self._sources[name]  # KeyError: no such entry point
        with _COMPILING:
            compiled = dict.get(self, name)
            if compiled is None:  # not compiled by a thread that held the lock before us
                compiled = _compile(func, signature, self._nogil)
                self[name] = compiled
        return compiled

    def names(self) -> Iterable[str]:
        """The names of every entry point, compiled or not."""
        return self._sources.keys()


def compiled() -> list[str]:
    """The entry points compiled (or loaded) in this process, as ``module.function``."""
    return sorted(
        f"{func.__module__}.{func.__name__}"
        for loops in _ALL
        for name, (func, _) in loops._sources.items()
        if dict.__contains__(loops, name)
    )


def warm() -> int:
    """Compile (or load from the disk cache) every kernel entry point now.

    Returns:
        How many entry points there are.
    """
    from . import glu, group_norm, group_norm_backward  # noqa: F401  # their Loops register

    count = 0
    for loops in list(_ALL):
        for name in loops.names():
            loops[name]  # compiled by the lookup
            count += 1
    return count


#: The bodies of the loops: compiled into each kind's entry point (``inline="always"``), so
#: ``load`` and ``store`` are resolved at compile time, not called per element.
body = numba.njit(inline="always")


def _sigmoid_loop(x: Any, out: Any) -> None:
    for i in range(x.size):
        out[i] = sigmoid(x[i])


_SIGMOID = Loops({"float32": (_sigmoid_loop, void(readonly("float32"), OUTPUT))})


def _addresses3(a: Any, b: Any, c: Any) -> Any:
    return a.ctypes.data, b.ctypes.data, c.ctypes.data


def _addresses8(a: Any, b: Any, c: Any, d: Any, e: Any, f: Any, g: Any, h: Any) -> Any:
    return (
        a.ctypes.data,
        b.ctypes.data,
        c.ctypes.data,
        d.ctypes.data,
        e.ctypes.data,
        f.ctypes.data,
        g.ctypes.data,
        h.ctypes.data,
    )


#: The data addresses of three flat storage views of one kind (a request's data operands),
#: by kind, alone or with five float32 arrays (GroupNormBackward's statistics, gamma and
#: sums): one compiled call for a request's arrays. ``ndarray.ctypes`` builds a ctypes
#: object for each array it is asked about, and numba's dispatch costs about 0.3 us a call
#: whatever it computes, so a request's addresses are one call, not one per array. They
#: keep the GIL (``nogil=False``): letting it go and taking it back would hand it to a
#: stream thread and wait for its return, far longer than the call.
_ADDRESSES3 = Loops(
    {
        kind.name: (_addresses3, types.UniTuple(types.int64, 3)(*[readonly(kind.storage.name)] * 3))
        for kind in KINDS.values()
    },
    nogil=False,
)
_ADDRESSES8 = Loops(
    {
        kind.name: (
            _addresses8,
            types.UniTuple(types.int64, 8)(
                *[readonly(kind.storage.name)] * 3, *[readonly("float32")] * 5
            ),
        )
        for kind in KINDS.values()
    },
    nogil=False,
)


def addresses(kind: Kind, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> tuple[int, int, int]:
    """The data addresses of three C-contiguous arrays of ``kind``, in one compiled call:
    the rows of a table launch, a compiled loop over many requests' own arrays (a
    request's operands found by address, :func:`pointer`, where a fused launch would copy
    them into one buffer)."""
    found: tuple[int, int, int] = _ADDRESSES3[kind.name](
        storage(a, kind), storage(b, kind), storage(c, kind)
    )
    return found


def addresses_with_float32(
    kind: Kind,
    a: np.ndarray,
    b: np.ndarray,
    c: np.ndarray,
    d: np.ndarray,
    e: np.ndarray,
    f: np.ndarray,
    g: np.ndarray,
    h: np.ndarray,
) -> tuple[int, int, int, int, int, int, int, int]:
    """The data addresses of three C-contiguous arrays of ``kind`` (``a``, ``b``, ``c``)
    and five C-contiguous float32 arrays, in one compiled call (see :func:`addresses`)."""
    found: tuple[int, int, int, int, int, int, int, int] = _ADDRESSES8[kind.name](
        storage(a, kind),
        storage(b, kind),
        storage(c, kind),
        d.ravel(),
        e.ravel(),
        f.ravel(),
        g.ravel(),
        h.ravel(),
    )
    return found


def sigmoid32(x: np.ndarray) -> np.ndarray:
    """:func:`sigmoid` over a float32 array, into a new array of its shape.

    The reference kernels use it where the compiled kernels use ``sigmoid``, so that the
    reference device gives the compiled kernels' bits (the contract's formula, one sigmoid).
    """
    flat = np.ascontiguousarray(x, F32).reshape(-1)
    out = np.empty(flat.size, F32)
    _SIGMOID["float32"](flat, out)
    return out.reshape(np.shape(x))
