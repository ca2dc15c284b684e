"""Checks at submit time, cached by request signature.

A request's checks (docs/operators.md), product profile, fusion key, units and bytes depend only on
its arrays' shapes and dtypes and its scalar arguments (the operator's signature of them), so a
signature seen before skips them: one dict lookup. Failures are never cached: a bad
request always runs the checks and raises its status. What the checks see of the arrays,
where the arrays live and how outputs are allocated are the device's business
(:meth:`Device.meta`, :meth:`Device.bind`, :meth:`Device.check_fits`).

Everything here runs in the submitting thread (the loop's, or a thread's) and touches no
scheduler state but the cache, whose one writer is :meth:`Checks.check`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from time import monotonic
from typing import Any, NamedTuple

import attrs
import numpy as np

from opsched._lru import LRU
from opsched.core.requests import Call, Request
from opsched.devices import Device
from opsched.ops import Operator
from opsched.ops._base import check_writable, shapes_and_dtypes
from opsched.ops.products import Product

__all__ = ["CallPlan", "Checks", "canonical_signature", "deadline_of", "priority_of"]

#: Each output's shape and dtype (:meth:`Operator.output_spec`).
OutputSpec = Mapping[str, tuple[tuple[int, ...], np.dtype]]

#: Calls whose checks passed, kept to skip re-checking recurring geometry (each under its
#: signature and under the positional call that made it: two entries).
SIGNATURES_KEPT = 4096

#: One object per distinct signature: see :func:`canonical_signature`.
_CANONICAL: LRU[Hashable, Hashable] = LRU(SIGNATURES_KEPT)


def canonical_signature(signature: Hashable | None) -> Hashable | None:
    """The one object kept for signatures equal to ``signature`` (None stays None).

    A fused launch groups its requests by signature (``ops._fusion.signature_groups``);
    consecutive requests whose signatures are the same object skip hashing it (0.1-0.2 us
    a nested tuple of shapes and dtypes, twice a launch). Requests checked in full and
    graph nodes both take theirs from here (the call cache hands out what it stored).
    """
    if signature is None:
        return None
    found = _CANONICAL.get(signature)
    if found is None:
        _CANONICAL.put(signature, signature)
        return signature
    return found


@attrs.frozen(slots=True)
class CallPlan:
    """What the checks decided for a call signature: everything that depends on the
    shapes, dtypes and scalars alone, so a call of the same signature skips the checks."""

    op: Operator
    #: The checked (normalised) scalar arguments.
    scalars: dict[str, Any]
    #: Each output's shape and dtype.
    spec: OutputSpec
    #: The fusion key and the request's units of a fused launch's capacity.
    key: Hashable
    units: int
    #: What the request reads and writes.
    nbytes: int
    #: The checks' signature (canonical: one object per distinct signature).
    signature: Hashable


class Checks:
    """A scheduler's checks for one device and product, with the signature cache. A call
    that passes becomes its request's record (:class:`~opsched.core.requests.Request`):
    the one value it travels as from here on, numbered by ``new_id``."""

    __slots__ = ("_device", "_meta", "_new_id", "_product", "plans")

    def __init__(self, device: Device, product: Product, new_id: Callable[[], int]) -> None:
        self._device = device
        self._product = product
        self._new_id = new_id
        #: The plan of every call signature that passed, under its signature and under
        #: the positional call that made it (``Operator.call_signature``: the fast path of
        #: a repeated call, which builds no argument dicts to look).
        self.plans: LRU[Hashable, CallPlan] = LRU(2 * SIGNATURES_KEPT)
        # Host devices check the arrays themselves: skip the copy on the hot path.
        self._meta = type(device).meta is not Device.meta

    def check(
        self,
        op: Operator,
        tensors: dict[str, Any],
        scalars: dict[str, Any],
        priority: int,
        deadline: float | None,
    ) -> Request:
        """Check a request; return its record, its outputs bound.

        Raises:
            ParamNullptrError, ParamInvalidError, InnerError, TypeError: the first failing
                check, as docs/operators.md and the product profile order them.
        """
        device = self._device
        meta = device.meta(tensors) if self._meta else tensors
        signature = canonical_signature(op.signature(meta, scalars))
        known = self.plans.lookup(signature) if signature is not None else None
        spec: OutputSpec
        if known is None or known.op is not op:
            scalars = op.check_on(self._product, meta, scalars, allocate=True)
            spec = op.output_spec(meta, scalars)
            nbytes = _nbytes(op, meta, spec)
            tensors, convert = device.bind(op, tensors, scalars, spec, nbytes)
            full = device.meta(tensors) if self._meta else tensors
            key, units = op.fusion(full, scalars)
            device.check_fits(op, full, scalars, key, units, nbytes)
            key = device.launch_key(op, full, key)
            if signature is not None:
                plan = CallPlan(op, scalars, spec, key, units, nbytes, signature)
                self.plans.put(signature, plan)
        else:
            scalars, spec, key, units, nbytes = (
                known.scalars,
                known.spec,
                known.key,
                known.units,
                known.nbytes,
            )
            check_writable(op.name, op.outputs, tensors)  # not part of the signature
            tensors, convert = device.bind(op, tensors, scalars, spec, nbytes)
        return Request(
            self._new_id(),
            monotonic(),
            op,
            tensors,
            scalars,
            key,
            units,
            nbytes,
            priority,
            deadline,
            signature,
            convert,
        )

    def call(self, call: Call) -> Request:
        """A public call checked into its request's record: by one lookup (:meth:`known`)
        when the same call passed before (its deadline is not part of the checks; outputs
        given as numpy arrays of the same shapes and dtypes, each checked writeable), else
        in full (:meth:`check`), and then remembered for the lookup. Raises as
        :meth:`check`, and as :func:`deadline_of` for a bad deadline or timeout."""
        op, args, out, priority, deadline, timeout = call
        cacheable = type(priority) is int
        if cacheable:
            when = None if deadline is None and timeout is None else deadline_of(deadline, timeout)
            known = self.known(op, args, priority, out, when)
            if known is not None:
                return known
        tensors, scalars = op.arguments(args, out)
        request = self.check(
            op, tensors, scalars, priority_of(priority), deadline_of(deadline, timeout)
        )
        if cacheable:
            self.remember_call(op, args, request, out)
        return request

    def remember_call(
        self, op: Operator, args: Sequence[Any], request: Request, out: Any = None
    ) -> None:
        """After ``request`` passed its checks for a call of ``args`` (and ``out``): let
        :meth:`known` find it by the call itself."""
        call = op.call_signature(args)
        if out is not None:
            call = _with_outputs(call, out)
        if call is not None and request.signature is not None:
            plan = self.plans.get(request.signature)
            if plan is not None:
                self.plans.put(call, plan)

    def known(
        self,
        op: Operator,
        args: Sequence[Any],
        priority: int,
        out: Any = None,
        deadline: float | None = None,
    ) -> Request | None:
        """A call whose checks passed before, checked by one lookup: its request's record;
        None when it is not known (the caller then checks it in full). With outputs
        ``out``, the lookup is by the call and the outputs' shapes and dtypes, and each
        output is checked writeable (not part of the checks' signature: as :meth:`check`
        does for a signature seen before).

        Raises:
            ParamInvalidError: a read-only output.
            TypeError: ``out`` is not one entry per output (:meth:`Operator.arguments`).
        """
        call, tensors = op.call_tensors(args, out)
        if out is not None:
            call = _with_outputs(call, out)
        # (C-level, no Python call; not moved to the back: see opsched/_lru.py)
        plan = self.plans.get(call) if call is not None else None
        if plan is None or plan.op is not op:
            return None
        assert tensors is not None  # (a call with a key has its tensors)
        scalars, spec, key, units = plan.scalars, plan.spec, plan.key, plan.units
        nbytes, signature = plan.nbytes, plan.signature
        if out is not None:
            check_writable(op.name, op.outputs, tensors)
        convert = None
        if not 0 < nbytes <= self._device.binds_as_given:  # (else it would change nothing)
            tensors, convert = self._device.bind(op, tensors, scalars, spec, nbytes)
        return Request(
            self._new_id(),
            monotonic(),
            op,
            tensors,
            scalars,
            key,
            units,
            nbytes,
            priority,
            deadline,
            signature,
            convert,
        )


def _with_outputs(call: Hashable | None, out: Any) -> Hashable | None:
    """The call cache's key of a call (``call``: its :meth:`Operator.call_signature`) given
    its outputs ``out``; None when either cannot be cached."""
    given = _out_signature(out)
    return None if call is None or given is None else (call, given)


def _out_signature(out: Any) -> Hashable | None:
    """What the checks of a call depend on of its outputs ``out`` (a numpy array, or a
    tuple of them and None): their shapes and dtypes; None for anything else (then nothing
    is cached, as :meth:`Operator.signature` caches nothing for such outputs)."""
    if type(out) is np.ndarray:
        return out.shape, out.dtype
    parts = shapes_and_dtypes(out) if type(out) is tuple else None
    return None if parts is None else tuple(parts)


def _nbytes(op: Operator, tensors: Mapping[str, Any], spec: OutputSpec) -> int:
    """What a request reads and writes: its arrays, and the outputs ``spec`` says it
    will be given (before they are allocated)."""
    given = {**tensors, **{n: _Shaped(s, d) for n, (s, d) in spec.items() if tensors[n] is None}}
    return op.nbytes(given)


class _Shaped(NamedTuple):
    """An output not allocated yet: only its size counts (``nbytes``)."""

    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def priority_of(priority: object) -> int:
    """``priority`` as an int.

    Raises:
        TypeError: not an integer (a bool is not one).
    """
    if type(priority) is int:
        return priority
    if isinstance(priority, bool) or not isinstance(priority, int | np.integer):
        msg = f"priority must be an integer, got {type(priority).__qualname__} {priority!r}"
        raise TypeError(msg)
    return int(priority)


def deadline_of(deadline: float | None, timeout: float | None) -> float | None:
    """The absolute ``time.monotonic()`` deadline of a request (the earlier of the two).

    Raises:
        TypeError: a value that is not a number of seconds.
        ValueError: a negative timeout.
    """
    if deadline is None and timeout is None:
        return None
    for name, value in (("deadline", deadline), ("timeout", timeout)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            msg = f"{name} must be a number of seconds or None, got {value!r}"
            raise TypeError(msg)
        if not math.isfinite(value):
            msg = f"{name}={value!r} must be a finite number of seconds (None: no {name})"
            raise ValueError(msg)
    if timeout is not None:
        if timeout < 0:
            msg = f"timeout={timeout} must be >= 0 seconds"
            raise ValueError(msg)
        by_timeout = time.monotonic() + timeout
        return by_timeout if deadline is None else min(deadline, by_timeout)
    return None if deadline is None else float(deadline)
