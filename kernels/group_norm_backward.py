"""GroupNormBackward kernels: the true gradient of group norm, with dgamma and dbeta.

For ``N`` samples of ``C`` channels of ``HxW`` elements in ``group`` groups (``cpg = C /
group`` channels each, ``M = cpg * HxW`` elements per group), per ``(n, g)``, with
``xhat = (x - mean) * rstd`` and, for each channel ``c`` of the group,
``ds_c = sum_HxW dy`` and ``db_c = sum_HxW dy * xhat``:

    c1 = sum_c gamma_c * ds_c / M        c2 = sum_c gamma_c * db_c / M
    dx = rstd * (gamma_c * dy - c1 - c2 * xhat)
    dbeta_c = sum_n ds_c                 dgamma_c = sum_n db_c

Every dtype is computed in float32 and rounded once into the outputs, by one compiled loop
(:mod:`._gnb_loops`) that takes a group at a time: pass 1 sums ``dy`` and ``dy * x`` over
each channel row (one channel of one sample, ``HxW`` elements); ``db = rstd * (sum(dy * x)
- mean * ds)``; pass 2 writes ``dx = A * dy + B * x + C`` with per-channel-row
coefficients ``A = rstd * gamma``, ``B = -(c2 * rstd * rstd)``, ``C = (c2 * rstd * mean -
c1) * rstd``, reading the group back from cache.

Determinism. A channel row is summed in :data:`._jit.LANES` lanes in an order fixed by its
length alone; ``c1`` / ``c2`` add the group's channels in order; ``dgamma`` and ``dbeta``
add the per-sample rows ``n = 0, 1, ..., N - 1`` in order (:func:`reduce_over_samples`), for
a request alone or inside a fused launch alike. :func:`group_norm_backward_rows_reference`
is the same order of operations in numpy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from . import _jit
from ._common import Carver, must_stage, overlaps, store, workspace_bytes
from ._gnb_loops import LOOPS, TABLE_LOOPS

__all__ = [
    "GnbPlan",
    "group_norm_backward_reference",
    "group_norm_backward_rows_reference",
    "group_norm_backward_runner",
    "group_norm_backward_table",
    "gnb_table_row",
    "make_gnb_plan",
    "plan_group_norm_backward",
    "prepare_group_norm_backward",
    "reduce_over_samples",
]

F32 = np.dtype(np.float32)


def group_norm_backward_rows_reference(
    grad_out: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    gamma_rows: np.ndarray | None,
    rows: int,
    cpg: int,
    hxw: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The formula on ``rows`` (n, g) rows of ``cpg`` channels of ``hxw`` elements, float32,
    in plain numpy (whole arrays, no workspace), in the fast kernel's order of operations.

    ``gamma_rows``: ``rows * cpg`` values (gamma per row and channel), or None for ones.
    Returns ``dx`` as ``(rows * cpg, hxw)`` in ``grad_out``'s dtype, and ``ds``, ``db`` per
    channel row (float32, ``rows * cpg``).
    """
    dy = np.asarray(grad_out, F32).reshape(rows, cpg, hxw)
    xx = np.asarray(x, F32).reshape(rows, cpg, hxw)
    mu = np.asarray(mean, F32).reshape(rows, 1)
    rs = np.asarray(rstd, F32).reshape(rows, 1)
    g = np.ones((rows, cpg), F32) if gamma_rows is None else np.asarray(gamma_rows, F32)
    g = g.reshape(rows, cpg)
    with np.errstate(all="ignore"):
        ds = _jit.lane_sums(dy.reshape(rows * cpg, hxw)).reshape(rows, cpg)
        sxy = _jit.lane_sums((dy * xx).reshape(rows * cpg, hxw)).reshape(rows, cpg)
        db = (sxy - mu * ds) * rs
        m = np.float32(cpg * hxw)
        c1, c2 = np.zeros((rows, 1), F32), np.zeros((rows, 1), F32)
        for k in range(cpg):  # the group's channels, in order
            c1 += g[:, k : k + 1] * ds[:, k : k + 1]
            c2 += g[:, k : k + 1] * db[:, k : k + 1]
        c1 /= m
        c2 /= m
        coef_a = rs * g
        coef_b = -(c2 * rs * rs)
        coef_c = (c2 * rs * mu - c1) * rs
        dx = (dy * coef_a[..., None] + xx * coef_b[..., None]) + coef_c[..., None]
    return (
        dx.reshape(rows * cpg, hxw).astype(grad_out.dtype),
        ds.reshape(rows * cpg),
        db.reshape(rows * cpg),
    )


def group_norm_backward_reference(
    grad_out: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    gamma: np.ndarray | None,
    n: int,
    c: int,
    hxw: int,
    group: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(dx, dgamma, dbeta)`` straight from the formula, float32, in ``grad_out``'s dtype
    (``dx`` shaped as ``x``, the others ``(C,)``)."""
    cpg = c // group
    rows_gamma = None
    if gamma is not None:
        rows_gamma = np.broadcast_to(np.reshape(gamma, (1, group, cpg)), (n, group, cpg))
    dx, ds, db = group_norm_backward_rows_reference(
        grad_out, x, mean, rstd, rows_gamma, n * group, cpg, hxw
    )
    stat_dtype = np.asarray(mean).dtype  # grad_out's, or FLOAT statistics
    dgamma, dbeta = np.empty(c, stat_dtype), np.empty(c, stat_dtype)
    reduce_over_samples(db, n, c, dgamma)
    reduce_over_samples(ds, n, c, dbeta)
    return dx.reshape(x.shape), dgamma, dbeta


class GnbPlan(NamedTuple):
    """The geometry and workspace layout of one GroupNormBackward launch.

    ``rows`` is ``N * group``; ``cpg`` channels of ``hxw`` elements per row. ``row_gamma``:
    gamma is given per row, ``(rows, cpg)`` (a fused launch), not per channel ``(C,)``.
    ``stats_out``: ``ds`` / ``db`` are written to caller arrays (a fused launch reduces them
    per request afterwards) instead of workspace buffers reduced into dgamma / dbeta here.
    """

    n: int
    c: int
    hxw: int
    group: int
    dtype: np.dtype
    want_dx: bool
    want_dgamma: bool
    want_dbeta: bool
    has_gamma: bool
    row_gamma: bool
    stats_out: bool
    stage_x: bool
    stage_dy: bool
    stage_dx: bool
    workspace_bytes: int

    @property
    def rows(self) -> int:
        """``N * group``."""
        return self.n * self.group

    @property
    def cpg(self) -> int:
        """Channels per group."""
        return self.c // self.group


def _buffers(channel_rows: int, rows: int, stats_in_workspace: bool) -> list[tuple[int, np.dtype]]:
    """The float32 buffers the kernel may carve, in carving order: mean and rstd per row and
    gamma per channel row (float32 copies, unless they are float32 already); ds and db per
    channel row, one buffer, unless the caller takes them."""
    stats = [(2 * channel_rows, F32)] if stats_in_workspace else []
    return [(rows, F32)] * 2 + [(channel_rows, F32)] + stats


#: gamma when none is given: one value, every channel's.
_ONE = np.ones(1, F32)


def make_gnb_plan(
    n: int,
    c: int,
    hxw: int,
    group: int,
    dtype: np.dtype,
    mask: tuple[bool, bool, bool],
    *,
    has_gamma: bool,
    row_gamma: bool = False,
    stats_out: bool = False,
    stage_x: bool = False,
    stage_dy: bool = False,
    stage_dx: bool = False,
) -> GnbPlan:
    """Plan a launch from its geometry; count the workspace it carves."""
    rows = n * group
    channel_rows = n * c
    size = channel_rows * hxw
    copies = [(size if stage_x else 0, dtype), (size if stage_dy else 0, dtype)]
    copies.append((size if stage_dx and mask[0] else 0, dtype))
    bufs = _buffers(channel_rows, rows, not stats_out)
    nbytes = workspace_bytes(copies + bufs) if channel_rows and hxw else 0
    return GnbPlan(
        n,
        c,
        hxw,
        group,
        np.dtype(dtype),
        *mask,
        has_gamma,
        row_gamma,
        stats_out,
        stage_x,
        stage_dy,
        stage_dx,
        nbytes,
    )


def reduce_over_samples(stats: np.ndarray, n: int, c: int, out: np.ndarray) -> None:
    """``out[c] = sum over n of stats[n, c]``, adding samples in order ``0, 1, ..., n-1``.

    ``stats``: ``n * c`` float32 values, sample-major, contiguous; its first ``c`` values
    are overwritten with the float32 sums. ``out``: ``(C,)``-sized (any shape of C
    elements), rounded once into its dtype.
    """
    if n == 0:
        out[...] = 0
        return
    flat = stats.reshape(n * c)
    _SUM_SAMPLES["float32"](flat, n, c)
    store(out.reshape(c), flat[:c])


def _sum_samples_loop(stats, n, c):  # type: ignore[no-untyped-def]
    """Add rows ``1 .. n-1`` of the ``(n, c)`` stats into row 0, in sample order."""
    for s in range(1, n):
        for k in range(c):
            stats[k] += stats[s * c + k]


_SUM_SAMPLES = _jit.Loops(
    {"float32": (_sum_samples_loop, _jit.void(_jit.OUTPUT, _jit.I8, _jit.I8))}
)


def prepare_group_norm_backward(
    plan: GnbPlan,
    grad_out: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    gamma: np.ndarray | None,
    dx: np.ndarray | None,
    dgamma: np.ndarray | None,
    dbeta: np.ndarray | None,
    *,
    ds_out: np.ndarray | None = None,
    db_out: np.ndarray | None = None,
) -> Callable[[np.ndarray | None], None]:
    """Do the per-array work of a GroupNormBackward launch once; return the launch, a
    function of the workspace (a ``uint8`` array of at least ``plan.workspace_bytes``, None
    when 0) that uses it for all its scratch.

    Sizes are read from the arrays (a fused launch runs the prefix of a larger plan):
    ``N = mean.size // group``. With ``plan.row_gamma`` gamma is ``(rows, cpg)``; with
    ``plan.stats_out`` the per-channel-row sums go to ``ds_out`` / ``db_out`` (float32,
    ``N * C``) and dgamma / dbeta are not written here.

    The workspace carve and the loop's arguments are laid out once per workspace: a
    repeatable executor launched again with the same workspace pays for the copies into it
    (staged operands, float32 statistics) and the compiled call alone.
    """
    n = mean.size // plan.group
    if n * plan.c == 0 or plan.hxw == 0:
        outputs = [a for a in (dgamma, dbeta, ds_out, db_out) if a is not None]
        return functools.partial(_zeros, outputs)
    if ds_out is None and dx is not None and dgamma is not None and dbeta is not None:
        direct = _direct(plan, n, grad_out, x, mean, rstd, gamma, dx, dgamma, dbeta)
        if direct is not None:
            return direct
    arrays = _Arrays(grad_out, x, mean, rstd, gamma, dx, dgamma, dbeta, ds_out, db_out)
    last: list[Any] = [_UNSEEN, None]  # the workspace seen last, and its launch

    def launch(workspace: np.ndarray | None) -> None:
        if workspace is not last[0]:
            last[:] = workspace, _lay_out(plan, arrays, n, workspace)
        _run(last[1])

    return launch


def _direct(
    plan: GnbPlan,
    n: int,
    grad_out: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    gamma: np.ndarray | None,
    dx: np.ndarray,
    dgamma: np.ndarray,
    dbeta: np.ndarray,
) -> Callable[[np.ndarray | None], None] | None:
    """The usual launch, its arguments laid out once per workspace: all three outputs asked
    for and nothing copied into the workspace (:func:`_is_direct`), so the workspace holds
    only the per-channel-row sums (:func:`_direct_arguments`). None for any other launch
    (:func:`_lay_out` then lays it out per workspace). The same loop and arguments as
    :func:`_lay_out`'s. (Its arrays come one by one, not as an ``_Arrays``: this runs for
    every two-phase call.)
    """
    if not _is_direct(plan, grad_out, x, mean, rstd, gamma, dx, dgamma, dbeta):
        return None
    arguments, count = _direct_arguments(plan, n, gamma)
    loop = LOOPS[_jit.KINDS[plan.dtype].name]
    last: list[Any] = [_UNSEEN, ()]  # the workspace seen last, and the loop's arguments

    def launch(workspace: np.ndarray | None) -> None:
        if workspace is not last[0]:
            sums = _sums(workspace, count)
            last[:] = workspace, arguments(grad_out, x, mean, rstd, gamma, dx, dgamma, dbeta, sums)
        loop(*last[1])

    return launch


def _direct_arguments(
    plan: GnbPlan, n: int, gamma: np.ndarray | None
) -> tuple[Callable[..., tuple[Any, ...]], int]:
    """The usual launch's loop arguments, as a function ``arguments(grad_out, x, mean,
    rstd, gamma, dx, dgamma, dbeta, sums)`` of its arrays (laid out as :func:`_is_direct`
    requires) and its ``count`` float32 sums (ds, then db), with that count: the same
    arguments as :func:`_lay_out`'s."""
    c, hxw, kind = plan.c, plan.hxw, _jit.KINDS[plan.dtype]
    channel_rows, rows, cpg = n * c, n * plan.group, c // plan.group
    period = 1 if gamma is None else gamma.size
    storage = _jit.storage

    def arguments(
        grad_out: np.ndarray,
        x: np.ndarray,
        mean: np.ndarray,
        rstd: np.ndarray,
        gamma: np.ndarray | None,
        dx: np.ndarray,
        dgamma: np.ndarray,
        dbeta: np.ndarray,
        sums: np.ndarray,
    ) -> tuple[Any, ...]:
        return (
            storage(grad_out, kind),
            hxw,
            storage(x, kind),
            hxw,
            storage(dx, kind),
            hxw,
            mean.ravel(),
            rstd.ravel(),
            _ONE if gamma is None else gamma.ravel(),
            period,
            sums[:channel_rows],
            sums[channel_rows:],
            rows,
            cpg,
            hxw,
            True,
            n,
            c,
            dgamma.ravel(),
            dbeta.ravel(),
        )

    return arguments, 2 * channel_rows


def _is_direct(
    plan: GnbPlan,
    grad_out: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    gamma: np.ndarray | None,
    dx: np.ndarray | None,
    dgamma: np.ndarray | None,
    dbeta: np.ndarray | None,
) -> bool:
    """Whether a launch of ``plan`` on these arrays is the usual one: all three outputs
    asked for, nothing staged, the inputs and outputs laid out as :func:`_usual_inputs`
    and :func:`_usual_outputs` say."""
    if plan.stage_x or plan.stage_dy or plan.stage_dx or plan.stats_out:
        return False
    if not (plan.want_dx and plan.want_dgamma and plan.want_dbeta):
        return False
    if dx is None or dgamma is None or dbeta is None:
        return False
    return _usual_inputs(grad_out, x, mean, rstd, gamma) and _usual_outputs(dx, dgamma, dbeta)


def _usual_inputs(
    grad_out: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    gamma: np.ndarray | None,
) -> bool:
    """The usual launch's inputs: the data C-contiguous, statistics and gamma float32 and
    C-contiguous (the float32 tests spelled out: this runs for every two-phase call)."""
    f32 = F32
    return bool(
        grad_out.flags.c_contiguous
        and x.flags.c_contiguous
        and mean.dtype is f32
        and rstd.dtype is f32
        and (gamma is None or gamma.dtype is f32)
        and mean.flags.c_contiguous
        and rstd.flags.c_contiguous
        and (gamma is None or gamma.flags.c_contiguous)
    )


def _usual_outputs(dx: np.ndarray, dgamma: np.ndarray, dbeta: np.ndarray) -> bool:
    """The usual launch's outputs: dx C-contiguous, dgamma and dbeta float32 and
    C-contiguous."""
    f32 = F32
    return bool(
        dx.flags.c_contiguous
        and dgamma.dtype is f32
        and dbeta.dtype is f32
        and dgamma.flags.c_contiguous
        and dbeta.flags.c_contiguous
    )


def group_norm_backward_runner(
    plan: GnbPlan,
    grad_out: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    gamma: np.ndarray | None,
    dx: np.ndarray | None,
    dgamma: np.ndarray | None,
    dbeta: np.ndarray | None,
) -> Callable[..., None] | None:
    """The usual launch of ``plan`` with its layout checked once, on these arrays: a
    function ``run(grad_out, x, mean, rstd, gamma, dx, dgamma, dbeta, workspace)`` for
    every later call whose arrays have these shapes, dtypes and strides and whose outputs
    overlap no input. It keeps its sums in the workspace, as the launch it stands for, or
    (``workspace`` None) in a new array of its own, so threads may call it at once. None
    when the launch is not the usual one (see :func:`_is_direct`) or computes nothing.

    A call made again with arrays laid out as before pays for its flat views and the
    compiled call alone: the launch's checks and workspace carving are done once."""
    n = mean.size // plan.group
    if n * plan.c == 0 or plan.hxw == 0:
        return None
    if not _is_direct(plan, grad_out, x, mean, rstd, gamma, dx, dgamma, dbeta):
        return None
    arguments, count = _direct_arguments(plan, n, gamma)
    loop = LOOPS[_jit.KINDS[plan.dtype].name]

    def run(
        grad_out: np.ndarray,
        x: np.ndarray,
        mean: np.ndarray,
        rstd: np.ndarray,
        gamma: np.ndarray | None,
        dx: np.ndarray,
        dgamma: np.ndarray,
        dbeta: np.ndarray,
        workspace: np.ndarray | None,
    ) -> None:
        sums = np.empty(count, F32) if workspace is None else _sums(workspace, count)
        loop(*arguments(grad_out, x, mean, rstd, gamma, dx, dgamma, dbeta, sums))

    return run


def gnb_table_row(
    grad_out: np.ndarray,
    x: np.ndarray,
    mean: np.ndarray,
    rstd: np.ndarray,
    gamma: np.ndarray | None,
    dx: np.ndarray,
    dgamma: np.ndarray,
    dbeta: np.ndarray,
    n: int,
    c: int,
    hxw: int,
    group: int,
    fresh: bool = False,
) -> tuple[int, ...] | None:
    """A request's row of a table launch (:func:`group_norm_backward_table`): its
    operands' addresses, N, C, group and HxW. None for a request that cannot take part,
    which runs its own launch: one that is not the usual launch (:func:`_is_direct`: all
    three outputs, FLOAT statistics, gamma and outputs, C-contiguous operands, a compiled
    dtype), whose outputs overlap an input (its launch stages them), or that computes
    nothing. ``fresh``: the outputs are new arrays of the launch (C-contiguous FLOAT, of
    the data's dtype for dx, overlapping nothing): not checked again."""
    kind = _jit.kind_of(x.dtype)
    if kind is None or not n * c * hxw:
        return None
    if not _usual_inputs(grad_out, x, mean, rstd, gamma):
        return None
    if not fresh and not _usual_outputs(dx, dgamma, dbeta):
        return None
    # eight, gamma or not (one compiled call a row: mean stands in for a missing gamma)
    dy_at, x_at, dx_at, mean_at, rstd_at, dgamma_at, dbeta_at, gamma_at = (
        _jit.addresses_with_float32(
            kind, grad_out, x, dx, mean, rstd, dgamma, dbeta, mean if gamma is None else gamma
        )
    )
    if not fresh and _overlap(
        [(dx_at, dx.nbytes), (dgamma_at, dgamma.nbytes), (dbeta_at, dbeta.nbytes)],
        [(dy_at, grad_out.nbytes), (x_at, x.nbytes), (mean_at, mean.nbytes)]
        + [(rstd_at, rstd.nbytes)]
        + ([] if gamma is None else [(gamma_at, gamma.nbytes)]),
    ):
        return None
    g = 0 if gamma is None else gamma_at
    return (dy_at, x_at, dx_at, mean_at, rstd_at, g, dgamma_at, dbeta_at, n, c, group, hxw)


def _overlap(outputs: list[tuple[int, int]], inputs: list[tuple[int, int]]) -> bool:
    """Whether any of the ``(address, bytes)`` ranges of ``outputs`` meets one of
    ``inputs``."""
    return any(
        start < low + length and low < start + size
        for start, size in outputs
        for low, length in inputs
    )


def group_norm_backward_table(dtype: np.dtype, rows: list[tuple[int, ...]]) -> Callable[[], None]:
    """One compiled call computing every request of ``rows`` (:func:`gnb_table_row`, all
    of data ``dtype``) on its own arrays, its sums in scratch of its own: a fused launch
    without a gather or a scatter, each request's bits its solo launch's. The arrays must
    stay alive until it has run."""
    kind = _jit.kind_of(dtype)
    assert kind is not None, "gnb_table_row takes compiled dtypes only"
    table = np.array(rows, np.int64)
    sums = np.empty(2 * int((table[:, 8] * table[:, 9]).max()), F32)
    loop, one = TABLE_LOOPS[kind.name], _ONE
    return lambda: loop(table, sums, one)


def _sums(workspace: np.ndarray | None, count: int) -> np.ndarray:
    """``count`` float32 sums at the start of the workspace (a contiguous ``uint8`` array)
    when that start is float-aligned (numpy's allocations and the pool's blocks are), else
    carved at the next :data:`ALIGN` as planned. The usual workspace needs no address:
    reading one through ctypes costs 0.7 us, this 0.4 us (two-phase GroupNormBackward,
    tiny: 23.9-24.8 -> 21.2-22.1 us a call)."""
    if workspace is not None and workspace.nbytes >= 4 * count:
        sums = np.frombuffer(workspace, F32, count)
        if sums.flags.aligned:
            return sums
    return Carver(workspace).take(count, F32)


class _Arrays(NamedTuple):
    """A launch's operands (see :func:`prepare_group_norm_backward`)."""

    grad_out: np.ndarray
    x: np.ndarray
    mean: np.ndarray
    rstd: np.ndarray
    gamma: np.ndarray | None
    dx: np.ndarray | None
    dgamma: np.ndarray | None
    dbeta: np.ndarray | None
    ds_out: np.ndarray | None
    db_out: np.ndarray | None


class _Launch(NamedTuple):
    """One launch laid out on a workspace: the copies into it, the compiled call, and what
    is copied out after."""

    copies: tuple[tuple[np.ndarray, np.ndarray], ...]  # (workspace buffer, operand)
    loop: Callable[..., None]
    args: tuple[Any, ...]
    dx_copy: tuple[np.ndarray, np.ndarray] | None  # (dx, its staged result)
    stores: tuple[tuple[np.ndarray, np.ndarray], ...]  # (dgamma / dbeta, float32 sums)


_UNSEEN = object()


def _zeros(outputs: list[np.ndarray], workspace: np.ndarray | None) -> None:
    """The launch of an empty request: sums over nothing."""
    for out in outputs:
        out[...] = 0


def _lay_out(plan: GnbPlan, a: _Arrays, n: int, workspace: np.ndarray | None) -> _Launch:
    """Carve the workspace, note the copies into it, and lay out the loop's arguments.

    Runs per launch of a new workspace (every two-phase call): the plan and the operands
    are unpacked once each, not read an attribute at a time.
    """
    (
        _,
        c,
        hxw,
        group,
        dtype,
        want_dx,
        want_dgamma,
        want_dbeta,
        _,
        _,
        stats_out,
        stage_x,
        stage_dy,
        stage_dx,
        _,
    ) = plan
    grad_out, x, mean, rstd, gamma, dx, dgamma, dbeta, ds_out, db_out = a
    cpg = c // group
    rows, channel_rows = n * group, n * c
    carve = Carver(workspace)
    copies: list[tuple[np.ndarray, np.ndarray]] = []
    shape2 = (channel_rows, hxw)
    x2 = _staged(carve, x, copies) if stage_x else x
    dy2 = _staged(carve, grad_out, copies) if stage_dy else grad_out
    dx_target = None
    if want_dx and stage_dx:
        dx_target = carve.take(channel_rows * hxw, dtype)
    mean32, rstd32 = _as_f32(carve, mean, copies), _as_f32(carve, rstd, copies)
    if gamma is None:
        gamma32, period = _ONE, 1
    else:  # per channel (C,), or per row and channel in a fused launch
        gamma32 = _as_f32(carve, gamma, copies)
        period = gamma32.size
    stores: list[tuple[np.ndarray, np.ndarray]] = []
    if stats_out:
        assert ds_out is not None and db_out is not None
        ds, db = ds_out.reshape(channel_rows), db_out.reshape(channel_rows)
        c_reduce, dgamma32, dbeta32 = 0, db, ds
    else:  # the loop adds the samples' sums into dgamma / dbeta, or in place for a store
        sums = carve.take(2 * channel_rows, F32)  # ds and db: one buffer, one carve
        ds, db = sums[:channel_rows], sums[channel_rows:]
        c_reduce = c
        dgamma32 = _sums_target(dgamma if want_dgamma else None, db, c, stores)
        dbeta32 = _sums_target(dbeta if want_dbeta else None, ds, c, stores)
    kind = _jit.KINDS[dtype]  # FLOAT, FLOAT16, BFLOAT16 (docs/operators.md)
    dy, dys = _channel_rows(dy2, shape2, kind)
    xf, xs = _channel_rows(x2, shape2, kind)
    if not want_dx:
        out, os_ = dy, 0  # not written
    elif dx_target is not None:
        out, os_ = _jit.storage(dx_target, kind), hxw
    else:
        assert dx is not None
        out, os_ = _channel_rows(dx, shape2, kind)  # viewable: the plan checked
    args = (
        dy,
        dys,
        xf,
        xs,
        out,
        os_,
        mean32,
        rstd32,
        gamma32,
        period,
        ds,
        db,
        rows,
        cpg,
        hxw,
        want_dx,
        n,
        c_reduce,
        dgamma32,
        dbeta32,
    )
    dx_copy = None if dx_target is None or dx is None else (dx, dx_target)
    return _Launch(tuple(copies), LOOPS[kind.name], args, dx_copy, tuple(stores))


def _plain_f32(array: np.ndarray) -> bool:
    """Whether ``array`` is float32 and C-contiguous: the loop reads it as it is."""
    # ``is`` first: a float32 array's dtype is numpy's one float32 dtype (cheaper than ==)
    return (array.dtype is F32 or array.dtype == F32) and array.flags.c_contiguous


def _channel_rows(
    array: np.ndarray, shape2: tuple[int, int], kind: _jit.Kind
) -> tuple[np.ndarray, int]:
    """``(flat storage, row stride)`` of an operand seen as ``shape2`` (channel rows,
    HxW): a contiguous one directly (one reshape, not two: this runs per launch)."""
    if array.flags.c_contiguous:
        return _jit.storage(array, kind), shape2[1]
    return _jit.flat(array.reshape(shape2), kind)


def _staged(
    carve: Carver, array: np.ndarray, copies: list[tuple[np.ndarray, np.ndarray]]
) -> np.ndarray:
    """A workspace buffer of ``array``'s shape that it is copied into before each launch."""
    buf = carve.take(array.size, array.dtype).reshape(array.shape)
    copies.append((buf, array))
    return buf


def _as_f32(
    carve: Carver, array: np.ndarray, copies: list[tuple[np.ndarray, np.ndarray]]
) -> np.ndarray:
    """``array`` as a flat float32 array: itself when it is one, else a workspace buffer it
    is converted into before each launch."""
    if _plain_f32(array):
        return array.ravel()  # a view: the array is C-contiguous
    buf = carve.take(array.size, F32)
    copies.append((buf.reshape(array.shape), array))
    return buf


def _sums_target(
    out: np.ndarray | None, sums: np.ndarray, c: int, stores: list[tuple[np.ndarray, np.ndarray]]
) -> np.ndarray:
    """Where the loop writes dgamma or dbeta: ``out`` itself when it is float32 and
    contiguous, else the first ``c`` per-channel-row ``sums`` (stored into ``out`` after)."""
    if out is not None and _plain_f32(out):
        return out.ravel()  # a view of its C elements: the array is C-contiguous
    if out is not None:
        stores.append((out, sums[:c]))
    return sums


def _run(launch: _Launch) -> None:
    for buf, array in launch.copies:
        np.copyto(buf, array, casting="unsafe")
    launch.loop(*launch.args)
    if launch.dx_copy is not None:
        dx, result = launch.dx_copy
        np.copyto(dx, result.reshape(dx.shape))
    for out, sums in launch.stores:
        store(out.reshape(sums.size), sums)


def plan_group_norm_backward(
    grad_out: np.ndarray,
    x: np.ndarray,
    dx: np.ndarray | None,
    n: int,
    c: int,
    hxw: int,
    group: int,
    mask: tuple[bool, bool, bool],
    has_gamma: bool,
) -> GnbPlan:
    """Plan a launch on checked arguments: which operands to stage, workspace bytes."""
    shape2 = (n * c, hxw)
    stage_dx = dx is not None and (must_stage(dx, shape2, True) or overlaps(dx, x, grad_out))
    return make_gnb_plan(
        n,
        c,
        hxw,
        group,
        x.dtype,
        mask,
        has_gamma=has_gamma,
        stage_x=must_stage(x, shape2, True),
        stage_dy=must_stage(grad_out, shape2, True),
        stage_dx=stage_dx,
    )
