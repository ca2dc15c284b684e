"""The torch devices: ``torch:cpu``, ``torch:cuda[:i]``, ``torch:npu[:i]`` (torch_npu).

The same scheduler drives the framework's operators on its own devices:

- **Data** lives in torch tensors on the device. Requests may pass torch tensors on that
  device or numpy arrays (copied in); results come back as the kind of the inputs (numpy
  when every array argument was numpy). A tensor on another device is a ParamInvalidError.
  On the CPU a request of numpy arrays only keeps them as numpy until its launch, which
  gathers them with one numpy copy per operand and hands back numpy views
  (:class:`~opsched.devices.torch.layout.HostOperands`): converting each array at submit
  cost more than the launch.
  The checks run on zero-byte numpy stand-ins of the tensors' shapes and dtypes, so every
  check (docs/operators.md), product profile and fusion key is the numpy devices' own.
- **Operators**: each operator's launcher (:mod:`opsched.devices.torch.launchers`, one
  module per operator) says which framework operators compute it.
- **Fusion**: a fused launch is a few framework calls on the batch's requests stacked by
  shape (the launcher's ``launch``), batch-invariant by construction: each request's
  rows keep the framework's own layout of it, and on the CPU no call is large enough for
  aten to split it between intra-op threads (:mod:`opsched.devices.torch.layout` has the
  measurements). A request's bits do not depend on the batch, its position or the thread
  count; GluBackward and GroupNormalizationGrad give the framework's own call's bits where
  that call is serial, GroupNormBackward its dx (dgamma / dbeta are summed per sample: within the
  tolerance of docs/operators.md). Results the caller gave no ``out=`` for are views of the launch's
  stacked output. Large requests are split across idle streams as on the numpy devices (tensor
  views).
- **Streams**: one worker thread per stream (an honest emulation on the CPU, where torch
  has no streams; there, as on the numpy cpu device, launches up to ``inline_max_bytes``
  run inline on an idle stream, which saves the hop to the stream's thread). On CUDA / NPU
  each thread binds itself once to the device and to its own framework stream, waits on
  the device for the streams its requests' callers submitted from, issues the launch,
  marks its results used by those streams (``record_stream``), and sleeps on a blocking
  event: completion reaches the event loop from one thread per stream, never one per
  launch, and a launch's tensors (held by its requests) stay alive until the event has
  completed. A device error there fails the launch; a sticky one loses the device
  (:attr:`Device.lost`).
- **Graph edges** across streams wait on the device there (:class:`FrameworkStream`): a
  consumer's stream waits only until its producer's kernels are issued, then makes its
  framework stream ``wait_event`` the producer's framework event, so the consumer's launch
  is queued before the producer finishes. On torch:cpu the stream thread waits (host).
- **Memory** is the framework's caching allocator (CUDA / NPU); ``statistics().pool``
  reports its counters there. On the CPU torch has none: the pool statistics are zero.

torch is imported only when such a device is created; without it, asking for one is an
ImportError that says how to install it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import attrs
import numpy as np

from opsched._errors import GraphExecutionError, ParamInvalidError
from opsched._log import ERROR, WARNING, enabled, get_logger
from opsched.devices.base import (
    _NUMPY_OF,
    Converter,
    Device,
    LaunchBatch,
    Prepared,
    is_tensor,
    meta_of,
)
from opsched.devices.malloc import keep_freed_memory
from opsched.devices.pool import PoolStatistics
from opsched.devices.streams import FrameworkStream, Stream, ThreadStream
from opsched.devices.torch import aten
from opsched.devices.torch.launchers import ALONE_BYTES, LAUNCHERS
from opsched.devices.torch.layout import HostOperands
from opsched.ops import Operator, register_array_type
from opsched.ops.products import product_of_device

__all__ = ["TorchDevice"]

_log = get_logger("opsched.device")


class _Part(NamedTuple):
    """One part of a split request as the device runs it (its views of the tensors)."""

    id: int
    op: Operator
    tensors: dict[str, Any]
    scalars: dict[str, Any]


@attrs.define(eq=False)
class TorchDevice(Device):
    """A torch device; see the module docstring. Create with :func:`make_device`."""

    torch_device: Any = attrs.field(default=None, kw_only=True)
    framework_streams: list[Any] = attrs.field(factory=list, kw_only=True)
    kind: str = attrs.field(default="torch", kw_only=True)
    #: Requests at least this large may be split across streams (the scheduler's
    #: ``split_min_bytes``): they get their outputs before the launch.
    split_min_bytes: int = attrs.field(default=8 << 20, kw_only=True)
    _torch: Any = attrs.field(default=None, init=False)
    #: The framework's module for the device's kind (``torch.cuda``, ``torch.npu``; None on
    #: the CPU): streams, events, synchronisation.
    _backend: Any = attrs.field(default=None, init=False)
    #: Whether ``torch_device`` is the CPU, read once: ``torch.device.type`` costs 0.4 us
    #: a read, and :meth:`bind` asks for every request.
    _on_cpu: bool = attrs.field(default=False, init=False)
    #: ``torch.Tensor`` and ``torch.strided``, read once (:meth:`bind` checks every array
    #: of every request against them; a module attribute costs a lookup each time).
    _tensor: Any = attrs.field(default=None, init=False)
    _strided: Any = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        import torch

        self._torch = torch
        self._tensor, self._strided = torch.Tensor, torch.strided
        self._on_cpu = self.torch_device is not None and self.torch_device.type == "cpu"
        if self.torch_device is not None and not self._on_cpu:
            self._backend = getattr(torch, self.torch_device.type, None)
        # the checks see a tensor's shape and dtype only (its device is checked at bind)
        register_array_type(torch.Tensor)

    @classmethod
    def create(
        cls, name: str, streams: int, *, split_min_bytes: int = 8 << 20, malloc_keep_bytes: int = 0
    ) -> TorchDevice:
        """Parse ``torch:cpu`` / ``torch:cuda[:i]`` / ``torch:npu[:i]`` and open it. On the
        CPU, glibc's malloc keeps ``malloc_keep_bytes`` of freed memory for the launches'
        outputs (torch allocates CPU tensors with the C library's malloc;
        :func:`~opsched.devices.malloc.keep_freed_memory`: process-wide).

        Raises:
            ImportError: torch (or torch_npu for ``npu``) is not installed.
            ValueError: a malformed name, or no such device here.
        """
        torch = aten.require_torch(f"device {name!r}")
        spec = name.removeprefix("torch:")
        kind, _, index = spec.partition(":")
        if kind not in ("cpu", "cuda", "npu") or (index and not index.isdigit()):
            msg = (
                f"unknown device {name!r}; expected torch:cpu, torch:cuda, torch:cuda:N, "
                "torch:npu or torch:npu:N"
            )
            raise ValueError(msg)
        if kind == "cpu" and index:
            msg = f"device {name!r}: torch:cpu takes no index"
            raise ValueError(msg)
        backend = None
        if kind == "npu":
            try:
                import torch_npu  # noqa: F401 - registers torch.npu
            except ImportError as exc:
                msg = f"device {name!r} needs torch_npu (Ascend's PyTorch adapter)"
                raise ImportError(msg) from exc
        if kind != "cpu":
            backend = getattr(torch, kind)
            count = backend.device_count() if backend.is_available() else 0
            i = int(index) if index else backend.current_device() if count else 0
            if i >= count:
                msg = f"device {name!r}: this machine has {count} {kind} device(s)"
                raise ValueError(msg)
            torch_device = torch.device(kind, i)
            framework = [backend.Stream(device=torch_device) for _ in range(streams)]
        else:
            torch_device = torch.device("cpu")
            framework = []
            keep_freed_memory(malloc_keep_bytes)
        reported = None
        if kind == "npu" and backend is not None:  # e.g. "Ascend910B2": the SoC names it
            reported = product_of_device(str(backend.get_device_name(torch_device.index)))
        # on an accelerator each stream's thread issues onto its framework stream, and
        # graph edges wait there; the CPU has no framework streams
        threads: list[Stream] = (
            [
                FrameworkStream(i, framework=f, bind=_binder(backend, torch_device, f))
                for i, f in enumerate(framework)
            ]
            if framework
            else [ThreadStream(i) for i in range(streams)]
        )
        return cls(
            name,
            threads,
            inline_capable=kind == "cpu",
            runs_in_caller=kind == "cpu",
            runs_alone_from=dict.fromkeys(LAUNCHERS, ALONE_BYTES),
            accepts_tensors=True,
            array_kinds="a numpy.ndarray or a torch tensor",
            torch_device=torch_device,
            framework_streams=framework,
            reported_product=reported,
            split_min_bytes=split_min_bytes,
        )

    # ------------------------------------------------------------------ data in and out

    def admit(self, op: str, name: str, value: Any) -> Any:
        """``value`` as a tensor on this device: numpy copied in, a tensor checked.

        Raises:
            TypeError: a tensor that is not strided (sparse COO / CSR / CSC / BSR / BSC,
                mkldnn): the operators read dense memory.
            ParamInvalidError: a tensor on another device.
        """
        if isinstance(value, np.ndarray):  # on the CPU a view of it where possible
            return aten.to_torch(value, self.torch_device, share=True)
        if value.layout is not self._torch.strided:
            msg = (
                f"{op}: {name} is a tensor of layout {value.layout}; the operators compute "
                f"dense (torch.strided) tensors: pass {name}.to_dense()"
            )
            raise TypeError(msg)
        if value.device != self.torch_device:
            msg = (
                f"{op}: {name} is on {value.device}; the scheduler's device is "
                f"{self.torch_device} ({self.name}): pass tensors on it, or numpy arrays"
            )
            raise ParamInvalidError(msg)
        return value

    def empty(self, shape: Sequence[int], dtype: np.dtype) -> Any:
        """A new tensor of ``shape`` and (numpy) ``dtype`` on this device."""
        return self._torch.empty(shape, dtype=_torch_dtype(dtype), device=self.torch_device)

    def memory_statistics(self) -> PoolStatistics:
        """The framework allocator's counters, in the workspace pool's vocabulary."""
        stats = self.memory_stats()

        def get(key: str) -> int:
            return int(stats.get(key, 0))

        return PoolStatistics(
            current=get("reserved_bytes.all.current"),
            peak=get("reserved_bytes.all.peak"),
            in_use=get("allocated_bytes.all.current"),
            allocated=get("reserved_bytes.all.allocated"),
            freed=get("reserved_bytes.all.freed"),
            hits=get("allocation.all.allocated") - get("segment.all.allocated"),
            misses=get("segment.all.allocated"),
            cached_blocks=get("inactive_split.all.current"),
            limit=0,
            overflows=0,
        )

    def _allocator(self) -> Any:
        """The framework's memory module for this device (``torch.cuda``), None on the CPU
        (torch has no caching allocator there)."""
        kind = self.torch_device.type
        return None if kind == "cpu" else getattr(self._torch, kind)

    def memory_stats(self) -> dict[str, int]:
        """The framework allocator's own counters (``torch.cuda.memory_stats``); empty on
        the CPU."""
        allocator = self._allocator()
        return {} if allocator is None else dict(allocator.memory_stats(self.torch_device))

    def reset_peak_stats(self) -> None:
        """``torch.cuda.reset_peak_memory_stats`` for this device (nothing on the CPU)."""
        allocator = self._allocator()
        if allocator is not None:
            allocator.reset_peak_memory_stats(self.torch_device)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache`` (nothing on the CPU)."""
        allocator = self._allocator()
        if allocator is not None:
            allocator.empty_cache()

    # --------------------------------------------------------------------- admission

    def meta(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Tensors as zero-byte numpy stand-ins: the checks, product profiles and fusion
        keys are the numpy devices' own."""
        return {name: meta_of(value) for name, value in tensors.items()}

    def bind(
        self,
        op: Operator,
        tensors: dict[str, Any],
        scalars: dict[str, Any],
        spec: Mapping[str, tuple[tuple[int, ...], np.dtype]],
        nbytes: int,
    ) -> tuple[dict[str, Any], Converter | None]:
        """The request's arrays moved to the device; results return as numpy when every
        array given was numpy (into the caller's ``out=``). Outputs the caller did not
        give come from the launch (its own result, or a view of its stacked output); one
        the scheduler may split across streams gets them now, for its parts to write."""
        if self._on_cpu and 0 < nbytes < self.split_min_bytes:
            # nothing to split: the usual call's strided CPU tensors as they are (a
            # request's first tensor that is not one sends it to the general pass below)
            tensor, strided = self._tensor, self._strided
            for value in tensors.values():
                if value is not None and not (
                    type(value) is tensor and value.is_cpu and value.layout is strided
                ):
                    break
            else:
                return tensors, None
            # numpy in, numpy out: the arrays stay numpy until the launch gathers them
            # (ops/_framework.py, host operands)
            ndarray = np.ndarray
            for value in tensors.values():
                if type(value) is not ndarray and value is not None:
                    break
            else:
                return HostOperands(tensors), None
        tensor, where, on_cpu = self._tensor, self.torch_device, self._on_cpu
        strided = self._strided
        # one pass (this runs for every request), in place (``tensors`` is the request's
        # own dict): a tensor on this device as it is, anything else through admit()
        caller_out: dict[str, np.ndarray] | None = None
        numpy_in = True
        for name, value in tensors.items():
            if (
                type(value) is tensor
                and (value.is_cpu if on_cpu else value.device == where)
                and value.layout is strided
            ):
                numpy_in = False
            elif value is not None:
                tensors[name] = self.admit(op.name, name, value)
                if not isinstance(value, np.ndarray):
                    numpy_in = False
                elif name in spec:
                    if caller_out is None:
                        caller_out = {}
                    caller_out[name] = value
        if nbytes == 0 or (
            nbytes >= self.split_min_bytes and op.splits and len(self.streams) > 1
        ):  # may be split: parts write into views
            for name, (shape, dtype) in spec.items():
                if tensors[name] is None:
                    tensors[name] = self.empty(shape, dtype)
        if self._backend is not None:  # the stream the caller works on, now (thread-local)
            tensors = OnStream(tensors, self._backend.current_stream(where))
        if numpy_in or caller_out:
            return tensors, _to_numpy(op, caller_out or {})
        return tensors, None

    def launch_key(self, op: Operator, tensors: Mapping[str, Any], key: Hashable) -> Hashable:
        """Requests of one operator and dtypes share launches, whatever their shapes: the
        launcher stacks those whose rows match and runs the rest on their own tensors
        (a fused layout of fixed geometry, what the fusion key names, is the host
        devices'). Fewer, larger launches: each costs the scheduler a dispatch."""
        return (op.name, *[None if tensors[n] is None else tensors[n].dtype for n in op.inputs])

    def graph_converter(self, given: Iterable[Any]) -> Converter | None:
        """A graph run returns numpy unless some array given to it was a tensor."""
        if any(is_tensor(v) for v in given):
            return None
        return _graph_to_numpy

    # ------------------------------------------------------------------------ launches

    def prepare(self, batch: LaunchBatch, *, overflow: bool = False) -> Prepared | None:
        requests: list[Any] = list(batch.requests)
        op: Operator = requests[0].op
        if batch.part is not None:  # one part of a split request: its views, same id
            r = requests[0]
            views = OnStream(batch.part[0], getattr(r.tensors, "stream", None))
            requests = [_Part(r.id, r.op, views, batch.part[1])]
        stream = batch.stream

        def work() -> tuple[dict[int, BaseException], float, float]:
            start = time.perf_counter()
            errors = self.execute(op, requests, stream)
            return errors, start, time.perf_counter()

        return Prepared(work)

    def run_solo(self, request: Any, *, outputs_made: bool = False) -> None:
        """The solo launch of ``request`` in the calling thread (torch:cpu only, where a
        launch is the framework's calls in whatever thread makes them): the same
        :meth:`execute` as on a stream, so the same bits (which read every tensor's
        layout: ``outputs_made`` changes nothing)."""
        errors = self.execute(request.op, [request], 0)
        if errors:
            raise errors[request.id]

    def execute(self, op: Operator, requests: Sequence[Any], stream: int) -> dict[int, Any]:
        """Run ``requests`` as one batch-invariant framework launch on ``stream``
        (its operator's launcher); return the failures by request id. An injected
        fault fails that request only; when the launch raises, each request runs alone in
        the same layout (the same bits), so only the request that fails gets the error.

        On an accelerator the launch first waits, on the device, for the streams its
        callers worked on when they submitted (their inputs may still be being written
        there), marks its results used by those streams (``record_stream``: the caching
        allocator then keeps a result's memory until the caller's later kernels are done
        with it), and its thread sleeps on a blocking event until the kernels finish. A
        device error that surfaces there (an asynchronous fault) fails the launch's
        requests with the device's message; when the device then fails a trivial call too,
        the error is sticky: the device is lost (:attr:`lost`), and every later launch
        fails at once with that cause."""
        if self.lost is not None:
            return {r.id: _lost_error(self.lost) for r in requests}
        framework = self.framework_streams[stream] if self.framework_streams else None
        issuer = self.streams[stream]
        if isinstance(issuer, FrameworkStream) and issuer.bind_error is not None:
            return {r.id: issuer.bind_error for r in requests}
        errors: dict[int, BaseException] = {}
        context: Any = None  # where the launch issues: an accelerator's framework stream
        default: Any = None
        if framework is not None:
            backend = self._backend
            default = backend.default_stream(self.torch_device)
            for caller in _caller_streams(requests, default):  # after what they queued
                framework.wait_stream(caller)
            context = contextlib.nullcontext()  # the stream's own bound thread: bound already
            if not (isinstance(issuer, ThreadStream) and issuer.worker == threading.get_ident()):
                context = backend.stream(framework)
        if self._faulty is None:  # no fault injector: no call a request
            live = list(requests)
        else:
            live = []
            for r in requests:
                try:
                    self.check_fault([r])
                except Exception as exc:  # an injected fault fails that request only
                    errors[r.id] = exc
                else:
                    live.append(r)
        # outputs are written in place, never recorded: grad mode off for the launch (as
        # torch.no_grad(), at half its cost a launch)
        torch = self._torch
        grad = torch.is_grad_enabled()
        if grad:
            torch.set_grad_enabled(False)
        try:
            if context is None:  # the CPU: no stream to issue on, nothing to wait for
                self._launch(op, live, errors)
            else:
                with context:
                    self._launch(op, live, errors)
                    self._finish_on_device(op, framework, issuer, default, live, errors)
        finally:
            if grad:
                torch.set_grad_enabled(True)
        return errors

    def _finish_on_device(
        self,
        op: Operator,
        framework: Any,
        issuer: Stream,
        default: Any,
        live: list[Any],
        errors: dict[int, BaseException],
    ) -> None:
        """An accelerator launch's end: results marked used by their callers' streams
        (``default`` for a request that recorded none), a blocking event recorded (other
        streams' graph consumers may queue behind it), and this thread asleep until it
        completes; a device error there fails the launch."""
        _used_by(default, live, op, self.record_stream)
        event = self._backend.Event(blocking=True)  # its synchronize sleeps, never spins
        event.record(framework)
        if isinstance(issuer, FrameworkStream):
            issuer.issued(event)
        try:
            event.synchronize()  # this stream's thread waits; the loop does not
        except Exception as exc:  # an asynchronous device error surfaces here
            for r in live:
                errors.setdefault(r.id, exc)
            if self._sticky():
                self.lost = exc
                if enabled(ERROR):
                    _log.error("device lost", device=self.name, error=f"{exc}")

    def _sticky(self) -> bool:
        """Whether the device fails a trivial call too, after an error: it is lost (a
        sticky CUDA error fails every later call of the process's context)."""
        try:
            self._backend.synchronize(self.torch_device)
        except Exception:  # the device keeps failing: the error is sticky
            return True
        return False

    @staticmethod
    def record_stream(tensor: Any, stream: Any) -> None:
        """Mark ``tensor``'s memory used by ``stream`` (``Tensor.record_stream``)."""
        tensor.record_stream(stream)

    def _launch(self, op: Operator, live: list[Any], errors: dict[int, BaseException]) -> None:
        """The framework calls of :meth:`execute`: ``live`` as one launch; when it raises,
        each request alone in the same layout, its failure in ``errors``."""
        launch = LAUNCHERS[op.name].launch
        try:
            launch(live)
        except Exception as batch_exc:  # find the culprit: each alone, in the same layout
            for r in live:
                try:
                    launch([r])
                except Exception as exc:  # the launch boundary of one request
                    errors[r.id] = exc
            if len(live) > 1 and not errors and enabled(WARNING):
                # none failed alone: the launch failed for what it was together (a fault
                # in stacking them, say); the results are right, but that must not pass
                # unseen (said once per launch)
                _log.warning(
                    "a fused launch failed, then its requests ran alone",
                    op=op.name,
                    requests=len(live),
                    error=f"{type(batch_exc).__name__}: {batch_exc}",
                )


class OnStream(dict[str, Any]):
    """A request's tensors on an accelerator, with the framework stream its caller was
    working on when it submitted (``stream``; None where it was not captured)."""

    __slots__ = ("stream",)

    def __init__(self, tensors: Mapping[str, Any], stream: Any) -> None:
        super().__init__(tensors)
        self.stream = stream


def _stream_of(request: Any, default: Any) -> Any:
    """The stream ``request``'s caller worked on when it submitted, else ``default``."""
    stream = getattr(request.tensors, "stream", None)
    return default if stream is None else stream


def _caller_streams(requests: Sequence[Any], default: Any) -> list[Any]:
    """The distinct streams the requests' callers worked on (the device's default stream
    for a request that recorded none), in order."""
    found: list[Any] = []
    for r in requests:
        stream = _stream_of(r, default)
        if not any(stream == s for s in found):
            found.append(stream)
    return found


def _binder(backend: Any, device: Any, framework: Any) -> Callable[[], None]:
    """Bind the calling thread (a stream's worker) to ``device`` and ``framework``: its
    current device (``set_device``: a thread that never sets it would use device 0, and
    on NPU fail) and its current stream, once."""

    def bind() -> None:
        backend.set_device(device)
        backend.set_stream(framework)

    return bind


def _lost_error(cause: BaseException) -> BaseException:
    """What a launch on a lost device fails with: the device's own error, named."""
    error = RuntimeError(
        f"the device was lost to an earlier error ({type(cause).__name__}: {cause}); it "
        "fails every call now: close this scheduler and restart the process"
    )
    error.__cause__ = cause
    return error


def _used_by(default: Any, requests: Sequence[Any], op: Operator, record: Any) -> None:
    """Mark the memory of each request's results as used by the stream its caller worked on
    (``default`` where it recorded none; ``record``: ``Tensor.record_stream``): else, once
    the caller freed one, the caching allocator could hand its block to this stream's next
    launch while the caller's kernels still read it. Once per block and stream (the results
    of a launch are views of a few stacked outputs). Outputs the caller gave, or allocated
    at bind, came from its stream already; marking them too is harmless."""
    seen: set[tuple[int, int]] = set()
    for r in requests:
        stream = _stream_of(r, default)
        for name in op.outputs:
            tensor = r.tensors.get(name)
            if tensor is None:
                continue
            key = (tensor.untyped_storage().data_ptr(), id(stream))
            if key not in seen:
                seen.add(key)
                record(tensor, stream)


def _to_numpy(op: Operator, caller_out: dict[str, np.ndarray]) -> Converter:
    """Converts a result to numpy: into the caller's ``out=`` arrays where it gave them
    (on the CPU they already share the tensors' memory), else new arrays."""
    names = op.outputs

    def convert(result: Any) -> Any:
        outs = result if len(names) > 1 else (result,)
        arrays: list[Any] = []
        for name, tensor in zip(names, outs, strict=True):
            if tensor is None:
                arrays.append(None)
                continue
            array = tensor if type(tensor) is np.ndarray else aten.from_torch(tensor)
            target = caller_out.get(name)
            if target is not None:
                if not np.shares_memory(target, array):
                    np.copyto(target, array)
                array = target
            arrays.append(array)
        return tuple(arrays) if len(names) > 1 else arrays[0]

    return convert


def _graph_value_to_numpy(value: Any) -> Any:
    if isinstance(value, tuple):
        return tuple(None if v is None else aten.from_torch(v) for v in value)
    return None if value is None or isinstance(value, np.ndarray) else aten.from_torch(value)


def _graph_to_numpy(result: Any) -> Any:
    """A graph run's outputs (a list, or its GraphExecutionError) as numpy."""
    if isinstance(result, GraphExecutionError):
        result.outputs = [_graph_value_to_numpy(v) for v in result.outputs]
        return result
    return [_graph_value_to_numpy(v) for v in result]


_TORCH_OF: dict[np.dtype, Any] = {}  # filled on first use (torch imported by then)


def _torch_dtype(dtype: np.dtype) -> Any:
    found = _TORCH_OF.get(dtype)
    if found is None:
        import torch

        for name, np_dtype in _NUMPY_OF.items():
            _TORCH_OF[np_dtype] = getattr(torch, name)
        found = _TORCH_OF.get(dtype)
        if found is None:
            msg = f"numpy dtype {dtype} has no torch counterpart opsched knows"
            raise TypeError(msg)
    return found
