"""``opsched stress``: the most demanding user the scheduler meets, with an exact verdict.

Requests are drawn from a pool of seeded *templates* (both operators, every dtype, ranks 1 to
8, empty tensors, non-contiguous views, occasionally large tensors, small graphs). Each
template's result under the solo oracle (the request alone through the two-phase API) is
computed once, so every valid result is compared bit for bit cheaply. Each request is then
independently made invalid (a corruption whose SPEC status is known by construction),
cancelled, given a deadline that has already passed, or hit by an injected launch fault.

Verified for every request: the right result or exactly the right error; resolved exactly
once (a watchdog catches lost ones; scheduler counters are cross-checked with the harness's
own, which catches duplicates); an expired request never launched. After shutdown: every
workspace block back in the pool, executors released, no scheduler thread alive,
``statistics()`` adding up, peak RSS within the stated bound. Exit status 0 only if all held.

Everything is reproducible from ``--seed``: a discrepancy prints the request index and its
template, and ``--replay INDEX`` reruns that single request.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import threading
import time
from array import array
from typing import Any, TextIO

import anyio
import attrs
import ml_dtypes
import numpy as np

import opsched
import opsched.sync
from opsched._api import resolve_config
from opsched._errors import AclnnError, DeadlineExceededError, RuntimeLaunchError
from opsched.ops.products import Product, product_named
from opsched.cli.solo import solo_glu, solo_gn, solo_gnb
from opsched.ops import DTYPE_NAMES

__all__ = ["StressOptions", "run_stress"]

_F16, _BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
_DTYPES = [np.dtype(np.float32), _F16, _BF16, np.dtype(np.float64)]
#: SPEC tolerances (rtol, atol) against the reference kernels.
_TOLERANCE = {
    np.dtype(np.float64): (1e-10, 1e-10),
    np.dtype(np.float32): (1e-4, 1e-4),
    _F16: (1e-2, 1e-3),
    _BF16: (2e-2, 2e-3),
}


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
    #: Share of templates (so of requests) with large tensors (256K elements).
    large: float = 0.01
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


def _gnb_args(rng: np.random.Generator, large: bool) -> tuple[Any, ...]:
    dtype = _DTYPES[rng.integers(3)]
    group = int(rng.integers(1, 4))
    c = group * int(rng.integers(1, 4))
    n = int(rng.integers(1, 5))
    hxw = 4096 if large else int(rng.integers(1, 9))
    spatial = (hxw,) if rng.random() < 0.5 else (1, hxw)  # (N, C, HxW) or (N, C, 1, HxW)
    x, dy = (_array(rng, (n, c, *spatial), dtype) for _ in range(2))
    mean = _array(rng, (n, group), dtype)
    rstd = (np.abs(mean.astype(np.float32)) + 0.5).astype(dtype)
    gamma = _array(rng, (c,), dtype) if rng.random() < 0.8 else None
    mask = _GNB_MASKS[int(rng.integers(len(_GNB_MASKS)))]
    return dy, x, mean, rstd, gamma, n, c, hxw, group, mask


def _glu_args(rng: np.random.Generator, large: bool) -> tuple[Any, ...]:
    dtype = _DTYPES[rng.integers(4)]
    ndim = int(rng.integers(1, 9))
    if large:
        shape = [128, 1024] if ndim < 2 else [1] * (ndim - 2) + [128, 1024]
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


def _gn_args(rng: np.random.Generator, large: bool) -> tuple[np.ndarray, ...]:
    dtype = _DTYPES[rng.integers(3)]
    ndim = int(rng.integers(3, 9))
    if large:
        shape = tuple([4, 16] + [1] * (ndim - 3) + [4096])
    else:
        shape = tuple(int(v) for v in rng.integers(1, 4 if ndim > 4 else 6, ndim))
    x, dy, gamma = (_array(rng, shape, dtype) for _ in range(3))
    mean = _array(rng, shape[:2], dtype)
    rstd = (np.abs(mean.astype(np.float32)) + 0.5).astype(dtype)
    return x, dy, gamma, mean, rstd


def make_template(seed: int, index: int, opts: StressOptions) -> _Template:
    """Template ``index`` of a run seeded ``seed`` (deterministic)."""
    rng = np.random.default_rng([seed, index])
    large = rng.random() < opts.large
    roll = rng.random()
    if roll < opts.graphs:
        x, dy, gamma, mean, rstd = _gn_args(rng, False)
        gate_shape = (*x.shape[:-1], 2 * x.shape[-1])
        gate = _array(rng, gate_shape, x.dtype)
        expected = solo_glu(solo_gn(x, dy, gamma, mean, rstd), gate, -1)
        return _Template(
            index,
            "graph",
            (x, dy, gamma, mean, rstd, gate),
            expected,
            f"graph GN{x.shape}->GLU{gate_shape} {x.dtype}",
        )
    rest = (roll - opts.graphs) / (1 - opts.graphs)  # uniform in [0, 1): one op a third
    if rest >= 2 / 3:
        args = _gnb_args(rng, large)
        return _Template(
            index,
            "gnb",
            args,
            solo_gnb(*args),
            f"gnb input{args[1].shape} N,C,HxW,group={args[5:9]} mask={args[9]} "
            f"{args[1].dtype} gamma={'yes' if args[4] is not None else 'no'}",
        )
    if rest < 1 / 3:
        g, x, dim = _glu_args(rng, large)
        return _Template(
            index,
            "glu",
            (g, x, dim),
            solo_glu(g, x, dim),
            f"glu self{x.shape} dim={dim} {x.dtype} strides={x.strides}",
        )
    args = _gn_args(rng, large)
    return _Template(
        index,
        "gn",
        args,
        solo_gn(*args),
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


# ------------------------------------------------------------------------------ the run


@attrs.define(eq=False)
class _Tally:
    """What the harness saw. Mutated from the loop and the sync threads (under ``lock``)."""

    lock: threading.Lock = attrs.field(factory=threading.Lock)
    outcomes: dict[str, int] = attrs.field(factory=dict)
    resolved: set[int] = attrs.field(factory=set)
    discrepancies: list[str] = attrs.field(factory=list)
    latencies: array = attrs.field(factory=lambda: array("d"))
    launched_expired: int = 0

    def record(
        self, case: _Case, outcome: str, problem: str | None = None, latency: float | None = None
    ) -> None:
        with self.lock:
            if case.index in self.resolved:
                self.outcomes["duplicated"] = self.outcomes.get("duplicated", 0) + 1
                self._note(f"request {case.index} resolved twice")
                return
            self.resolved.add(case.index)
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
            if problem is not None:
                where = f"request {case.index} ({case.fate}, template {case.template})"
                self._note(f"{where}: {problem}")
            if latency is not None:
                self.latencies.append(latency)

    def _note(self, text: str) -> None:
        if len(self.discrepancies) < 50:
            self.discrepancies.append(text)


class _Harness:
    """Submits the cases and checks each outcome."""

    def __init__(
        self, opts: StressOptions, templates: list[_Template], tally: _Tally, product: Product
    ) -> None:
        self.opts = opts
        self.templates = templates
        #: per template: the status the product answers it with (None: supported)
        self.unsupported = [_product_verdict(product, t) for t in templates]
        self.tally = tally
        # The out arrays of fault and deadline cases, by id(), kept alive until checked:
        # an id is only unique while its array lives.
        self.faulty: dict[int, np.ndarray] = {}
        self.expiring: dict[int, np.ndarray] = {}
        self.sample = np.random.default_rng([opts.seed, 7])

    def injector(self, requests: Any) -> bool:
        """Fault injector: fails launches with a fault case; notes launched expired ones."""
        fail = False
        for r in requests:
            out = id(next(r.tensors[n] for n in r.op.outputs if r.tensors[n] is not None))
            if out in self.expiring:
                self.tally.launched_expired += 1
            fail = fail or out in self.faulty
        return fail

    def prepare(self, case: _Case) -> tuple[str, tuple[Any, ...], dict[str, Any], Any]:
        """The call for ``case``: (op, args, kwargs, what to expect: a status for a request
        that must be rejected, else None)."""
        t = self.templates[case.template]
        unsupported = self.unsupported[case.template]
        if case.fate == "invalid" and t.kind != "graph":
            op, args, broken, status = _corrupt(t, case.corruption)
            # The product's verdict comes first: a missing operator before any check, an
            # unsupported dtype before everything but a missing tensor.
            if unsupported == 561003 or (unsupported == 161002 and status != 161001):
                status = unsupported
            return op, args, broken, status
        kw: dict[str, Any] = {"priority": case.index % 3}
        if t.kind != "graph":
            outs = [None if e is None else np.empty(e.shape, e.dtype) for e in t.entries]
            kw["out"] = tuple(outs) if t.kind == "gnb" else outs[0]
            out = next(o for o in outs if o is not None)  # the array the injector sees
            if case.fate == "fault":
                self.faulty[id(out)] = out
            if case.fate == "deadline":
                self.expiring[id(out)] = out
                kw["deadline"] = time.monotonic() - 1.0  # already passed: must never launch
        elif case.fate == "deadline":
            kw["deadline"] = time.monotonic() - 1.0
        return t.kind, t.args, kw, unsupported

    def check(
        self,
        case: _Case,
        status: Any,
        result: Any,
        error: BaseException | None,
        latency: float,
        out: Any = None,
    ) -> None:
        """Compare what happened with what should have."""
        t = self.templates[case.template]
        if isinstance(out, tuple):
            out = next(o for o in out if o is not None)
        if out is not None:  # unmark: once checked, its id may be reused by a new array
            self.faulty.pop(id(out), None)
            self.expiring.pop(id(out), None)
        fate = case.fate
        if t.kind == "graph" and fate in ("invalid", "fault"):
            fate = "valid"  # graphs are not corrupted nor faulted: they run as valid work
        if status is not None and fate != "invalid":
            fate = "unsupported"  # the product rejects it at submit, whatever its fate
        if fate == "fault" and not any(e.size for e in t.expected_arrays):
            fate = "valid"  # an empty request launches nothing, so nothing can fault
        if fate in ("invalid", "unsupported"):
            if isinstance(error, AclnnError) and error.status == status:
                self.tally.record(case, fate if fate == "invalid" else f"unsupported {status}")
            else:
                self.tally.record(case, "wrong", f"expected status {status}, got {error!r}")
        elif fate == "cancel":
            if error is None and result is None:
                self.tally.record(case, "cancelled")
            else:
                self.tally.record(
                    case, "wrong", f"cancelled request produced {error or 'a result'}"
                )
        elif fate == "deadline":
            expired = isinstance(error, DeadlineExceededError) or (
                isinstance(error, opsched.GraphExecutionError)
                and any(isinstance(e, DeadlineExceededError) for e in error.failed.values())
            )
            if expired:
                self.tally.record(case, "expired")
            else:
                self.tally.record(
                    case, "wrong", f"expected DeadlineExceededError, got {error or 'a result'}"
                )
        elif fate == "fault":
            if isinstance(error, RuntimeLaunchError) and isinstance(
                error.__cause__, opsched.InjectedFault
            ):
                self.tally.record(case, "faulted")
            else:
                self.tally.record(
                    case, "wrong", f"expected RuntimeLaunchError, got {error or 'a result'}"
                )
        elif error is not None:
            self.tally.record(case, "wrong", f"{t.describe}: raised {error!r}")
        elif not _same_result(result, t.expected):
            self.tally.record(case, "wrong", f"{t.describe}: result differs from the solo oracle")
        else:
            if self.sample.random() < 0.01 and any(e.size for e in t.expected_arrays):
                self._reference_check(case, t, result)
            self.tally.record(case, "completed", latency=latency)

    def _reference_check(self, case: _Case, t: _Template, result: Any) -> None:
        """A sample is also compared with the reference kernels, within SPEC tolerances."""
        if t.kind == "graph":
            return
        if t.kind == "gnb":
            names = ("grad_out", "input", "mean", "rstd", "gamma")
            scalars = dict(zip(("N", "C", "HxW", "group"), t.args[5:9], strict=True))
            ref = opsched.ops.GROUP_NORM_BACKWARD.reference(
                dict(zip(names, t.args[:5], strict=True)), scalars
            )
            for got, want in zip(result, ref, strict=True):
                if got is None:
                    continue
                rtol, atol = _TOLERANCE[got.dtype]
                scale = max(1.0, float(np.abs(want.astype(np.float64)).max(initial=0.0)))
                if not np.allclose(
                    got.astype(np.float64), want.reshape(got.shape).astype(np.float64),
                    rtol, atol * scale, equal_nan=True,
                ):  # fmt: skip
                    self.tally._note(
                        f"request {case.index}: outside SPEC tolerance of the reference"
                    )
            return
        op = opsched.ops.GLU_BACKWARD if t.kind == "glu" else opsched.ops.GROUP_NORM_GRAD
        if t.kind == "glu":
            g, x, dim = t.args
            ref = op.reference({"grad_out": g, "self": x}, {"dim": dim % x.ndim})
        else:
            names = ("x", "dy", "gamma", "mean", "rstd")
            ref = op.reference(dict(zip(names, t.args, strict=True)), {})
        rtol, atol = _TOLERANCE[result.dtype]
        if result.dtype == np.float16 and t.kind == "glu":
            rtol, atol = 1e-3, 1e-3
        if not np.allclose(
            result.astype(np.float64), ref.astype(np.float64), rtol, atol, equal_nan=True
        ):
            self.tally._note(f"request {case.index}: outside SPEC tolerance of the reference")


#: The operators each kind of template calls, in the order a graph's nodes are checked.
_KIND_OPS = {
    "glu": ("GluBackward",),
    "gn": ("GroupNormalizationGrad",),
    "gnb": ("GroupNormBackward",),
    "graph": ("GroupNormalizationGrad", "GluBackward"),
}


def _product_verdict(product: Product, t: _Template) -> int | None:
    """What ``product`` answers the template's requests with, from its table alone: 561003
    for an operator it lacks, 161002 for a dtype outside its list, None when supported."""
    x = t.args[1] if t.kind in ("glu", "gnb") else t.args[0]
    dtype = DTYPE_NAMES[x.dtype]
    for op in _KIND_OPS[t.kind]:
        support = product.ops.get(op)
        if support is None:
            return 561003
        if dtype not in support.dtypes:
            return 161002
    return None


def _same_result(result: Any, expected: Any) -> bool:
    """Bit-identical results: an array, or a tuple of arrays and Nones."""
    if isinstance(expected, tuple):
        if not isinstance(result, tuple) or len(result) != len(expected):
            return False
        return all(
            (r is None and e is None) or (r is not None and e is not None and _same_bits(r, e))
            for r, e in zip(result, expected, strict=True)
        )
    return isinstance(result, np.ndarray) and _same_bits(result, expected)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-identical: same dtype and shape, every element's bits equal (NaNs included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = np.dtype(f"u{a.dtype.itemsize}")
    return bool(
        np.array_equal(np.ascontiguousarray(a).view(bits), np.ascontiguousarray(b).view(bits))
    )


async def _submit_async(
    sched: opsched.Scheduler, kind: str, args: tuple[Any, ...], kw: dict[str, Any]
) -> Any:
    if kind == "glu":
        return await sched.glu_backward(*args, **kw)
    if kind == "gn":
        return await sched.group_norm_grad(*args, **kw)
    if kind == "gnb":
        return await sched.group_norm_backward(*args, **kw)
    g = opsched.Graph()
    x, dy, gamma, mean, rstd, gate = args
    a = g.group_norm_grad(x, dy, gamma, mean, rstd)
    b = g.glu_backward(a, gate, dim=-1)
    kw = {k: v for k, v in kw.items() if k in ("priority", "deadline")}
    (out,) = await sched.run(g, outputs=[b], **kw)
    return out


def _submit_sync(
    sched: opsched.sync.SyncScheduler, kind: str, args: tuple[Any, ...], kw: dict[str, Any]
) -> Any:
    if kind == "glu":
        return sched.submit_glu_backward(*args, **kw)
    if kind == "gn":
        return sched.submit_group_norm_grad(*args, **kw)
    if kind == "gnb":
        return sched.submit_group_norm_backward(*args, **kw)
    return None  # graphs go through the async clients


# ------------------------------------------------------------------------------ driver


def _rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak * (1 if sys.platform == "darwin" else 1024))


def _scheduler_threads() -> list[str]:
    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith(("opsched-stream", "asyncio-portal"))
    ]


class _Clock:
    """Hands out request indices until the count or the duration is reached (thread-safe)."""

    def __init__(self, opts: StressOptions) -> None:
        self._next = 0
        self._lock = threading.Lock()
        self._limit = opts.requests if opts.duration is None else math.inf
        self._until = math.inf if opts.duration is None else time.monotonic() + opts.duration
        self._only = opts.replay

    def take(self) -> int | None:
        with self._lock:
            if self._only is not None:
                index, self._only = self._only, None
                self._limit = 0
                return index
            if self._next >= self._limit or time.monotonic() >= self._until:
                return None
            self._next += 1
            return self._next - 1

    @property
    def issued(self) -> int:
        return self._next


def run_stress(opts: StressOptions, out: TextIO) -> int:
    """Run the stress test; print the summary to ``out``; return the exit status.

    Raises:
        ValueError: a torch device: the harness verifies results bit for bit against the
            numpy oracle, which the framework's operators do not match bit for bit.
    """
    if opts.device.startswith("torch"):
        msg = (
            f"--device={opts.device}: the stress harness verifies every result bit for bit "
            "against the numpy oracle; run it on cpu or reference"
        )
        raise ValueError(msg)
    started = time.perf_counter()
    templates = [make_template(opts.seed, i, opts) for i in range(opts.templates)]
    tally = _Tally()
    clock = _Clock(opts)
    overrides: dict[str, Any] = {
        "max_queued_requests": opts.max_queued_requests,
        "workspace_limit_bytes": opts.workspace_limit_bytes,
    }
    if opts.product is not None:
        overrides["product"] = opts.product
    config = resolve_config(opts.config, overrides)
    harness = _Harness(opts, templates, tally, product_named(config.product))
    rss_start = _rss_bytes()
    # Memory bound: what can be alive at once. Each async client holds one request, each
    # sync thread a burst of 256; each request's arrays (inputs, output, the oracle's copy)
    # are counted four times over; plus two pools' worth of workspace and 256 MiB of slack.
    mean = sum(
        sum(a.nbytes for a in t.args if isinstance(a, np.ndarray))
        + sum(e.nbytes for e in t.expected_arrays)
        for t in templates
    ) / len(templates)
    outstanding = opts.clients + 256 * opts.sync_clients
    bound = int(rss_start + 2 * config.workspace_limit_bytes + 4 * mean * outstanding + (256 << 20))
    progress = _Progress(opts, tally) if opts.progress else None

    with opsched.sync.open_scheduler(config, device=opts.device, trace=opts.trace) as facade:
        sched = facade.scheduler
        sched.device.inject_faults(harness.injector)
        threads = [
            threading.Thread(
                target=_sync_client, args=(facade, harness, clock, opts), name=f"stress-sync-{i}"
            )
            for i in range(opts.sync_clients)
        ]
        for t in threads:
            t.start()
        run_start = time.perf_counter()
        facade._portal.portal.call(_async_clients, sched, harness, clock, opts)
        for t in threads:
            t.join()
        elapsed = time.perf_counter() - run_start
    stats = sched.statistics()
    if progress is not None:
        progress.close()

    checks = _final_checks(stats, tally, clock, bound)
    report = _report(opts, stats, tally, clock, elapsed, checks, bound, started)
    report["product"] = config.product
    _print_summary(report, out)
    if opts.report:
        with open(opts.report, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
    return 0 if report["ok"] else 1


async def _async_clients(
    sched: opsched.Scheduler, harness: _Harness, clock: _Clock, opts: StressOptions
) -> None:
    async with anyio.create_task_group() as tg:
        for _ in range(opts.clients):
            tg.start_soon(_async_client, sched, harness, clock, opts)


async def _async_client(
    sched: opsched.Scheduler, harness: _Harness, clock: _Clock, opts: StressOptions
) -> None:
    while (index := clock.take()) is not None:
        case = make_case(opts.seed, index, opts)
        kind, args, kw, expect = harness.prepare(case)
        result: Any = None
        error: BaseException | None = None
        start = time.perf_counter()
        try:
            with anyio.fail_after(opts.watchdog):
                if case.fate == "cancel":
                    # Cancelled before it is submitted: the cancellation reaches the caller
                    # at its first wait, whatever the request's stage by then.
                    with anyio.CancelScope() as scope:
                        scope.cancel()
                        result = await _submit_async(sched, kind, args, kw)
                        error = AssertionError("the cancelled request returned a result")
                    result = None if error is None else result
                else:
                    result = await _submit_async(sched, kind, args, kw)
        except TimeoutError as exc:
            if isinstance(exc, DeadlineExceededError):
                error = exc
            else:
                harness.tally.record(case, "lost", f"no outcome within {opts.watchdog} s")
                continue
        except Exception as exc:
            error = exc
        harness.check(case, expect, result, error, time.perf_counter() - start, kw.get("out"))


def _sync_client(
    facade: opsched.sync.SyncScheduler, harness: _Harness, clock: _Clock, opts: StressOptions
) -> None:
    """A batch script: submits bursts of futures, then collects them (bursts fill the queue).

    Graph cases run through the blocking ``facade.run`` at once (a blocking run cannot be
    cancelled, so there a cancel case runs as a valid one).
    """
    while True:
        burst: list[tuple[_Case, Any, Any, float, BaseException | None, Any]] = []
        for _ in range(256):
            index = clock.take()
            if index is None:
                break
            case = make_case(opts.seed, index, opts)
            kind, args, kw, expect = harness.prepare(case)
            start = time.perf_counter()
            if kind == "graph":
                _sync_graph(facade, harness, case, args, kw, start, expect)
                continue
            try:
                future = _submit_sync(facade, kind, args, kw)
            except Exception as exc:  # rejected at submit
                burst.append((case, expect, None, start, exc, kw.get("out")))
                continue
            if case.fate == "cancel" and not future.cancel():
                # it finished before it could be cancelled: it must then be right
                case = attrs.evolve(case, fate="valid")
            burst.append((case, expect, future, start, None, kw.get("out")))
        if not burst:
            return
        for case, expect, future, start, error, out in burst:
            result = None
            if future is not None:
                if future.cancelled():
                    harness.check(case, expect, None, None, 0.0, out)
                    continue
                try:
                    result = future.result(timeout=opts.watchdog)
                except TimeoutError as exc:
                    if not future.done():
                        harness.tally.record(case, "lost", f"no outcome within {opts.watchdog} s")
                        continue
                    error = exc
                except Exception as exc:  # the request's own error
                    error = exc
            harness.check(case, expect, result, error, time.perf_counter() - start, out)


def _sync_graph(
    facade: opsched.sync.SyncScheduler,
    harness: _Harness,
    case: _Case,
    args: tuple[Any, ...],
    kw: dict[str, Any],
    start: float,
    expect: int | None,
) -> None:
    g = opsched.Graph()
    x, dy, gamma, mean, rstd, gate = args
    b = g.glu_backward(g.group_norm_grad(x, dy, gamma, mean, rstd), gate, dim=-1)
    result, error = None, None
    try:
        (result,) = facade.run(g, [b], **{k: v for k, v in kw.items() if k == "deadline"})
    except Exception as exc:
        error = exc
    if case.fate == "cancel":
        case = attrs.evolve(case, fate="valid")
    harness.check(case, expect, result, error, time.perf_counter() - start)


class _Progress:
    """A tqdm bar with live throughput, fed from a small thread reading the tally."""

    def __init__(self, opts: StressOptions, tally: _Tally) -> None:
        from tqdm import tqdm

        total = None if opts.duration is not None else opts.requests
        self._bar = tqdm(total=total, unit="req", desc="stress", smoothing=0.1)
        self._tally = tally
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stress-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        shown = 0
        while not self._stop.wait(0.2):  # a display refresh rate, not a wait for work
            done = len(self._tally.resolved)
            self._bar.update(done - shown)
            shown = done
        self._bar.update(len(self._tally.resolved) - shown)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._bar.close()


def _final_checks(
    stats: opsched.SchedulerStatistics, tally: _Tally, clock: _Clock, bound: int
) -> dict[str, tuple[bool, str]]:
    """The checks after shutdown: name -> (held, detail)."""
    issued = clock.issued if clock.issued else len(tally.resolved)
    lost = tally.outcomes.get("lost", 0) + max(0, issued - len(tally.resolved))
    total = stats.completed + stats.failed + stats.cancelled + stats.expired
    threads = _scheduler_threads()
    peak = _rss_bytes()
    return {
        "every request resolved exactly once": (
            lost == 0 and tally.outcomes.get("duplicated", 0) == 0,
            f"{len(tally.resolved)} of {issued} resolved; "
            f"{lost} lost, {tally.outcomes.get('duplicated', 0)} duplicated",
        ),
        "every result right": (
            tally.outcomes.get("wrong", 0) == 0,
            f"{tally.outcomes.get('wrong', 0)} wrong",
        ),
        "expired requests never launched": (
            tally.launched_expired == 0,
            f"{tally.launched_expired} launched after their deadline",
        ),
        "statistics add up": (
            stats.submitted == total and stats.queued == 0 and stats.running == 0,
            f"submitted {stats.submitted} = completed {stats.completed} + failed "
            f"{stats.failed} + cancelled {stats.cancelled} + expired {stats.expired} "
            f"(= {total})",
        ),
        "workspace blocks all returned": (
            stats.pool.in_use == 0,
            f"{stats.pool.in_use} bytes still handed out after shutdown",
        ),
        "executors released": (
            stats.executor_cache.size == 0,
            f"{stats.executor_cache.size} executors still cached after shutdown",
        ),
        "no scheduler thread alive": (not threads, ", ".join(threads) or "none"),
        "memory bounded": (
            peak <= bound,
            f"peak RSS {peak >> 20} MiB, bound {bound >> 20} MiB",
        ),
    }


def _report(
    opts: StressOptions,
    stats: opsched.SchedulerStatistics,
    tally: _Tally,
    clock: _Clock,
    elapsed: float,
    checks: dict[str, tuple[bool, str]],
    bound: int,
    started: float,
) -> dict[str, Any]:
    lat = sorted(tally.latencies)

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3 if lat else 0.0

    issued = len(tally.resolved)
    return {
        "ok": all(held for held, _ in checks.values()),
        "options": attrs.asdict(opts),
        "requests": issued,
        "seconds": elapsed,
        "throughput_per_s": issued / elapsed if elapsed else 0.0,
        "latency_ms": {"p50": pct(0.50), "p99": pct(0.99)},
        "outcomes": dict(sorted(tally.outcomes.items())),
        "checks": {name: {"held": held, "detail": d} for name, (held, d) in checks.items()},
        "discrepancies": tally.discrepancies,
        "scheduler": {
            "launches": stats.launches,
            "requests_per_launch_mean": stats.requests_per_launch_mean,
            "queued_peak": stats.queued_peak,
            "max_queued_requests": opts.max_queued_requests,
            "backpressure_waits": stats.backpressure_waits,
            "workspace_limit_bytes": opts.workspace_limit_bytes,
            "rejected": stats.rejected,
            "graph_runs": stats.graph_runs,
            "pool_peak_bytes": stats.pool.peak,
            "executor_hit_rate": stats.executor_cache.hit_rate,
        },
        "peak_rss_bytes": _rss_bytes(),
        "rss_bound_bytes": bound,
        "wall_seconds": time.perf_counter() - started,
    }


def _print_summary(r: dict[str, Any], out: TextIO) -> None:
    o = r["options"]
    print(
        f"opsched stress: {r['requests']} requests, {o['clients']} async clients + "
        f"{o['sync_clients']} sync threads, seed {o['seed']}, device {o['device']}, "
        f"product {r['product']}",
        file=out,
    )
    print(
        f"  {r['throughput_per_s']:,.0f} requests/s over {r['seconds']:.1f} s; latency p50 "
        f"{r['latency_ms']['p50']:.2f} ms, p99 {r['latency_ms']['p99']:.2f} ms",
        file=out,
    )
    outcomes = ", ".join(f"{k} {v}" for k, v in r["outcomes"].items())
    print(f"  outcomes: {outcomes}", file=out)
    s = r["scheduler"]
    print(
        f"  scheduler: {s['launches']} launches ({s['requests_per_launch_mean']:.1f} "
        f"requests each), executor hit rate {s['executor_hit_rate']:.1%}",
        file=out,
    )
    print(
        f"  caps met: queue peak {s['queued_peak']} (callers capped at "
        f"{s['max_queued_requests']}, {s['backpressure_waits']} backpressure waits; graph "
        f"nodes are admitted past it), pool peak "
        f"{s['pool_peak_bytes'] >> 20} of {s['workspace_limit_bytes'] >> 20} MiB",
        file=out,
    )
    print(f"  {'check':<40}{'':<8}detail", file=out)
    for name, check in r["checks"].items():
        verdict = "ok" if check["held"] else "FAILED"
        print(f"  {name:<40}{verdict:<8}{check['detail']}", file=out)
    if r["discrepancies"]:
        print("  first discrepancies (rerun one with --seed S --replay INDEX):", file=out)
        for line in r["discrepancies"][:10]:
            print(f"    {line}", file=out)
    print(f"  verdict: {'PASS' if r['ok'] else 'FAIL'}", file=out)
