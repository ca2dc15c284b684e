"""The torch devices: ``torch:cpu``, ``torch:cuda[:i]``, ``torch:npu[:i]`` (torch_npu).

The same scheduler drives the framework's operators on its own devices:

- **Data** lives in torch tensors on the device. Requests may pass torch tensors on that
  device or numpy arrays (copied in); results come back as the kind of the inputs (numpy
  when every array argument was numpy). A tensor on another device is a ParamInvalidError.
  The checks run on zero-byte numpy stand-ins of the tensors' shapes and dtypes, so every
  SPEC check, product profile and fusion key is the numpy devices' own.
- **Operators**: GluBackward is ``torch.ops.aten.glu_backward`` (``aclnnGluBackward`` on
  torch_npu); GroupNormalizationGrad is the SPEC formula in torch operations, in float32
  (torch_npu binds no aten op to ``aclnnGroupNormalizationGrad``); GroupNormBackward is
  ``torch.ops.aten.native_group_norm_backward``.
- **Fusion**: a fused launch runs its requests' operator calls back to back in one stream
  task: one hand-off to the stream and back for the whole batch. The framework's CPU
  kernels are vectorised with scalar tails, so one call on concatenated inputs would not give
  each request the bits of its own call (measured for ``glu_backward``); separate calls do.
  Large requests are split across idle streams as on the numpy devices (tensor views).
- **Streams**: one worker thread per stream (an honest emulation on the CPU, where torch has
  no streams). On CUDA / NPU that thread issues the launch on its own framework stream
  (after the device's default stream, where the inputs were made), then records a
  framework event and blocks on it: completion reaches the event loop from one
  thread per stream, never one per launch, and a launch's tensors (held by its requests) stay
  alive until that event has completed (no ``record_stream``).
- **Memory** is the framework's caching allocator (CUDA / NPU); ``statistics().pool``
  reports its counters there. On the CPU torch has none: the pool statistics are zero.

torch is imported only when such a device is created; without it, asking for one is an
ImportError that says how to install it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import ml_dtypes
import numpy as np

from opsched import _torch_ops
from opsched._devices import Device, _ThreadStream
from opsched._errors import ParamInvalidError
from opsched._pool import PoolStatistics
from opsched._products import product_of_device
from opsched.ops import Operator

__all__ = ["TorchDevice", "is_torch_tensor", "numpy_dtype", "stand_in"]

_NUMPY_OF = {  # torch dtype name -> numpy dtype
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


def is_torch_tensor(value: object) -> bool:
    """Whether ``value`` is a torch tensor (without importing torch)."""
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr")


def numpy_dtype(tensor: Any) -> np.dtype:
    """The numpy dtype of a torch tensor's dtype (``torch.float32`` -> float32)."""
    name = str(tensor.dtype).removeprefix("torch.")
    found = _NUMPY_OF.get(name)
    if found is None:
        msg = f"torch dtype {tensor.dtype} has no numpy counterpart opsched knows"
        raise TypeError(msg)
    return found


def stand_in(tensor: Any) -> np.ndarray:
    """A zero-byte numpy array with the tensor's shape and dtype, for the checks."""
    return np.broadcast_to(np.empty((), numpy_dtype(tensor)), tuple(tensor.shape))


@attrs.define(eq=False)
class TorchDevice(Device):
    """A torch device; see the module docstring. Create with :func:`make_device`."""

    torch_device: Any = attrs.field(default=None, kw_only=True)
    framework_streams: list[Any] = attrs.field(factory=list, kw_only=True)
    kind: str = attrs.field(default="torch", kw_only=True)
    _torch: Any = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        import torch

        self._torch = torch

    @classmethod
    def create(cls, name: str, streams: int) -> TorchDevice:
        """Parse ``torch:cpu`` / ``torch:cuda[:i]`` / ``torch:npu[:i]`` and open it.

        Raises:
            ImportError: torch (or torch_npu for ``npu``) is not installed.
            ValueError: a malformed name, or no such device here.
        """
        torch = _torch_ops.require_torch(f"device {name!r}")
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
        reported = None
        if kind == "npu" and backend is not None:  # e.g. "Ascend910B2": the SoC names it
            reported = product_of_device(str(backend.get_device_name(torch_device.index)))
        return cls(
            name,
            [_ThreadStream(i) for i in range(streams)],
            inline_capable=False,
            torch_device=torch_device,
            framework_streams=framework,
            reported_product=reported,
        )

    # ------------------------------------------------------------------ data in and out

    def admit(self, op: str, name: str, value: Any) -> Any:
        """``value`` as a tensor on this device: numpy copied in, a tensor checked.

        Raises:
            ParamInvalidError: a tensor on another device.
        """
        if isinstance(value, np.ndarray):  # on the CPU a view of it where possible
            return _torch_ops.to_torch(value, self.torch_device, share=True)
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
        kind = self.torch_device.type
        if kind == "cpu":
            return PoolStatistics(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
        import torch

        stats = getattr(torch, kind).memory_stats(self.torch_device)

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

    # ------------------------------------------------------------------------ launches

    def execute(self, op: Operator, requests: Sequence[Any], stream: int) -> dict[int, Any]:
        """Run each request's operator call in turn on ``stream``; return the failures by
        request id (an injected fault or a framework error fails that request only)."""
        errors: dict[int, BaseException] = {}
        framework = self.framework_streams[stream] if self.framework_streams else None
        context: Any = contextlib.nullcontext()
        if framework is not None:
            backend = getattr(self._torch, self.torch_device.type)
            # Inputs were made on the device's default stream (the caller's work, numpy
            # copied in): this stream starts after what is queued there now.
            framework.wait_stream(backend.default_stream(self.torch_device))
            context = backend.stream(framework)
        with context:
            for r in requests:
                try:
                    self.check_fault([r])
                    run_request(op.name, r.tensors, r.scalars)
                except Exception as exc:  # the launch boundary of one request
                    errors[r.id] = exc
            if framework is not None:
                event = framework.record_event()
                event.synchronize()  # this stream's thread waits; the loop does not
        return errors

    def run_kernel(self, op: Operator, plan: Any, tensors: dict[str, Any], workspace: Any) -> None:
        msg = f"{self.name} runs requests through execute(), not planned kernels"
        raise NotImplementedError(msg)


def run_request(op: str, t: Mapping[str, Any], s: Mapping[str, Any]) -> None:
    """One operator call with torch, into the request's output tensors."""
    if op == "GluBackward":
        if t["self"].numel():
            t["out"].copy_(_torch_ops.glu_backward(t["grad_out"], t["self"], s["dim"]))
    elif op == "GroupNormalizationGrad":
        if t["x"].numel():
            dx = _torch_ops.group_norm_grad(t["x"], t["dy"], t["gamma"], t["mean"], t["rstd"])
            t["dx"].copy_(dx)
    elif op == "GroupNormBackward":
        _group_norm_backward(t, s)
    else:
        msg = f"the torch devices do not run {op}"
        raise NotImplementedError(msg)


def _group_norm_backward(t: Mapping[str, Any], s: Mapping[str, Any]) -> None:
    n, c, hxw, group, mask = s["N"], s["C"], s["HxW"], s["group"], s["output_mask"]
    outs = (t["dx"], t["dgamma"], t["dbeta"])
    if n * c * hxw == 0:
        for out in outs[1:]:
            if out is not None:
                out.zero_()
        return
    gamma = t["gamma"].reshape(c) if t["gamma"] is not None else None
    results = _torch_ops.group_norm_backward(
        t["grad_out"].reshape(n, c, hxw),
        t["input"].reshape(n, c, hxw),
        t["mean"].reshape(n, group),
        t["rstd"].reshape(n, group),
        gamma,
        n,
        c,
        hxw,
        group,
        mask,
    )
    for out, result in zip(outs, results, strict=True):
        if out is not None and result is not None:
            out.copy_(result.reshape(out.shape))


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
