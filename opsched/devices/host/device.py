"""The host devices: numpy kernels on the CPU, with a workspace pool and an executor cache.

- ``"cpu"``: :class:`CpuDevice`, one worker thread per stream running its FIFO of launches;
  numpy releases the GIL in its loops, so streams compute in parallel.
- ``"reference"``: :class:`ReferenceDevice`, for tests: launches run inline, in submission
  order, with the reference kernels; fully deterministic.

Launch preparation is theirs: a lone request runs on its own arrays with a cached,
repeatable executor keyed by its geometry; a fused batch gathers its requests into the
arrays of a bucketed capacity carved from one pooled workspace block (:class:`FusedLayout`),
runs the operator's own kernel on the used prefix, and scatters each request's slice back,
so every element is computed by the same operations as when launched alone (bit-identical
results). A failing fused launch is re-run in halves to isolate the culprits. A batch of at
most :data:`SOLO_BATCH_MAX` requests, and a request of at least :data:`LONE_BYTES` in any
batch, is not gathered: it runs on its own arrays with its solo plan inside the launch.

This module knows operators only through their descriptions, and nothing of the scheduler.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple, Self

import attrs
import numpy as np

from opsched._errors import ParamInvalidError
from opsched._log import WARNING, enabled, get_logger
from opsched._lru import LRU
from opsched.devices.base import Device, LaunchBatch, Prepared, allocate_missing
from opsched.devices.cache import CacheStatistics, ExecutorCache
from opsched.devices.host.executor import Executor, geometry_of
from opsched.devices.host.launcher import HostLauncher, Layout
from opsched.devices.host.launchers import LAUNCHERS
from opsched.devices.malloc import keep_freed_memory
from opsched.devices.pool import Block, PoolStatistics, WorkspacePool
from opsched.devices.streams import InlineStream, Stream, ThreadStream
from opsched.kernels._common import DEFAULT_BLOCK, Carver, workspace_bytes
from opsched.ops import Operator
from opsched.ops._base import Launch

__all__ = ["CpuDevice", "FusedLayout", "HostDevice", "ReferenceDevice", "bucket"]

#: The outputs a blocking call's launch allocates: (name, shape, dtype) each.
_Made = tuple[tuple[str, tuple[int, ...], np.dtype], ...]


class SoloPlan(NamedTuple):
    """A solo launch run in its caller's thread (:meth:`HostDevice.run_solo`), kept by
    its layout: the kernel's plan, the outputs it allocates (for a call that gave none)
    and its prepared launch (which takes scratch of its own in a caller's thread)."""

    plan: Any
    made: _Made
    launch: Launch


_log = get_logger("opsched.device")

#: Launch work: ``(errors by request id, start, end)``.
Outcome = tuple[dict[int, BaseException], float, float]


#: Plans :meth:`HostDevice.run_solo` keeps (the least recently used go first).
_PLANS_KEPT = 1024

#: Graph intermediates at least this large come from the workspace pool, which reuses
#: their memory (the fresh pages of a large array fault in one at a time). Smaller ones
#: are plain arrays: malloc reuses small blocks at once, and the pool's bookkeeping costs
#: several times ``np.empty``.
POOLED_INTERMEDIATE_BYTES = 64 << 10


#: In a fused batch, a request of at least this many bytes (inputs and outputs) runs on its
#: own arrays with its solo plan (the same bits), one after another inside the launch,
#: instead of being gathered: copying it in and out costs more than the launch it shares
#: saves (``opsched bench scheduler --parts medium`` measures such requests).
LONE_BYTES = 128 << 10

#: A batch of at most this many requests runs each on its own arrays with its solo plan
#: (:meth:`HostDevice.run_solo`: the same bits), one after another inside the launch: a
#: fused launch's gather, scatter, workspace block and executor cost a few dozen numpy and
#: Python calls whatever the batch's size, more than a dozen solo launches of tiny
#: requests; from about 16 requests on, the fused launch costs less.
SOLO_BATCH_MAX = 12


def bucket(units: int) -> int:
    """Fused capacity for ``units``: a power of two (at least 256), so recurring work
    reuses a few executors. Only the used prefix is computed, so the padding is free."""
    return 1 << max(8, (units - 1).bit_length())


def capacities(units: int, largest: int) -> list[int]:
    """The fused capacities to try, in order, for a batch of ``units`` whose largest
    request has ``largest``: :func:`bucket`'s, then smaller powers of two down to the least
    that holds that request. A launch of a capacity under ``units`` gathers its requests in
    chunks that fit, one after another, in one block: under a small workspace cap a block
    of the padded capacity may not fit where a smaller one does."""
    loose = bucket(units)
    out = [loose]
    capacity = 1 << (units - 1).bit_length()
    least = 1 << (largest - 1).bit_length()
    while capacity >= least:
        if capacity < loose:
            out.append(capacity)
        capacity //= 2
    return out


def chunks(requests: Sequence[Any], capacity: int) -> list[Sequence[Any]]:
    """``requests`` in consecutive runs of at most ``capacity`` units (each request has at
    most that many)."""
    out: list[Sequence[Any]] = []
    start = used = 0
    for i, request in enumerate(requests):
        if used + request.units > capacity:
            out.append(requests[start:i])
            start, used = i, 0
        used += request.units
    out.append(requests[start:])
    return out


@attrs.frozen
class FusedLayout:
    """Where a fused launch's gathered arrays and kernel workspace sit in its block."""

    arrays: tuple[tuple[str, tuple[int, ...], np.dtype], ...]
    kernel_bytes: int
    nbytes: int

    @classmethod
    def of(
        cls, geometry: dict[str, tuple[tuple[int, ...], np.dtype]], kernel_bytes: int
    ) -> FusedLayout:
        arrays = tuple((name, shape, dtype) for name, (shape, dtype) in geometry.items())
        counts = [(math.prod(shape), dtype) for _, shape, dtype in arrays]
        return cls(arrays, kernel_bytes, workspace_bytes(counts) + kernel_bytes)

    def carve(self, block: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """The gathered arrays and the kernel's workspace, as views of ``block``."""
        carve = Carver(block)
        arrays = {
            name: carve.take(math.prod(shape), dtype).reshape(shape)
            for name, shape, dtype in self.arrays
        }
        return arrays, block[carve.offset :]


@attrs.define(eq=False)
class HostDevice(Device):
    """A device whose data is numpy arrays in host memory (see the module docstring)."""

    #: The name :func:`opsched.devices.make_device` knows it by, and its kind of stream.
    device_name: ClassVar[str]
    stream_class: ClassVar[type[Stream]]
    #: Launches at least this large run alone (the scheduler's ``fuse_max_bytes``).
    fuse_max_bytes: int = attrs.field(default=1 << 20, kw_only=True)
    #: Whether requests that run on their own arrays inside a fused launch go through
    #: their operator's table loop (the fast kernels'; the reference kernels have none).
    table_launches: ClassVar[bool] = True
    _pool: WorkspacePool = attrs.field(factory=lambda: WorkspacePool(64 << 20), kw_only=True)
    _cache: ExecutorCache = attrs.field(factory=lambda: ExecutorCache(1024), kw_only=True)
    #: :meth:`run_solo`'s plans (:class:`SoloPlan`: the plan, the outputs it allocates,
    #: the prepared launch), by layout: of requests whose outputs the launch allocates, by
    #: signature and the inputs' strides; of the others, by signature, every array's
    #: strides and whether an output overlaps an input. Callers' threads share it.
    _solo_plans: LRU[Hashable, Any] = attrs.field(factory=lambda: LRU(_PLANS_KEPT), init=False)

    @classmethod
    def create(
        cls,
        streams: int,
        *,
        workspace_limit_bytes: int = 64 << 20,
        executor_cache_limit: int = 1024,
        fuse_max_bytes: int = 1 << 20,
        malloc_keep_bytes: int = 0,
    ) -> Self:
        """A device of this kind with ``streams`` streams, its workspace pool capped at
        ``workspace_limit_bytes`` and its executor cache at ``executor_cache_limit``;
        glibc's malloc keeps ``malloc_keep_bytes`` of freed memory for its outputs
        (:func:`~opsched.devices.malloc.keep_freed_memory`: process-wide)."""
        keep_freed_memory(malloc_keep_bytes)
        return cls(
            cls.device_name,
            [cls.stream_class(i) for i in range(streams)],
            fuse_max_bytes=fuse_max_bytes,
            pool=WorkspacePool(workspace_limit_bytes),
            cache=ExecutorCache(executor_cache_limit),
        )

    def launcher(self, op: Operator, plan: Any, tensors: Mapping[str, Any]) -> Launch:
        """This device's one launch entry of ``op``: ``plan`` prepared on ``tensors``'
        layout (:meth:`HostLauncher.prepare`, the fast kernels); ``launch(tensors,
        workspace)``."""
        return LAUNCHERS[op.name].prepare(plan, tensors)

    def run_kernel(
        self, op: Operator, plan: Any, tensors: dict[str, np.ndarray], workspace: Any
    ) -> None:
        """Compute ``op`` for ``plan`` into the output arrays (prepared for them now)."""
        self.launcher(op, plan, tensors)(tensors, workspace)

    # --------------------------------------------------------------------- admission

    def __attrs_post_init__(self) -> None:
        self.binds_as_given = self.fuse_max_bytes  # see bind()
        self.pools_intermediates_from = POOLED_INTERMEDIATE_BYTES  # see intermediate()
        self.runs_alone_from = {
            name: self.alone_from(launcher) for name, launcher in LAUNCHERS.items()
        }

    def alone_from(self, launcher: HostLauncher) -> int:
        """From what size a request of ``launcher``'s operator gains nothing from company:
        :data:`LONE_BYTES` (a fused launch runs it on its own arrays), or from less where
        the fast kernel's solo launch costs no more than its share of a fused launch
        (:attr:`HostLauncher.alone_from`)."""
        return min(launcher.alone_from, LONE_BYTES)

    def bind(
        self,
        op: Operator,
        tensors: dict[str, Any],
        scalars: dict[str, Any],
        spec: Mapping[str, tuple[tuple[int, ...], np.dtype]],
        nbytes: int,
    ) -> tuple[dict[str, Any], None]:
        """Outputs the caller did not give are allocated at launch when the request may
        fuse (a fused launch copies each request's results into a new array of its own:
        one copy, nothing allocated per request on the loop thread); now otherwise."""
        if not 0 < nbytes <= self.fuse_max_bytes:
            allocate_missing(op, tensors, scalars)
        return tensors, None

    def check_fits(
        self,
        op: Operator,
        tensors: Mapping[str, Any],
        scalars: Mapping[str, Any],
        key: Hashable,
        units: int,
        nbytes: int,
    ) -> None:
        """A request that is gathered into fused launches fits when a fused block of its
        own capacity fits the cap; where none does, its launch runs it on its own arrays
        (:meth:`_prepare_fused`), as every larger request: then its solo plan's workspace
        is what it needs."""
        pool = self._pool
        if nbytes <= pool.limit // 4:  # small requests always fit: no planning
            return
        if nbytes < LONE_BYTES and nbytes <= self.fuse_max_bytes:
            for capacity in capacities(units, units):
                if pool.fits(_fused_plan(op, key, capacity)[0].nbytes):
                    return
        # outputs left to the launch (a request that may fuse): plan with arrays of theirs
        tensors = dict(tensors)
        op.allocate(tensors, scalars)
        host = LAUNCHERS[op.name]
        need = host.workspace_size(host.plan(tensors, scalars, DEFAULT_BLOCK))
        if not pool.fits(need):
            msg = (
                f"{op.name}: this request needs {need} bytes of workspace, more than "
                f"workspace_limit_bytes={pool.limit}"
            )
            raise ParamInvalidError(msg)

    # ---------------------------------------------------------------------- launches

    runs_in_caller: bool = attrs.field(default=True, kw_only=True)

    def run_solo(self, request: Any, *, outputs_made: bool = False) -> None:
        """The solo launch of ``request`` in the calling thread: the same plan and kernel
        as :meth:`_prepare_solo` (so the same bits), a fresh workspace instead of the
        pool's (the pool belongs to the loop thread), plans cached by geometry.

        A request whose outputs are all left to the launch (the usual blocking call), or
        were all made for it by this device (``outputs_made``: a graph node's), is
        planned by its signature and its inputs' strides alone: its outputs are new,
        C-contiguous arrays of shapes the signature fixes, which overlap nothing; the cache
        holds the shapes of those it allocates, so they are allocated without the
        operator's rules."""
        op: Operator = request.op
        tensors = request.tensors
        signature = request.signature
        by_inputs = signature is not None
        if by_inputs and not outputs_made:
            for name in op.outputs:  # a loop, not all(): this runs for every blocking call
                if tensors[name] is not None:
                    by_inputs = False
                    break
        if by_inputs:
            # the inputs' strides (None for an absent one), with no Python call per input
            arrays = map(tensors.__getitem__, op.inputs)
            key: Hashable = (signature, *map(getattr, arrays, _STRIDES, _NONE))
            found = self._solo_plans.get(key)
            if found is None:
                missing = [n for n in op.outputs if tensors[n] is None]
                allocate_missing(op, tensors, request.scalars)
                made = tuple(
                    (n, tensors[n].shape, tensors[n].dtype)
                    for n in missing
                    if tensors[n] is not None
                )
                found = self._solo_plan(op, tensors, request.scalars, made)
                self._solo_plans.put(key, found)
            else:  # (not moved to the back: see opsched/_lru.py)
                for name, shape, dtype in found.made:
                    tensors[name] = np.empty(shape, dtype)
        else:
            allocate_missing(op, tensors, request.scalars)
            if signature is None:  # arguments the checks could not key: planned afresh
                found = self._solo_plan(op, tensors, request.scalars, ())
            else:
                key = (
                    signature,
                    tuple([_strides(tensors[n]) for n in op.tensor_names]),
                    op.overlaps_any(tensors),
                )
                found = self._solo_plans.lookup(key)
                if found is None:
                    found = self._solo_plan(op, tensors, request.scalars, ())
                    self._solo_plans.put(key, found)
        if self._faulty is not None:
            self.check_fault([request])
        found.launch(tensors, None)  # its scratch its own (the pool is the loop thread's)

    def _solo_plan(
        self, op: Operator, tensors: dict[str, Any], scalars: Mapping[str, Any], made: _Made
    ) -> SoloPlan:
        """A solo launch's plan for ``tensors``' layout, prepared (:meth:`launcher`)."""
        plan = LAUNCHERS[op.name].plan(tensors, scalars, DEFAULT_BLOCK)
        return SoloPlan(plan, made, self.launcher(op, plan, tensors))

    def prepare(self, batch: LaunchBatch, *, overflow: bool = False) -> Prepared | None:
        if batch.fused:
            return self._prepare_fused(batch, overflow)
        return self._prepare_solo(batch, overflow)

    def _prepare_solo(self, batch: LaunchBatch, overflow: bool) -> Prepared | None:
        request = batch.requests[0]
        op: Operator = request.op
        if batch.part is None:
            allocate_missing(op, request.tensors, request.scalars)
        tensors, scalars = batch.part or (request.tensors, request.scalars)
        strides = tuple([_strides(tensors[n]) for n in op.tensor_names])
        if batch.part is None and request.signature is not None:
            geometry: Hashable = request.signature  # shapes, dtypes, scalars: from the checks
        else:
            geometry = (
                tuple(geometry_of(tensors[n]) for n in op.tensor_names),
                tuple(sorted(scalars.items())),
            )
        overlap = op.overlaps_any(tensors)
        cache_key = (geometry, strides, overlap, self.name, batch.stream)
        executor = self._cache.lookup(cache_key)
        hit = executor is not None
        if executor is None:
            host = LAUNCHERS[op.name]
            plan = host.plan(tensors, scalars, DEFAULT_BLOCK)
            # The cache keeps the plan, never a request's arrays (the launch binds its own,
            # below): bound to the executor, a caller's inputs and result stayed alive until
            # the next request of that geometry came, if ever.
            executor = Executor(op, {}, scalars, plan, host.workspace_size(plan))
            executor.set_repeatable()
            # its launch prepared once for the layout the key fixes (shapes, dtypes,
            # strides, overlap): a hit pays for the kernel's call alone
            executor.layout = self.launcher(op, plan, tensors)
            self._cache.put(cache_key, executor)
        size = executor.workspace_size
        block: Block | None = None
        if size:
            block = self._pool.allocate(size, batch.stream, overflow=overflow)
            if block is None:
                return None
        workspace = block.array if block is not None else None
        executor.count_launch()
        launch: Launch = executor.layout
        bound = dict(tensors)
        requests = batch.requests

        def work() -> Outcome:
            start = time.perf_counter()
            self.check_fault(requests)
            launch(bound, workspace)
            return {}, start, time.perf_counter()

        return Prepared(work, block, hit)

    def _prepare_fused(self, batch: LaunchBatch, overflow: bool) -> Prepared | None:
        requests = batch.requests
        op: Operator = requests[0].op
        units = batch.units
        if len(requests) <= SOLO_BATCH_MAX:
            return self._alone(op, list(requests))
        lone = [r for r in requests if r.nbytes >= LONE_BYTES]
        if lone:
            requests = [r for r in requests if r.nbytes < LONE_BYTES]
            units = sum([r.units for r in requests])
            if not requests:  # nothing to gather: no fused block
                return self._alone(op, lone)
        found = self._fused_executor(op, batch.key, units, batch.stream, requests)
        if found is None:  # gathered, they could never fit the cap: each on its own arrays
            return self._alone(op, [*lone, *requests])
        executor, cache_key, hit, capacity = found
        layout: FusedLayout = executor.layout
        block = self._pool.allocate(layout.nbytes, batch.stream, overflow=overflow)
        if block is None:
            return None
        try:
            # A block keeps the views it was carved into, per layout: steady state carves
            # nothing. The cached executor keeps the plan and layout, never the views (bound
            # to it, they kept a released block's memory after empty_cache()).
            views = block.views.get(cache_key)
            if views is None:
                views = block.views[cache_key] = layout.carve(block.array)
            arrays, kernel_ws = views
            executor.count_launch()
        except BaseException:
            self._pool.release(block)
            raise
        run = functools.partial(self._run_fused, op, executor.plan, arrays, kernel_ws)
        # the usual launch gathers once; under a small workspace cap, chunk after chunk
        # goes through the one block
        parts = [requests] if capacity >= units else chunks(requests, capacity)

        def fused(errors: dict[int, BaseException]) -> None:
            for part in parts:
                run(part, errors)

        work, _ = self._fused_work(op, lone, fused)
        return Prepared(work, block, hit)

    def _alone(self, op: Operator, requests: list[Any]) -> Prepared:
        """A fused batch whose requests all run on their own arrays (no fused block)."""
        work, one_call = self._fused_work(op, requests, None)
        return Prepared(work, cache_hit=None, one_call=one_call)

    def _fused_executor(
        self, op: Operator, key: Hashable, units: int, stream: int, requests: Sequence[Any]
    ) -> tuple[Executor, Hashable, bool, int] | None:
        """The repeatable executor of a fused launch of ``requests`` (``units`` in all),
        its cache key, whether it was cached, and its capacity: the first of
        :func:`capacities` whose block fits under the workspace cap (the usual launch: the
        first tried); None when none does."""

        def tried() -> Iterator[int]:  # the smaller capacities only when the first is over
            yield bucket(units)
            yield from capacities(units, max([r.units for r in requests]))[1:]

        for capacity in tried():
            executor, cache_key, hit = self._fused_at(op, key, capacity, stream)
            if self._pool.fits(executor.layout.nbytes):
                return executor, cache_key, hit, capacity
        return None

    def _fused_at(
        self, op: Operator, key: Hashable, capacity: int, stream: int
    ) -> tuple[Executor, Hashable, bool]:
        """The repeatable executor of fused launches of ``capacity`` units on ``stream``,
        its cache key, and whether it was cached."""
        cache_key = (op.name, "fused", key, capacity, self.name, stream)
        executor = self._cache.lookup(cache_key)
        if executor is not None:
            return executor, cache_key, True
        layout, plan, scalars = _fused_plan(op, key, capacity)
        executor = Executor(op, {}, scalars, plan, layout.kernel_bytes)
        executor.set_repeatable()
        executor.layout = layout
        self._cache.put(cache_key, executor)
        return executor, cache_key, False

    def _fused_work(
        self,
        op: Operator,
        lone: list[Any],
        fused: Callable[[dict[int, BaseException]], None] | None,
    ) -> tuple[Callable[[], Outcome], bool]:
        """A fused batch's launch, and whether it is one compiled call (which holds the GIL
        only to start: it may compute on its stream's thread while the loop runs).

        Its ``lone`` requests run on their own arrays: those the operator's table loop
        takes in one call (:meth:`HostLauncher.table`, built here, on the loop thread), the
        rest one by one (:meth:`run_solo`); both with their solo launch's bits. When the
        table call fails, each of its requests runs alone, so only the one that fails gets
        an error. Then ``fused``, the gather-compute-scatter of the rest (None: no rest)."""
        call: Callable[[], None] | None = None
        tabled: list[Any] = []
        solo = lone
        if lone and self.table_launches:
            call, tabled, solo = LAUNCHERS[op.name].table(lone)

        def work() -> Outcome:
            start = time.perf_counter()
            errors: dict[int, BaseException] = {}
            alone = solo
            if call is not None:
                try:
                    self.check_fault(tabled)
                    call()
                except Exception:  # find the culprits: each alone, its own launch
                    alone = [*tabled, *solo]
            for request in alone:
                try:
                    self.run_solo(request)
                except Exception as exc:  # the launch boundary of one request
                    errors[request.id] = exc
            if fused is not None:
                fused(errors)
            return errors, start, time.perf_counter()

        return work, call is not None and not solo and fused is None

    def _run_fused(
        self,
        op: Operator,
        plan: Any,
        arrays: dict[str, np.ndarray],
        workspace: np.ndarray,
        requests: Sequence[Any],
        errors: dict[int, BaseException],
        outermost: bool = True,
    ) -> None:
        """Gather, compute, scatter; on failure re-run in halves to isolate the culprits."""
        try:
            self.check_fault(requests)
            host = LAUNCHERS[op.name]
            layout = Layout.of(requests)
            host.gather(layout, arrays)
            for part in host.fused_parts(layout, arrays):
                self.run_kernel(op, plan, part, workspace)
            host.scatter(layout, arrays)
        except Exception as exc:
            if len(requests) == 1:
                errors[requests[0].id] = exc
                return
            failed = len(errors)
            half = len(requests) // 2
            self._run_fused(op, plan, arrays, workspace, requests[:half], errors, False)
            self._run_fused(op, plan, arrays, workspace, requests[half:], errors, False)
            if outermost and len(errors) == failed and enabled(WARNING):
                # No request failed alone: the launch failed for what it was together
                # (a fault in the fused gather / scatter, say). Its requests got their
                # results, but that must not pass unseen (said once per launch).
                _log.warning(
                    "a fused launch failed, then its requests ran in smaller launches",
                    op=op.name,
                    requests=len(requests),
                    error=f"{type(exc).__name__}: {exc}",
                )

    def release(self, token: Any) -> None:
        if token is not None:
            self._pool.release(token)

    def intermediate(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[Any, Any]:
        """From the pool while it is at most half full (the other half stays for launch
        workspaces), else a plain array; a plain array too below
        :data:`POOLED_INTERMEDIATE_BYTES` (:attr:`pools_intermediates_from`: a graph run
        asks for none of those)."""
        nbytes = math.prod(shape) * dtype.itemsize
        pool = self._pool
        if nbytes >= POOLED_INTERMEDIATE_BYTES and pool.current + nbytes <= pool.limit // 2:
            block = pool.allocate(nbytes, 0)
            if block is not None:
                view = block.views.get((shape, dtype))  # a reused block keeps its views
                if view is None:
                    view = block.array[:nbytes].view(dtype).reshape(shape)
                    block.views[(shape, dtype)] = view
                return view, block
        return np.empty(shape, dtype), None

    # ------------------------------------------------------------------------ memory

    def memory_statistics(self) -> PoolStatistics:
        return self._pool.statistics()

    def memory_usage(self) -> tuple[int, int]:
        return self._pool.in_use, self._pool.current

    def memory_stats(self) -> dict[str, int]:
        return self._pool.memory_stats()

    def reset_peak_stats(self) -> None:
        self._pool.reset_peak_stats()

    def empty_cache(self) -> None:
        self._pool.empty_cache()

    def executor_statistics(self) -> CacheStatistics:
        return self._cache.statistics()

    def close(self) -> None:
        super().close()
        self._cache.clear()
        self._pool.empty_cache()


@attrs.define(eq=False)
class CpuDevice(HostDevice):
    """The default device: numpy fast kernels, one worker thread per stream."""

    device_name: ClassVar[str] = "cpu"
    stream_class: ClassVar[type[Stream]] = ThreadStream


@attrs.define(eq=False)
class ReferenceDevice(HostDevice):
    """The test device: reference kernels, inline streams, submission order (its streams
    count for statistics only)."""

    device_name: ClassVar[str] = "reference"
    stream_class: ClassVar[type[Stream]] = InlineStream
    table_launches: ClassVar[bool] = False
    #: Everything runs on the loop thread, in submission order: callers' threads never.
    runs_in_caller: bool = attrs.field(default=False, kw_only=True)

    def launcher(self, op: Operator, plan: Any, tensors: Mapping[str, Any]) -> Launch:
        return LAUNCHERS[op.name].prepare_reference(plan, tensors)

    def alone_from(self, launcher: HostLauncher) -> int:
        """:data:`LONE_BYTES` for every operator: the launchers measured the fast kernels'
        solo launches, not the reference kernels'; and tests on this device see small
        requests fuse."""
        return LONE_BYTES


def _fused_plan(op: Operator, key: Hashable, capacity: int) -> tuple[FusedLayout, Any, Any]:
    """A fused launch of ``capacity`` units: its block's layout, its plan and scalars."""
    host = LAUNCHERS[op.name]
    geometry, scalars = host.fused_geometry(key, capacity)
    plan = host.fused_plan(key, capacity, DEFAULT_BLOCK)
    return FusedLayout.of(geometry, host.workspace_size(plan)), plan, scalars


def _strides(array: np.ndarray | None) -> tuple[int, ...] | None:
    return None if array is None else array.strides


#: ``getattr(array, "strides", None)`` for each of a request's arrays, through ``map``.
_STRIDES, _NONE = itertools.repeat("strides"), itertools.repeat(None)
