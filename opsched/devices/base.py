"""The device interface: what the scheduler core may ask of a device, and nothing more.

A :class:`Device` owns its streams and everything about where data lives and how a launch
is prepared. The core calls these hooks and never learns which device it has:

- **admission**: :meth:`Device.meta` (what the checks see of the arguments),
  :meth:`Device.bind` (the request's arrays on the device, outputs allocated, and how its
  result returns to the caller), :meth:`Device.check_fits` (a request too big for the
  device's workspace), :meth:`Device.launch_key` (which requests may share a launch);
- **launches**: :meth:`Device.prepare` turns a batch (solo, fused or one part of a split
  request) into the work its stream runs, or None when out of memory;
  :meth:`Device.release` returns what a finished launch held;
- **graphs**: :meth:`Device.intermediate` / :meth:`Device.release` for a graph's
  intermediate outputs, :meth:`Device.empty` for outputs handed to the caller,
  :meth:`Device.graph_converter`;
- **memory**: :meth:`Device.memory_statistics` and the torch-named ``memory_stats``,
  ``reset_peak_stats``, ``empty_cache``; :meth:`Device.executor_statistics`.

A batch is duck-typed (:class:`LaunchBatch`): the devices never import the core. Known
devices are created by :func:`opsched.devices.make_device`.
"""

from __future__ import annotations

import abc
import sys
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import ml_dtypes
import numpy as np
from numpy.lib.stride_tricks import as_strided

from opsched._lru import LRUStatistics as CacheStatistics
from opsched.devices.pool import PoolStatistics
from opsched.devices.streams import Event, Stream
from opsched.ops import Operator

__all__ = [
    "Converter",
    "Device",
    "InjectedFault",
    "LaunchBatch",
    "LaunchRequest",
    "Prepared",
    "allocate_missing",
    "is_tensor",
    "meta_of",
    "numpy_dtype",
]

#: Turns a device's result into what the caller gets (e.g. a tensor into numpy).
Converter = Callable[[Any], Any]


class InjectedFault(RuntimeError):
    """Raised inside a launch chosen by a device's fault injector."""


class LaunchRequest(Protocol):
    """What a device reads of a scheduler request."""

    id: int
    op: Operator
    tensors: dict[str, Any]
    scalars: dict[str, Any]
    units: int
    signature: Hashable | None


class LaunchBatch(Protocol):
    """What a device reads of a batch to launch."""

    requests: list[Any]
    stream: int
    key: Hashable
    fused: bool
    part: tuple[dict[str, Any], dict[str, Any]] | None

    @property
    def units(self) -> int: ...


@attrs.frozen
class Prepared:
    """A launch ready to run on its stream.

    Attributes:
        work: runs in the stream: returns ``(errors by request id, start, end)``
            (``time.perf_counter`` seconds).
        token: what :meth:`Device.release` takes back when the launch has finished.
        cache_hit: whether a cached executor served it; None: its requests ran on their
            solo plans, one after another (no executor of the cache).
        one_call: the launch of several requests is one compiled call that holds the GIL
            only to start and to return: like a solo launch, it may compute on its
            stream's thread while the loop runs (a launch of many Python calls holds the
            GIL throughout, and runs inline).
    """

    work: Callable[[], tuple[dict[int, BaseException], float, float]]
    token: Any = None
    cache_hit: bool | None = False
    one_call: bool = False


_NUMPY_OF = {  # a tensor dtype's name -> numpy dtype
    "float64": np.dtype(np.float64),
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int64": np.dtype(np.int64),
    "int32": np.dtype(np.int32),
    "int16": np.dtype(np.int16),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "bool": np.dtype(np.bool_),
}


def allocate_missing(op: Operator, tensors: dict[str, Any], scalars: Mapping[str, Any]) -> None:
    """Allocate the outputs of a checked request that the caller did not give, in place."""
    for name in op.outputs:  # a loop, not any(): this runs for every request
        if tensors[name] is None:
            op.allocate(tensors, scalars)
            return


def is_tensor(value: object) -> bool:
    """Whether ``value`` is a framework tensor (torch's; found without importing torch)."""
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def numpy_dtype(tensor: Any) -> np.dtype:
    """The numpy dtype of a framework tensor's dtype (``torch.float32`` -> float32)."""
    name = str(tensor.dtype).removeprefix("torch.")
    found = _NUMPY_OF.get(name)
    if found is None:
        msg = f"tensor dtype {tensor.dtype} has no numpy counterpart opsched knows"
        raise TypeError(msg)
    return found


def meta_of(value: Any) -> Any:
    """What the checks see of an argument: a framework tensor as a zero-byte numpy array of
    its shape and dtype (writeable, as a tensor is: it may be an ``out=``); anything else as
    it is."""
    if is_tensor(value):
        shape = tuple(value.shape)
        return as_strided(np.empty((), numpy_dtype(value)), shape, (0,) * len(shape))
    return value


@attrs.define(eq=False)
class Device(abc.ABC):
    """A compute device: streams, launch preparation, memory, an optional fault injector."""

    name: str
    streams: list[Stream]
    _faulty: Callable[[Sequence[Any]], bool] | None = attrs.field(default=None, init=False)

    #: Whether small launches may run inline on an idle stream (no thread hop).
    inline_capable: bool = attrs.field(default=True, kw_only=True)
    #: Requests of 1 to this many bytes whose outputs were checked already are bound as
    #: given (:meth:`bind` would change nothing): a host device allocates their missing
    #: outputs at launch. -1: every request is bound.
    binds_as_given: int = attrs.field(default=-1, kw_only=True)
    #: Graph intermediates of fewer bytes are plain new arrays (:meth:`empty`), never asked
    #: of :meth:`intermediate` (default: none is: the default intermediate is one too).
    pools_intermediates_from: int = attrs.field(default=sys.maxsize, kw_only=True)
    #: By operator name: the bytes (inputs and outputs) from which a request gains nothing
    #: from sharing a launch, because the device runs it on its own arrays in every launch
    #: (never gathered or stacked with others), or because its solo launch costs no more
    #: than its share of a fused one. The scheduler runs such a coroutine's request at submit
    #: while no launch is in flight and none of its launch key is queued, up to the size
    #: the loop may run inline (see :meth:`opsched.core.engine.Engine.runs_at_submit`). A
    #: request of an operator not named here always gains (default: every one does).
    runs_alone_from: Mapping[str, int] = attrs.field(factory=dict, kw_only=True)
    #: Whether :meth:`run_solo` can run a lone request in the calling thread.
    runs_in_caller: bool = attrs.field(default=False, kw_only=True)
    #: The Ascend product the device says it is (an NPU's SoC name), else None.
    reported_product: str | None = attrs.field(default=None, kw_only=True)
    #: Whether callers may pass framework tensors as well as numpy arrays.
    accepts_tensors: bool = attrs.field(default=False, kw_only=True)
    #: What a caller may pass as an array, for error messages.
    array_kinds: str = attrs.field(default="a numpy.ndarray", kw_only=True)
    #: The error that lost the device for good (an accelerator's sticky fault), else None:
    #: the scheduler then refuses new requests and fails those queued, with this cause.
    lost: BaseException | None = attrs.field(default=None, init=False)

    # ------------------------------------------------------------------------ faults

    def inject_faults(self, predicate: Callable[[Sequence[Any]], bool] | None) -> None:
        """Make launches fail when ``predicate(requests)`` is true (None: no faults).

        The predicate sees the scheduler requests of a launch (each with ``.op``,
        ``.tensors``, ``.scalars`` and ``.id``). Fused launches that fail are re-run in halves
        until the requests that make the predicate true are isolated, exactly as for a real
        kernel failure. It runs in the stream's thread.
        """
        self._faulty = predicate

    def check_fault(self, requests: Sequence[Any]) -> None:
        """Raise InjectedFault when the injector picks this launch."""
        faulty = self._faulty
        if faulty is not None and faulty(requests):
            msg = f"injected fault in a launch of {len(requests)} request(s)"
            raise InjectedFault(msg)

    # --------------------------------------------------------------------- admission

    def meta(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """What the checks see of a request's arrays (default: the arrays themselves)."""
        return dict(tensors)

    def bind(
        self,
        op: Operator,
        tensors: dict[str, Any],
        scalars: dict[str, Any],
        spec: Mapping[str, tuple[tuple[int, ...], np.dtype]],
        nbytes: int,
    ) -> tuple[dict[str, Any], Converter | None]:
        """A checked request's arrays as the launch uses them, outputs allocated (``spec``:
        each output's shape and dtype; ``nbytes``: what the request reads and writes), and
        the converter of its result (None: as is). ``tensors`` is the request's own dict,
        made for it by the checks: a device may update it in place and return it.

        The default keeps numpy arrays where they are and allocates missing outputs.
        """
        allocate_missing(op, tensors, scalars)
        return tensors, None

    def check_fits(  # noqa: B027 - optional hook
        self,
        op: Operator,
        tensors: Mapping[str, Any],
        scalars: Mapping[str, Any],
        key: Hashable,
        units: int,
        nbytes: int,
    ) -> None:
        """Raise ParamInvalidError when this request alone could never get its workspace
        (default: nothing to check)."""

    def launch_key(self, op: Operator, tensors: Mapping[str, Any], key: Hashable) -> Hashable:
        """The key of the launches a checked request may share (``key``: the operator's
        fusion key, which a fused kernel's layout needs). Asked where the checks run in full
        (a signature's first call), never on the cached path. Default: the fusion key."""
        return key

    def admit(self, where: str, name: str, value: Any) -> Any:
        """An input array bound at a graph run, as the launch uses it (default: as is)."""
        return value

    def empty(self, shape: Sequence[int], dtype: np.dtype) -> Any:
        """A new array of ``shape`` and ``dtype`` on this device (a caller's output)."""
        return np.empty(tuple(shape), dtype)

    def graph_converter(self, given: Iterable[Any]) -> Converter | None:
        """How a graph run's results return to the caller, given the arrays the caller
        passed (its inputs and node constants); None: as they are."""
        return None

    # ---------------------------------------------------------------------- launches

    @abc.abstractmethod
    def prepare(self, batch: LaunchBatch, *, overflow: bool = False) -> Prepared | None:
        """The work that runs ``batch`` on its stream, or None when the device is out of
        workspace (the batch waits for a launch to finish). ``overflow``: the last resort,
        workspace beyond the cap when nothing in flight could return any."""

    def run_solo(self, request: LaunchRequest, *, outputs_made: bool = False) -> None:
        """Run one request now, in the calling thread, exactly as its solo launch would
        (only where :attr:`runs_in_caller`): the sync facade's lone blocking calls.
        ``outputs_made``: every output the request has came from this device's
        :meth:`empty` or :meth:`intermediate` for it (a graph node's): new arrays in the
        device's own layout, overlapping none of its inputs, so the device may plan it by
        its inputs alone, as a request whose outputs it allocates itself."""
        msg = f"{self.name} cannot run a request in the calling thread"
        raise NotImplementedError(msg)

    def release(self, token: Any) -> None:  # noqa: B027 - optional hook
        """Take back what a finished launch or a graph intermediate held."""

    def intermediate(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[Any, Any]:
        """A graph's intermediate output and its token for :meth:`release` (default: a
        plain new array, nothing to release)."""
        return self.empty(shape, dtype), None

    def wait_events(self, stream: Stream, events: Sequence[Event]) -> None:
        """Make ``stream``'s next launch wait for ``events`` (graph edges across streams)."""
        for event in events:
            stream.wait_event(event)

    # ------------------------------------------------------------------------ memory

    @abc.abstractmethod
    def memory_statistics(self) -> PoolStatistics:
        """The device memory's counters, in the workspace pool's vocabulary."""

    def memory_usage(self) -> tuple[int, int]:
        """``(bytes in use, bytes held)`` now, cheaply (trace counters)."""
        stats = self.memory_statistics()
        return stats.in_use, stats.current

    @abc.abstractmethod
    def memory_stats(self) -> dict[str, int]:
        """The memory counters with torch-style keys."""

    def reset_peak_stats(self) -> None:  # noqa: B027 - optional hook
        """Restart the peak counters from the current values."""

    def empty_cache(self) -> None:  # noqa: B027 - optional hook
        """Release cached, idle memory."""

    def executor_statistics(self) -> CacheStatistics:
        """The executor cache's counters (zeros where the device plans nothing)."""
        return CacheStatistics(0, 0, 0, 0, 0)

    def close(self) -> None:
        """Stop every stream (their threads finish their current work first)."""
        for stream in self.streams:
            stream.close()
