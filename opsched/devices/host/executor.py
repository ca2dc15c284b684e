"""Executors of the two-phase API: the prepared plan of one launch (the device's
``aclOpExecutor``), run on the cpu device's kernels in the calling thread.

``*_get_workspace_size`` checks the arguments, plans the launch and returns an executor.
By default it is single-use. :meth:`Executor.set_repeatable` (right after planning, as
``aclSetAclOpExecutorRepeatable``) lets it launch many times, with new arrays of the same
geometry bound in between (:meth:`Executor.bind`, the device's ``aclSetInputTensorAddr`` /
``aclSetOutputTensorAddr``), until :meth:`Executor.destroy` (``aclDestroyAclOpExecutor``).

Every misuse is a ParamInvalidError (161002) whose message says what was wrong.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Hashable
from types import TracebackType
from typing import Any

import attrs
import numpy as np

from opsched._errors import InnerError, ParamInvalidError, RuntimeLaunchError, Status
from opsched._lru import LRU
from opsched.devices.host.launchers import LAUNCHERS
from opsched.kernels._common import DEFAULT_BLOCK
from opsched.ops._base import Launch, Operator, check_array_kind, check_present, dtype_name
from opsched.ops.products import product_named

#: numpy's uint8 dtype (a workspace's).
_U8 = np.dtype(np.uint8)

__all__ = [
    "PLANS",
    "Executor",
    "ExecutorState",
    "PlanCache",
    "PlanCacheStatistics",
    "geometry_of",
    "get_workspace_size",
    "launch",
]


class ExecutorState(enum.Enum):
    """Where an executor is in its life."""

    #: Planned; may be launched (once, or many times when repeatable).
    READY = "ready"
    #: A single-use executor that has been launched: it cannot launch again.
    SPENT = "spent"
    #: Released by :meth:`Executor.destroy`.
    DESTROYED = "destroyed"


#: Read at every launch, bound once (as :data:`opsched.core.requests.DONE` is: a member
#: read through its class is dearer).
_READY, _SPENT = ExecutorState.READY, ExecutorState.SPENT


def geometry_of(
    array: np.ndarray | None,
) -> tuple[tuple[int, ...], np.dtype, tuple[int, ...]] | None:
    """What an executor fixes about a bound array: shape, dtype and strides (None: absent)."""
    return None if array is None else (array.shape, array.dtype, array.strides)


@attrs.define(eq=False)
class Executor:
    """A planned launch of one operator on bound arrays.

    Create one with an ``opsched.aclnn.*_get_workspace_size`` function, never directly.
    """

    op: Operator
    tensors: dict[str, np.ndarray]
    scalars: dict[str, Any]
    plan: Any
    workspace_size: int
    #: Free for the owner's bookkeeping (the host devices keep a fused launch's layout
    #: here, and a solo launch's prepared launch).
    layout: Any = attrs.field(default=None, init=False)
    _repeatable: bool = attrs.field(default=False, init=False)
    _state: ExecutorState = attrs.field(default=ExecutorState.READY, init=False)
    _launches: int = attrs.field(default=0, init=False)
    #: Whether the bound arrays are the ones the plan was made for (so their overlap is
    #: planned): False after a bind, until the next launch checks it.
    _as_planned: bool = attrs.field(default=True, init=False)
    #: The kernel prepared for the bound arrays' layout (the host launcher's ``prepare``:
    #: the plan cache's, or made at the first launch); arrays bound later have that layout.
    _launch: Launch | None = attrs.field(default=None, kw_only=True)

    @property
    def repeatable(self) -> bool:
        """Whether :meth:`set_repeatable` was called."""
        return self._repeatable

    @property
    def state(self) -> ExecutorState:
        """The executor's :class:`ExecutorState`."""
        return self._state

    @property
    def launches(self) -> int:
        """How many launches this executor has started."""
        return self._launches

    def set_repeatable(self) -> None:
        """Allow many launches (``aclSetAclOpExecutorRepeatable``); call before the first.

        Raises:
            ParamInvalidError: the executor was already launched or destroyed.
        """
        self._require_live("set_repeatable")
        if self._launches:
            msg = (
                f"{self.op.name} executor: set_repeatable() must be called right after "
                f"get_workspace_size, before the first launch (it has {self._launches})"
            )
            raise ParamInvalidError(msg)
        self._repeatable = True

    def bind(self, /, **arrays: np.ndarray) -> None:
        """Bind new arrays of the same geometry for the next launch (repeatable only).

        Args:
            **arrays: argument name to array, e.g. ``bind(grad_out=g, self=x, out=o)``.

        Raises:
            TypeError: an unknown argument name, or a value that is not a numpy array.
            ParamNullptrError: a value is None.
            ParamInvalidError: the executor is not repeatable or is destroyed, or an array's
                shape, dtype or strides differ from the ones it was planned for.
        """
        self._require_live("bind")
        op = self.op.name
        if not self._repeatable:
            msg = f"{op} executor: bind() needs a repeatable executor; call set_repeatable()"
            raise ParamInvalidError(msg)
        for name, array in arrays.items():
            if name not in self.tensors:
                names = self.op.tensor_names
                msg = f"{op}.bind: unknown argument {name!r}; expected one of {names}"
                raise TypeError(msg)
            check_present(op, **{name: array})
            check_array_kind(f"{op}.bind", name, array)
            want, got = geometry_of(self.tensors[name]), geometry_of(array)
            if want is None:
                msg = f"{op}.bind: the executor was planned without {name}; it cannot bind one"
                raise ParamInvalidError(msg)
            assert got is not None
            if want != got:
                msg = (
                    f"{op}.bind: {name} has shape {got[0]}, dtype {dtype_name(got[1])}, "
                    f"strides {got[2]}; the executor was planned for shape {want[0]}, dtype "
                    f"{dtype_name(want[1])}, strides {want[2]}"
                )
                raise ParamInvalidError(msg)
        self.tensors.update(arrays)
        self._as_planned = False

    def count_launch(self) -> None:
        """Count a launch whose workspace and bound arrays the owner guarantees (the
        scheduler: pool-sized workspace, geometry from the cache key); only the
        executor's own state is checked."""
        if self._state is not ExecutorState.READY:
            msg = f"{self.op.name} executor: launch while {self._state.value}"
            raise ParamInvalidError(msg)
        self._launches += 1
        if not self._repeatable:
            self._state = ExecutorState.SPENT

    def destroy(self) -> None:
        """Release the executor (``aclDestroyAclOpExecutor``); a second call does nothing."""
        self._state = ExecutorState.DESTROYED
        self.tensors = {}
        self._launch = None

    def __enter__(self) -> Executor:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.destroy()

    def run(self, op: Operator, workspace: object, workspace_size: object) -> None:
        """Check a launch request, consume one launch and run the kernel here, on the
        arrays bound now.

        Raises:
            ParamInvalidError: wrong operator, executor spent or destroyed, workspace
                missing or smaller than planned, output overlapping an input unplanned.
            TypeError: workspace or workspace_size of the wrong kind.
            RuntimeLaunchError: the kernel failed (its exception chained).
        """
        ws = self.consume(op, workspace, workspace_size)
        launch = self._launch
        assert launch is not None  # consume prepared it
        try:
            launch(self.tensors, ws)
        except Exception as exc:
            msg = f"{op.name}: the launch failed: {type(exc).__name__}: {exc}"
            raise RuntimeLaunchError(msg) from exc

    def consume(self, op: Operator, workspace: object, workspace_size: object) -> Any:
        """Check a launch of the bound arrays and count it; return the workspace to use.

        Raises: as :meth:`run`, but for the kernel's own failure.
        """
        name = op.name
        if self.op is not op:
            msg = f"{name}: the executor was prepared for {self.op.name}, not {name}"
            raise ParamInvalidError(msg)
        if self._state is not _READY:  # one test on the usual path
            self._require_live("launch")
            msg = (
                f"{name}: this single-use executor was already launched; call "
                "set_repeatable() right after get_workspace_size to launch it again"
            )
            raise ParamInvalidError(msg)
        ws = self._check_workspace(name, workspace, workspace_size)
        if not self._as_planned:  # arrays rebound since the last launch
            if LAUNCHERS[op.name].unplanned_overlap(self.plan, self.tensors):
                msg = (
                    f"{name}: the bound output overlaps an input, but the executor was "
                    "planned for separate buffers; plan a new executor for overlapping arrays"
                )
                raise ParamInvalidError(msg)
            self._as_planned = True
        if self._launch is None:
            self._launch = LAUNCHERS[op.name].prepare(self.plan, self.tensors)
        self._launches += 1
        if not self._repeatable:
            self._state = _SPENT
        return ws

    def _check_workspace(
        self, name: str, workspace: object, workspace_size: object
    ) -> np.ndarray | None:
        if type(workspace_size) is int:  # the usual call: no protocol lookups
            size = workspace_size
        elif isinstance(workspace_size, bool) or not hasattr(workspace_size, "__index__"):
            msg = f"{name}: workspace_size must be an integer, got {workspace_size!r}"
            raise TypeError(msg)
        else:
            size = operator.index(workspace_size)
        need = self.workspace_size
        if size < need:
            msg = f"{name}: workspace_size={size} is smaller than the {need} bytes planned"
            raise ParamInvalidError(msg)
        if need == 0:
            return None
        if workspace is None:
            msg = f"{name}: workspace is None but the executor needs {need} bytes"
            raise ParamInvalidError(msg)
        if not isinstance(workspace, np.ndarray) or (
            workspace.dtype is not _U8 and workspace.dtype != _U8  # ``is``: numpy's one uint8
        ):
            msg = f"{name}: workspace must be a numpy uint8 array, got {workspace!r:.60}"
            raise TypeError(msg)
        if not workspace.flags.c_contiguous or workspace.nbytes < need:
            msg = (
                f"{name}: workspace must be a contiguous uint8 array of at least {need} "
                f"bytes; got {workspace.nbytes} bytes, contiguous={workspace.flags.c_contiguous}"
            )
            raise ParamInvalidError(msg)
        return workspace if workspace.ndim == 1 else workspace.reshape(-1)

    def _require_live(self, what: str) -> None:
        if self._state is ExecutorState.DESTROYED:
            msg = f"{self.op.name} executor: {what} after destroy()"
            raise ParamInvalidError(msg)


def null_executor(name: str) -> InnerError:
    """The error for launching ``None`` instead of an executor (561103)."""
    msg = f"{name}: executor is None; pass the executor from get_workspace_size"
    return InnerError(msg, status=Status.ERR_INNER_NULLPTR)


def get_workspace_size(
    op: Operator, tensors: dict[str, Any], scalars: dict[str, Any], product: str = "generic"
) -> tuple[int, Executor]:
    """Phase one of ``op``'s two-phase call: check (as ``product``'s runtime would) and
    plan; return the workspace size and a single-use executor bound to ``tensors``."""
    return PLANS.plan(op, tensors, scalars, product)


@attrs.frozen
class PlanCacheStatistics:
    """The two-phase API's plan cache counters (:func:`opsched.aclnn.plan_cache_statistics`).

    Attributes:
        hits: calls whose checks and plan were found by geometry.
        misses: cacheable calls checked and planned in full.
        uncached: calls the cache does not take (arrays that are not plain and
            C-contiguous, unhashable scalars), each checked and planned in full.
        evictions: plans dropped, least recently used first, because the cache was full.
        size: plans held now.
        limit: the most it holds.
    """

    hits: int
    misses: int
    uncached: int
    evictions: int
    size: int
    limit: int


@attrs.define(eq=False)
class PlanCache:
    """Checked scalars, plan and workspace size of recent two-phase calls, by geometry.

    A call that repeats one (the usual training step) skips the checks and the planning:
    they depend on nothing the key leaves out. Cached: plain, C-contiguous numpy arrays
    (their strides follow from shape and dtype, and nothing is staged for its layout) and
    hashable scalars. The key holds the signature (shapes, dtypes, scalars), the product,
    whether each output is writeable and whether an output overlaps an input (the plan
    stages it then). An :class:`~opsched._lru.LRU` (the one cache type). Any thread may
    call; a race costs at most a plan made twice or a miscounted counter, never a wrong
    plan.
    """

    limit: int = 256
    _plans: LRU[Hashable, tuple[dict[str, Any], Any, int, Any]] = attrs.field(init=False)
    _uncached: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        self._plans = LRU(self.limit)

    def plan(
        self, op: Operator, tensors: dict[str, Any], scalars: dict[str, Any], product: str
    ) -> tuple[int, Executor]:
        """Phase one through the cache: as :func:`get_workspace_size`."""
        key = self._key(op, tensors, scalars, product)
        found = self._plans.lookup(key) if key is not None else None
        if found is None:
            checked = op.check_on(product_named(product), tensors, scalars, allocate=False)
            host = LAUNCHERS[op.name]
            plan = host.plan(tensors, checked, DEFAULT_BLOCK)
            # a launch kept only where the key fixes the layout (plain, C-contiguous arrays)
            launch = None if key is None else host.prepare(plan, tensors)
            found = checked, plan, host.workspace_size(plan), launch
            if key is None:
                self._uncached += 1
            else:
                self._plans.put(key, found)
        checked, plan, size, launch = found
        return size, Executor(op, tensors, dict(checked), plan, size, launch=launch)

    def statistics(self) -> PlanCacheStatistics:
        """A snapshot of the counters."""
        plans = self._plans
        return PlanCacheStatistics(
            plans.hits, plans.misses, self._uncached, plans.evictions, len(plans), self.limit
        )

    @staticmethod
    def _key(
        op: Operator, tensors: dict[str, Any], scalars: dict[str, Any], product: str
    ) -> Hashable | None:
        """What a call's checks and plan depend on, or None when it is not cached."""
        signature = op.signature(tensors, scalars)
        if signature is None:
            return None
        for array in tensors.values():  # this runs for every call: no dict of flags
            if array is not None and not array.flags.c_contiguous:
                return None
        writeable = []
        for name in op.outputs:
            array = tensors.get(name)
            writeable.append(array is None or array.flags.writeable)
        return op.name, product, signature, tuple(writeable), op.overlaps_any(tensors)


#: The process's plan cache (the two-phase API's).
PLANS = PlanCache()


def launch(
    op: Operator, workspace: object, workspace_size: object, executor: object, stream: object
) -> None:
    """Phase two of ``op``'s two-phase call: launch ``executor`` in the calling thread.

    Raises:
        InnerError: ``executor`` is None (561103).
        TypeError: ``executor`` is not an Executor, or ``stream`` is not None.
        ParamInvalidError: executor misuse or a too-small workspace (161002).
        RuntimeLaunchError: the kernel failed (361001), its exception chained.
    """
    if executor is None:
        raise null_executor(op.name)
    if not isinstance(executor, Executor):
        msg = f"{op.name}: executor must be an opsched Executor, got {type(executor).__qualname__}"
        raise TypeError(msg)
    if stream is not None:
        msg = f"{op.name}: stream must be None (run in the calling thread), got {stream!r}"
        raise TypeError(msg)
    executor.run(op, workspace, workspace_size)
