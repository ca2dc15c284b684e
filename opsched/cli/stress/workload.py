"""The stress workload: options, seeded templates, and each request's fate."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import attrs
import ml_dtypes
import numpy as np

from opsched.cli.solo import solo_glu, solo_gn, solo_gnb
from opsched.cli.stress import oracle

_F16, _BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
_DTYPES = [np.dtype(np.float32), _F16, _BF16, np.dtype(np.float64)]


@attrs.frozen(kw_only=True)
class StressOptions:
    """What a stress run does (the command's options)."""

    requests: int = 20000
    duration: float | None = None
    clients: int = 64
    sync_clients: int = 2
    seed: int = 0
    device: str = "cpu"
    config: str | None = None
    #: Check requests against this product's table (None: the config's); requests it does
    #: not support must fail with exactly its status (561003 or 161002).
    product: str | None = None
    invalid: float = 0.05
    cancel: float = 0.02
    deadline: float = 0.02
    fault: float = 0.01
    graphs: float = 0.10
    templates: int = 512
    #: Share of templates (so of requests) with large tensors: half of them 256K elements
    #: (launched alone, split across streams), half 32K (fused, but run on their own
    #: arrays inside the fused launch).
    large: float = 0.02
    report: str | None = None
    #: Write the scheduler's timeline (Chrome trace / Perfetto JSON) here.
    trace: str | None = None
    progress: bool = False
    replay: int | None = None
    #: Seconds a request may take before it counts as lost.
    watchdog: float = 60.0
    #: Small caps, so the bursts meet them: backpressure and launches waiting for memory.
    max_queued_requests: int = 256
    workspace_limit_bytes: int = 16 << 20


# ------------------------------------------------------------------------------ templates


@attrs.frozen
class _Template:
    """One request shape with its data and its solo-oracle result."""

    index: int
    kind: str  # "glu", "gn", "gnb" or "graph"
    args: tuple[Any, ...]
    #: The solo oracle's result: an array, or (dx, dgamma, dbeta) with None where not asked.
    expected: Any
    describe: str
    #: The independent float64 oracle's result (:mod:`opsched.cli.stress.oracle`).
    oracle: Any = None
    #: How far opsched's own kernels may put the result from it (``oracle.error_bound``).
    bound: Any = None

    @property
    def entries(self) -> list[np.ndarray | None]:
        """The expected outputs, one per operator output (None where not asked for)."""
        return list(self.expected) if isinstance(self.expected, tuple) else [self.expected]

    @property
    def expected_arrays(self) -> list[np.ndarray]:
        """The expected output arrays (the entries that are not None)."""
        return [e for e in self.entries if e is not None]


def _array(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Values in [-3, 3); a fifth of the arrays are non-contiguous views of the same values."""
    values = (rng.random(shape) * 6 - 3).astype(dtype)
    layout = rng.integers(10)
    if layout == 0 and values.ndim:
        return np.asfortranarray(values)
    if layout == 1 and values.ndim:
        big = np.zeros(tuple(2 * s for s in shape), dtype)
        view = big[tuple(slice(None, None, 2) for _ in shape)]
        view[...] = values
        return view
    return values


#: output masks of the GroupNormBackward templates (dx alone, all, the statistics alone)
_GNB_MASKS = ((True, True, True), (True, False, False), (False, True, True))


def _gnb_args(rng: np.random.Generator, shrink: int) -> tuple[Any, ...]:
    dtype = _DTYPES[rng.integers(3)]
    group = int(rng.integers(1, 4))
    c = group * int(rng.integers(1, 4))
    n = int(rng.integers(1, 5))
    hxw = 4096 // shrink if shrink else int(rng.integers(1, 9))
    spatial = (hxw,) if rng.random() < 0.5 else (1, hxw)  # (N, C, HxW) or (N, C, 1, HxW)
    x, dy = (_array(rng, (n, c, *spatial), dtype) for _ in range(2))
    mean = _array(rng, (n, group), dtype)
    rstd = (np.abs(mean.astype(np.float32)) + 0.5).astype(dtype)
    gamma = _array(rng, (c,), dtype) if rng.random() < 0.8 else None
    mask = _GNB_MASKS[int(rng.integers(len(_GNB_MASKS)))]
    return dy, x, mean, rstd, gamma, n, c, hxw, group, mask


def _glu_args(rng: np.random.Generator, shrink: int) -> tuple[Any, ...]:
    dtype = _DTYPES[rng.integers(4)]
    ndim = int(rng.integers(1, 9))
    if shrink:
        rows = 128 // shrink
        shape = [rows, 1024] if ndim < 2 else [1] * (ndim - 2) + [rows, 1024]
    else:
        shape = [int(v) for v in rng.integers(1, 4 if ndim > 4 else 7, ndim)]
        if rng.random() < 0.05:
            shape[int(rng.integers(ndim))] = 0  # an empty tensor
    dim = int(rng.integers(-ndim, ndim))
    shape[dim] *= 2
    x = _array(rng, tuple(shape), dtype)
    gshape = list(shape)
    gshape[dim] //= 2
    return _array(rng, tuple(gshape), dtype), x, dim


def _gn_args(rng: np.random.Generator, shrink: int) -> tuple[np.ndarray, ...]:
    dtype = _DTYPES[rng.integers(3)]
    ndim = int(rng.integers(3, 9))
    if shrink:
        shape = tuple([4, 16] + [1] * (ndim - 3) + [4096 // shrink])
    else:
        shape = tuple(int(v) for v in rng.integers(1, 4 if ndim > 4 else 6, ndim))
    x, dy, gamma = (_array(rng, shape, dtype) for _ in range(3))
    mean = _array(rng, shape[:2], dtype)
    rstd = (np.abs(mean.astype(np.float32)) + 0.5).astype(dtype)
    return x, dy, gamma, mean, rstd


#: Each operator's solo call by template kind: the two-phase API (the numpy devices'
#: oracle of bits), or a torch device's own launch of one request.
Solos = dict[str, Callable[..., Any]]
TWO_PHASE: Solos = {"glu": solo_glu, "gn": solo_gn, "gnb": solo_gnb}


def make_template(
    seed: int, index: int, opts: StressOptions, solos: Solos = TWO_PHASE
) -> _Template:
    """Template ``index`` of a run seeded ``seed`` (deterministic), with both oracles'
    results computed once: the solo call's (``solos``) and the independent float64 one."""
    t = _make_template(seed, index, opts, solos)
    dtype = t.expected_arrays[0].dtype if t.expected_arrays else np.dtype(np.float32)
    want = oracle.expected(t.kind, t.args, dtype)
    return attrs.evolve(t, oracle=want, bound=oracle.error_bound(t.kind, t.args, dtype, want))


def _make_template(seed: int, index: int, opts: StressOptions, solos: Solos) -> _Template:
    rng = np.random.default_rng([seed, index])
    # 0: a small template; else what the large sizes are divided by (1: 256K elements, 8: 32K)
    shrink = (1, 8)[int(rng.integers(2))] if rng.random() < opts.large else 0
    roll = rng.random()
    if roll < opts.graphs:
        x, dy, gamma, mean, rstd = _gn_args(rng, 0)
        gate_shape = (*x.shape[:-1], 2 * x.shape[-1])
        gate = _array(rng, gate_shape, x.dtype)
        expected = solos["glu"](solos["gn"](x, dy, gamma, mean, rstd), gate, -1)
        return _Template(
            index,
            "graph",
            (x, dy, gamma, mean, rstd, gate),
            expected,
            f"graph GN{x.shape}->GLU{gate_shape} {x.dtype}",
        )
    rest = (roll - opts.graphs) / (1 - opts.graphs)  # uniform in [0, 1): one op a third
    if rest >= 2 / 3:
        args = _gnb_args(rng, shrink)
        return _Template(
            index,
            "gnb",
            args,
            solos["gnb"](*args),
            f"gnb input{args[1].shape} N,C,HxW,group={args[5:9]} mask={args[9]} "
            f"{args[1].dtype} gamma={'yes' if args[4] is not None else 'no'}",
        )
    if rest < 1 / 3:
        g, x, dim = _glu_args(rng, shrink)
        return _Template(
            index,
            "glu",
            (g, x, dim),
            solos["glu"](g, x, dim),
            f"glu self{x.shape} dim={dim} {x.dtype} strides={x.strides}",
        )
    args = _gn_args(rng, shrink)
    return _Template(
        index,
        "gn",
        args,
        solos["gn"](*args),
        f"gn x{args[0].shape} {args[0].dtype} strides={args[0].strides}",
    )


# ------------------------------------------------------------------------------ the plan


@attrs.frozen
class _Case:
    """Request ``index``: which template, and what should happen to it."""

    index: int
    template: int
    fate: str  # valid, invalid, cancel, deadline, fault
    corruption: int


_FATES = ("valid", "invalid", "cancel", "deadline", "fault")
_CHUNK = 4096


def make_case(seed: int, index: int, opts: StressOptions) -> _Case:
    """The fate of request ``index`` (deterministic from the seed and the index)."""
    templates, fates, corruptions = _chunk(seed, index // _CHUNK, opts)
    i = index % _CHUNK
    return _Case(index, int(templates[i]), _FATES[fates[i]], int(corruptions[i]))


_chunks: dict[tuple[Any, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
_chunks_lock = threading.Lock()


def _chunk(seed: int, chunk: int, opts: StressOptions) -> tuple[np.ndarray, ...]:
    """Templates, fates and corruptions of 4096 consecutive requests, drawn at once (one
    seeded generator per request would cost more than the request)."""
    rates = (opts.invalid, opts.cancel, opts.deadline, opts.fault)
    key = (seed, chunk, opts.templates, rates)
    with _chunks_lock:
        found = _chunks.get(key)
        if found is None:
            rng = np.random.default_rng([seed, 1 << 40, chunk])
            templates = rng.integers(opts.templates, size=_CHUNK)
            edges = np.cumsum(rates)
            fates = np.searchsorted(edges, rng.random(_CHUNK), side="right")
            fates = np.where(fates < len(rates), fates + 1, 0)  # 0 is "valid"
            corruptions = rng.integers(4, size=_CHUNK)
            if len(_chunks) > 64:
                _chunks.clear()
            found = _chunks[key] = (templates, fates, corruptions)
    return found


def _corrupt(t: _Template, how: int) -> tuple[str, tuple[Any, ...], dict[str, Any], int]:
    """A broken version of a template's call: (op, args, kwargs, expected status)."""
    if t.kind == "glu":
        g, x, dim = t.args
        if how == 0:
            return "glu", (g, x, x.ndim + 3), {}, 161002  # dim out of range
        if how == 1:
            return "glu", (None, x, dim), {}, 161001  # missing grad_out
        if how == 2:
            return "glu", (g.astype(np.int32), x, dim), {}, 161002  # dtype outside the list
        return "glu", (g, x, dim), {"out": np.empty((*x.shape, 1), x.dtype)}, 161002
    if t.kind == "gnb":
        dy, x, mean, c, mask = t.args[0], t.args[1], t.args[2], t.args[6], t.args[9]
        if how == 0:
            return "gnb", (*t.args[:8], c + 1, mask), {}, 161002  # group not dividing C
        if how == 1:
            return "gnb", (dy, x, None, *t.args[3:]), {}, 161001  # missing mean
        if how == 2:
            return "gnb", (dy, x, mean.astype(np.float64), *t.args[3:]), {}, 161002  # dtype
        return "gnb", (*t.args[:9], (True, True)), {}, 161002  # output_mask of 2
    x, dy, gamma, mean, rstd = t.args[:5]
    if how == 0:
        return "gn", (x, dy, gamma, mean[..., None], rstd), {}, 161002  # mean not 2-D
    if how == 1:
        return "gn", (x, dy, None, mean, rstd), {}, 161001  # missing gamma
    if how == 2:
        return "gn", (x, dy.astype(np.float64), gamma, mean, rstd), {}, 161002
    return "gn", (x, dy, gamma.reshape(-1), mean, rstd), {}, 161002  # gamma 1-D
