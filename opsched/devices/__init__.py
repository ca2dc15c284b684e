"""Devices: the interface the scheduler core talks to, and its implementations.

:func:`make_device` is the registry: ``"cpu"`` and ``"reference"`` are the host devices
(:mod:`opsched.devices.host`); ``"torch:cpu"``, ``"torch:cuda[:N]"`` and ``"torch:npu[:N]"``
are the framework's (the :mod:`opsched.devices.torch` folder), imported only when asked
for, so torch is never imported otherwise.
"""

from __future__ import annotations

from opsched.devices.base import Device, InjectedFault, Prepared, is_tensor, meta_of
from opsched.devices.cache import CacheStatistics
from opsched.devices.pool import PoolStatistics
from opsched.devices.streams import Event, Stream, StreamStatistics

__all__ = [
    "DEVICES",
    "CacheStatistics",
    "Device",
    "Event",
    "InjectedFault",
    "PoolStatistics",
    "Prepared",
    "Stream",
    "StreamStatistics",
    "is_tensor",
    "make_device",
    "meta_of",
]

#: Device names :func:`make_device` accepts (``torch:cuda:N`` / ``torch:npu:N`` too).
DEVICES = ("cpu", "reference", "torch:cpu", "torch:cuda", "torch:npu")


def make_device(
    name: str,
    streams: int,
    *,
    workspace_limit_bytes: int = 64 << 20,
    executor_cache_limit: int = 1024,
    fuse_max_bytes: int = 1 << 20,
    split_min_bytes: int = 8 << 20,
    malloc_keep_bytes: int = 0,
) -> Device:
    """Create the device called ``name`` with ``streams`` streams.

    Args:
        name: a name from :data:`DEVICES` (``torch:cuda:N`` / ``torch:npu:N`` too).
        streams: how many streams.
        workspace_limit_bytes, executor_cache_limit: the host devices' workspace pool cap
            and executor cache size.
        fuse_max_bytes: the solo-launch threshold (the host devices).
        split_min_bytes: the size from which the scheduler may split a request across
            streams (a torch device gives such a request its outputs before the launch).
        malloc_keep_bytes: the host devices and ``torch:cpu`` (whose tensors torch
            allocates with the C library's malloc): freed memory glibc's malloc keeps for
            their outputs, process-wide (:func:`~opsched.devices.malloc.keep_freed_memory`).

    Raises:
        ValueError: an unknown device name (the message lists the known ones).
        TypeError: ``name`` is not a string.
        ImportError: a torch device without torch installed.
    """
    if not isinstance(name, str):
        msg = f"device must be a string such as 'cpu', got {type(name).__qualname__} {name!r}"
        raise TypeError(msg)
    if name in ("cpu", "reference"):
        from opsched.devices.host import CpuDevice, ReferenceDevice

        cls = CpuDevice if name == "cpu" else ReferenceDevice
        return cls.create(
            streams,
            workspace_limit_bytes=workspace_limit_bytes,
            executor_cache_limit=executor_cache_limit,
            fuse_max_bytes=fuse_max_bytes,
            malloc_keep_bytes=malloc_keep_bytes,
        )
    if name.startswith("torch:"):
        from opsched.devices.torch.aten import require_torch

        require_torch(f"device {name!r}")  # (before the device's modules import it)
        from opsched.devices.torch.device import TorchDevice

        return TorchDevice.create(
            name, streams, split_min_bytes=split_min_bytes, malloc_keep_bytes=malloc_keep_bytes
        )
    msg = f"unknown device {name!r}; expected one of {list(DEVICES)}"
    raise ValueError(msg)
